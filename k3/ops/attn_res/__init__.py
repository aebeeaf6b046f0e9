"""Attention Residuals depth mix (docs/architecture.md#attnres).

``reference.depth_mix(sources: S x [N, d], query [d], eps) -> [N, d]``: the mix as written (stack, RMSNorm
keys, softmax over depth, weighted sum). The model computes it in the two-phase form (two_phase.py): phase 1
scores all of a block's queries against the block's fixed sources once, phase 2 merges each mix's live sources
by online softmax (a long live list in pieces, ``attn_res_fold``). Both phases are ops with an eager
``reference`` and a ``torch.compile`` ``fast`` path (CUDA).
"""

from k3.ops.attn_res.reference import depth_mix, depth_weights
from k3.ops.attn_res.two_phase import attn_res_fold, attn_res_merge, attn_res_phase1, attn_res_phase1_pieces

__all__ = [
    "attn_res_fold",
    "attn_res_merge",
    "attn_res_phase1",
    "attn_res_phase1_pieces",
    "depth_mix",
    "depth_weights",
]
