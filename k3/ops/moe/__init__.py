"""Routed-expert compute. ``moe_experts(x, topk_idx, topk_weight, w1, w2, w3, glu) -> [N, D]``."""

from k3.ops import backend
from k3.ops.moe.reference import moe_experts as moe_experts_reference

backend.register("moe_experts", "reference", moe_experts_reference)


def moe_experts(x, topk_idx, topk_weight, w1, w2, w3, glu):
    """See :func:`k3.ops.moe.reference.moe_experts`."""
    return backend.dispatch("moe_experts", x.device, x, topk_idx, topk_weight, w1, w2, w3, glu)
