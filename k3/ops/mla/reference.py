"""Naive causal attention: the reference for MLA prefill (packed segments) and absorbed decode (latent cache)."""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops.dtypes import autocast_off, upcast
from k3.ops.segments import HostInts, Segments, as_segments, host_values


@autocast_off
def segment_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One segment: q [Lq, H, D], k [Lk, Hk, D], v [Lk, Hk, Dv] with Hk in {1, H}; queries are the last Lq
    of the Lk positions (query i sees keys j <= Lk - Lq + i). Scores and softmax in fp32 (also under autocast).
    -> [Lq, H, Dv]."""
    lq, lk = q.shape[0], k.shape[0]
    if lq > lk:
        raise ValueError(f"a segment has {lq} queries but only {lk} keys")
    scores = torch.matmul(upcast(q).transpose(0, 1), upcast(k).permute(1, 2, 0)) * scale  # [H, Lq, Lk]
    pos_q = torch.arange(lk - lq, lk, device=q.device)[:, None]
    pos_k = torch.arange(lk, device=q.device)[None, :]
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    return torch.matmul(scores.softmax(-1), upcast(v).transpose(0, 1)).transpose(0, 1).to(q.dtype)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    cu_seqlens_q: Segments | Tensor,
    cu_seqlens_k: Segments | Tensor,
) -> Tensor:
    """Softmax attention where each query segment attends causally to its own key segment.

    q [N, H, D]; k [M, Hk, D]; v [M, Hk, Dv] with Hk == H or 1; cu_seqlens_q / cu_seqlens_k [S+1] (Segments or
    tensors, k3.ops.segments): segment s has Lq queries and Lk >= Lq keys (see :func:`segment_attention`).
    Returns o [N, H, Dv] in q.dtype.
    """
    bq, bk = as_segments(cu_seqlens_q).host, as_segments(cu_seqlens_k).host
    if len(bq) != len(bk):
        raise ValueError(f"cu_seqlens_q ({len(bq)},) and cu_seqlens_k ({len(bk)},) differ")
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for s in range(len(bq) - 1):
        out[bq[s] : bq[s + 1]] = segment_attention(
            q[bq[s] : bq[s + 1]], k[bk[s] : bk[s + 1]], v[bk[s] : bk[s + 1]], scale
        )
    return out


def latent_attention(
    q: Tensor,
    kv: Tensor,
    *,
    seq_ids: HostInts | Tensor,
    lengths: HostInts | Tensor,
    cu_seqlens_q: Segments | Tensor,
    scale: float,
    v_dim: int,
    max_length: int | None = None,
) -> Tensor:
    """Absorbed-MLA attention straight over a latent cache (one shared key/value head).

    q [N, H, D] (D = r + dr: the absorbed q_nope and q_pe); kv [slots, capacity, D] cache rows; segment s of the
    packed queries (cu_seqlens_q [S+1]) belongs to slot seq_ids[s], whose first lengths[s] rows are its keys
    (its new tokens included, last); values are each row's first ``v_dim`` entries; ``max_length`` (host int,
    optional) is max(lengths), which fast paths use to plan without reading ``lengths``. ``seq_ids`` and
    ``lengths`` are int tensors or HostInts (k3.ops.segments: read on the host from their own copy). Returns
    [N, H, v_dim].
    """
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    bq = as_segments(cu_seqlens_q).host
    for s, (slot, length) in enumerate(zip(host_values(seq_ids), host_values(lengths))):
        rows = kv[slot, :length].unsqueeze(1)  # [L, 1, D]
        out[bq[s] : bq[s + 1]] = segment_attention(q[bq[s] : bq[s + 1]], rows, rows[..., :v_dim], scale)
    return out
