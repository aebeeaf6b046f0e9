"""Naive causal attention over packed segments: the reference for MLA prefill and (absorbed) decode."""

from __future__ import annotations

import torch
from torch import Tensor


def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> Tensor:
    """Softmax attention where each query segment attends causally to its own key segment.

    q [N, H, D]; k [M, Hk, D]; v [M, Hk, Dv] with Hk == H or Hk == 1 (one shared key/value head, the
    absorbed-MLA case). cu_seqlens_q / cu_seqlens_k [S+1]: segment s has Lq queries and Lk >= Lq keys; its
    queries are the last Lq positions of the segment, so query i sits at position Lk - Lq + i and sees keys
    j <= Lk - Lq + i. Scores and softmax in fp32. Returns o [N, H, Dv] in q.dtype.
    """
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} differ")
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bq) - 1):
        qs = q[bq[s]:bq[s + 1]].float().transpose(0, 1)  # [H, Lq, D]
        ks = k[bk[s]:bk[s + 1]].float().transpose(0, 1)  # [Hk, Lk, D]
        vs = v[bk[s]:bk[s + 1]].float().transpose(0, 1)  # [Hk, Lk, Dv]
        lq, lk = qs.shape[1], ks.shape[1]
        if lq > lk:
            raise ValueError(f"segment {s} has {lq} queries but only {lk} keys")
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale  # [H, Lq, Lk]
        pos_q = torch.arange(lk - lq, lk, device=q.device)[:, None]
        pos_k = torch.arange(lk, device=q.device)[None, :]
        scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
        out[bq[s]:bq[s + 1]] = torch.matmul(scores.softmax(-1), vs).transpose(0, 1).to(q.dtype)
    return out
