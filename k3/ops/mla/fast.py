"""GPU paths for MLA attention: SDPA per segment for prefill, Triton split-K decode over the latent cache."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from k3.ops.segments import host_list

log = logging.getLogger("k3.ops")
_warned: list = []


def masked_decode(q: Tensor, kv: Tensor, seq_ids: Tensor, lengths: Tensor, scale: float, v_dim: int) -> Tensor:
    """One query token per sequence over its first lengths[b] cache rows, as dense masked attention over the
    capacity (no host reads: CUDA-graph safe; for shapes the Triton kernel does not take). q [B, H, D] ->
    [B, H, v_dim]."""
    rows = kv[seq_ids].to(q.dtype)  # [B, C, D]
    scores = torch.einsum("bhd,bcd->bhc", q.float(), rows.float()) * scale
    valid = torch.arange(kv.shape[1], device=q.device)[None, :] < lengths[:, None]  # [B, C]
    p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhc,bcv->bhv", p, rows[..., :v_dim].float()).to(q.dtype)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One segment with SDPA: q [Lq, H, D], k [Lk, Hk, D], v [Lk, Hk, Dv], queries are the last Lq positions."""
    lq, lk = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
    mask = None if lq == lk else causal_lower_right(lq, lk)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=lq == lk, scale=scale,
                                       enable_gqa=kh.shape[1] != qh.shape[1])
    return o[0].transpose(0, 1)


def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> Tensor:
    """Same contract as :func:`k3.ops.mla.reference.attention` (one SDPA call per segment)."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    bq, bk = host_list(cu_seqlens_q), host_list(cu_seqlens_k)
    for s in range(len(bq) - 1):
        out[bq[s]:bq[s + 1]] = _sdpa(q[bq[s]:bq[s + 1]], k[bk[s]:bk[s + 1]], v[bk[s]:bk[s + 1]], scale)
    return out


def latent_attention(q: Tensor, kv: Tensor, *, seq_ids: Tensor, lengths: Tensor, cu_seqlens_q: Tensor, scale: float,
                     v_dim: int, max_length: int | None = None) -> Tensor:
    """Same contract as :func:`k3.ops.mla.reference.latent_attention`; one-token segments (decode) run the
    Triton split-K kernel, longer ones (chunked prefill on a cache) one SDPA call each."""
    if q.shape[0] == seq_ids.numel():
        from k3.ops.mla.triton_decode import mla_decode, supported

        if supported(v_dim, q.shape[-1] - v_dim):
            return mla_decode(q, kv, seq_ids, lengths, scale, v_dim, max_length)
        if not _warned:
            _warned.append(True)
            log.warning("MLA decode: r=%d, dr=%d do not fit the Triton kernel (powers of two, dr >= 16); running "
                        "masked dense attention over the whole cache capacity instead", v_dim, q.shape[-1] - v_dim)
        return masked_decode(q, kv, seq_ids, lengths, scale, v_dim)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    bq = host_list(cu_seqlens_q)
    for s, (slot, length) in enumerate(zip(host_list(seq_ids), host_list(lengths))):
        rows = kv[slot, :length].unsqueeze(1)
        out[bq[s]:bq[s + 1]] = _sdpa(q[bq[s]:bq[s + 1]], rows, rows[..., :v_dim], scale)
    return out
