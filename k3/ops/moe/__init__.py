"""Routed-expert compute. ``moe_experts(x, topk_idx, topk_weight, w1, w2, w3, glu) -> [N, D]``."""

from k3.ops import backend
from k3.ops.moe.reference import moe_experts as moe_experts_reference

from k3.ops.moe import grouped as _grouped

backend.register("moe_experts", "reference", moe_experts_reference)
backend.register("moe_experts", "fast", _grouped.moe_experts, _grouped.available)


def moe_experts(x, topk_idx, topk_weight, w1, w2, w3, glu, act_quant=None):
    """See :func:`k3.ops.moe.reference.moe_experts`.

    ``act_quant`` (QAT, :mod:`k3.quant.qat`): a function applied to both expert-matmul inputs, x [N, D] (it acts
    per token row, so once before the gather) and each GLU output h [n, I] before w2. It is applied here, by
    composition (x -> act_quant(x), glu -> act_quant . glu), so every backend runs it; None = the exact
    high-precision path.
    """
    if act_quant is not None:
        x, glu = act_quant(x), _then(glu, act_quant)
    return backend.dispatch("moe_experts", x.device, x, topk_idx, topk_weight, w1, w2, w3, glu)


def _then(glu, act_quant):
    def quantized_glu(gate, up):
        return act_quant(glu(gate, up))

    return quantized_glu
