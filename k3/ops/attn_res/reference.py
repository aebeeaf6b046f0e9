"""Depth attention of Attention Residuals: a softmax over sources (docs/architecture.md#attnres)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from k3.ops.dtypes import upcast


def depth_weights(sources: Sequence[Tensor], query: Tensor, eps: float) -> Tensor:
    """softmax_i(query . v_i / rms(v_i)) over the S sources: [S, N] in fp32 (or fp64 for fp64 inputs)."""
    v = upcast(torch.stack(list(sources)))
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return (keys * upcast(query)).sum(-1).softmax(0)


def depth_mix(sources: Sequence[Tensor], query: Tensor, eps: float) -> Tensor:
    """h = sum_i softmax_i(query . RMSNorm(v_i)) v_i, per token.

    sources: S tensors [N, d] (raw values v_i); query [d] = key-norm weight * pseudo-query (the checkpoint's
    ``*_res_norm.weight * *_res_proj.weight``). No 1/sqrt(d); logits, softmax and the mix in fp32.
    Returns [N, d] in the sources' dtype. The model uses the equal two-phase form (two_phase.py).
    """
    weights = depth_weights(sources, query, eps)
    return (weights.unsqueeze(-1) * upcast(torch.stack(list(sources)))).sum(0).to(sources[0].dtype)
