"""A MoE layer's ops: ``moe_inputs`` (its maps of the input, the router's in fp32) and the routed-expert compute
``moe_experts(x, topk_idx, topk_weight, w1, w2, w3, glu) -> [N, D]`` (docs/architecture.md#latentmoe)."""

from torch import Tensor

from k3.ops import backend
from k3.ops.linear import multi_linear
from k3.ops.moe.reference import moe_experts as moe_experts_reference

from k3.ops.moe import grouped as _grouped

backend.register("moe_experts", "reference", moe_experts_reference)
backend.register("moe_experts", "fast", _grouped.moe_experts, _grouped.available)


def moe_inputs(
    x: Tensor, router_weight: Tensor, down_weight: Tensor | None = None, shared_weights: tuple[Tensor, ...] = ()
) -> tuple[Tensor, Tensor | None, list[Tensor]]:
    """A MoE layer's maps of its input x [N, d]: the router's logits [N, E] in fp32 (also under autocast), the
    latent down-projection z [N, l] (None without ``down_weight``) and the shared experts' maps (their gate and up,
    [N, I_s] each). One op so that a decode step reads x once for all of them: k3.ops.linear's kernel where the plan
    chose it, the router's products accumulated in fp32."""
    maps = ([] if down_weight is None else [down_weight]) + list(shared_weights) + [router_weight]
    outs = list(multi_linear(x, maps, fp32=1))  # a list: dynamo may trace a starred unpack as a tuple
    z = None if down_weight is None else outs[0]
    return outs[-1], z, outs[0 if down_weight is None else 1 : -1]


def moe_experts(x, topk_idx, topk_weight, w1, w2, w3, glu, act_quant=None, fp8=False):
    """See :func:`k3.ops.moe.reference.moe_experts`.

    ``act_quant`` (QAT, :mod:`k3.quant.qat`): a function applied to both expert-matmul inputs, x [N, D] (it acts
    per token row, so once before the gather) and each GLU output h [n, I] before w2. It is applied here, by
    composition (x -> act_quant(x), glu -> act_quant . glu), so every backend runs it; None = the exact
    high-precision path. ``fp8`` (:mod:`k3.quant.fp8`, which never turns it on with QAT): the three matmuls in FP8
    with row-wise scales (k3.ops.fp8).
    """
    if act_quant is not None:
        x, glu = act_quant(x), _then(glu, act_quant)
    return backend.dispatch("moe_experts", x.device, x, topk_idx, topk_weight, w1, w2, w3, glu, fp8=fp8)


def _then(glu, act_quant):
    def quantized_glu(gate, up):
        return act_quant(glu(gate, up))

    return quantized_glu
