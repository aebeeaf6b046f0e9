"""Attention Residuals depth mix. ``depth_mix(sources: S x [N, d], query [d], eps) -> [N, d]``.

Backends: ``reference`` (stack + autograd) and ``fast`` (lean.py: hand-written backward that stores no
per-source copies; runs on any device). ``depth_mix_stacked`` (inference over few tokens, stacked.py): the fixed
sources of a pass stacked once; ``reference`` unstacks them through the reference mix.
"""

from k3.ops import backend
from k3.ops.attn_res.lean import depth_mix as depth_mix_lean
from k3.ops.attn_res.reference import depth_mix as depth_mix_reference
from k3.ops.attn_res.stacked import FixedSources, depth_mix_unstacked
from k3.ops.attn_res.stacked import depth_mix as depth_mix_fixed

backend.register("attn_res", "reference", depth_mix_reference)
backend.register("attn_res", "fast", depth_mix_lean, lambda device: True)
backend.register("attn_res_stacked", "reference", depth_mix_unstacked)
backend.register("attn_res_stacked", "fast", depth_mix_fixed, lambda device: True)


def depth_mix(sources, query, eps):
    """See :func:`k3.ops.attn_res.reference.depth_mix`."""
    return backend.dispatch("attn_res", sources[0].device, sources, query, eps)


def depth_mix_stacked(fixed: FixedSources, live, query, eps, dtype):
    """See :func:`k3.ops.attn_res.stacked.depth_mix`."""
    return backend.dispatch("attn_res_stacked", fixed.v.device, fixed, live, query, eps, dtype)
