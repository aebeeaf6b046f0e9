"""Attention Residuals depth mix. ``depth_mix(sources [S, N, d], query [d], eps) -> [N, d]``."""

from k3.ops import backend
from k3.ops.attn_res.reference import depth_mix as depth_mix_reference

backend.register("attn_res", "reference", depth_mix_reference)


def depth_mix(sources, query, eps):
    """See :func:`k3.ops.attn_res.reference.depth_mix`."""
    return backend.dispatch("attn_res", sources.device, sources, query, eps)
