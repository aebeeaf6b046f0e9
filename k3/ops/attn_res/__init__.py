"""Attention Residuals depth mix. ``depth_mix(sources: S x [N, d], query [d], eps) -> [N, d]``.

Backends: ``reference`` (stack + autograd) and ``fast`` (lean.py: hand-written backward that stores no
per-source copies; runs on any device).
"""

from k3.ops import backend
from k3.ops.attn_res.lean import depth_mix as depth_mix_lean
from k3.ops.attn_res.reference import depth_mix as depth_mix_reference

backend.register("attn_res", "reference", depth_mix_reference)
backend.register("attn_res", "fast", depth_mix_lean, lambda device: True)


def depth_mix(sources, query, eps):
    """See :func:`k3.ops.attn_res.reference.depth_mix`."""
    return backend.dispatch("attn_res", sources[0].device, sources, query, eps)
