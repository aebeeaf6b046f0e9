"""Depth attention of Attention Residuals: a softmax over sources (spec §5)."""

from __future__ import annotations

import torch
from torch import Tensor
from k3.ops.dtypes import upcast


def depth_mix(sources: Tensor, query: Tensor, eps: float) -> Tensor:
    """h = sum_i softmax_i(query . RMSNorm(v_i)) v_i, per token.

    sources [S, N, d] (raw values v_i); query [d] = key-norm weight * pseudo-query (the checkpoint's
    ``*_res_norm.weight * *_res_proj.weight``). No 1/sqrt(d); logits, softmax and the mix in fp32.
    Returns [N, d] in sources.dtype.
    """
    v = upcast(sources)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    logits = (keys * upcast(query)).sum(-1)  # [S, N]
    weights = logits.softmax(0)
    return (weights.unsqueeze(-1) * v).sum(0).to(sources.dtype)
