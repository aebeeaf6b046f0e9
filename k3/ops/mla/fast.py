"""GPU paths for MLA attention: SDPA per segment for prefill, Triton split-K decode over the latent cache."""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from k3.ops import backend
from k3.ops.segments import HostInts, Segments, as_segments, device_values, host_values

log = logging.getLogger("k3.ops")
_logged: set = set()


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
    o = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=lq == lk, scale=scale, enable_gqa=kh.shape[1] != qh.shape[1]
    )
    return o[0].transpose(0, 1)


@functools.cache
def _varlen_flash():
    """(varlen_attn, its causal keyword) from torch.nn.attention.varlen (FlashAttention-2 over cu_seqlens), or
    None where this torch lacks it. torch 2.9 takes ``is_causal``; later versions a ``window_size`` (-1, 0)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params:
        return None
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal


def _flash_dtype(q: Tensor) -> torch.dtype | None:
    """The half dtype flash would run in: q's own, or autocast's (a custom op is not autocast for us)."""
    if q.dtype in (torch.bfloat16, torch.float16):
        return q.dtype
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


def _not_flash(q: Tensor, k: Tensor, v: Tensor, prefixed: bool, no_varlen: bool, no_half: bool) -> str:
    """Why the varlen flash call cannot take these inputs ('' when it can)."""
    d, dv = q.shape[-1], v.shape[-1]
    if not q.is_cuda:
        return "not on a CUDA device"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "FlashAttention-2 needs compute capability 8.0 or newer"
    if no_varlen:
        return "this torch has no torch.nn.attention.varlen.varlen_attn with a scale"
    if prefixed:
        return "queries after a cached prefix"
    if no_half:
        return "fp32 without autocast"
    if d > 256 or d % 8 or dv > d:
        return f"head widths {d} / {dv} (flash takes <= 256, multiples of 8)"
    if k.shape[1] != q.shape[1]:
        return f"{k.shape[1]} key heads for {q.shape[1]} query heads"
    return ""


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    cu_seqlens_q: Segments | Tensor,
    cu_seqlens_k: Segments | Tensor,
) -> Tensor:
    """Same contract as :func:`k3.ops.mla.reference.attention`. Segments with as many queries as keys (training,
    prefill without a cache) run as one FlashAttention-2 varlen call (values zero-padded to the q/k head width,
    which flash needs); otherwise (queries after a cached prefix, head widths over 256, fp32 without autocast,
    a torch without varlen_attn) one SDPA call per segment. Which one runs is logged once."""
    cu_seqlens_q, cu_seqlens_k = as_segments(cu_seqlens_q, q.device), as_segments(cu_seqlens_k, q.device)
    bq, bk = cu_seqlens_q.host, cu_seqlens_k.host
    varlen, half, d, dv = _varlen_flash(), _flash_dtype(q), q.shape[-1], v.shape[-1]
    why = _not_flash(q, k, v, bq != bk, varlen is None, half is None)
    if not why:
        _log_once(logging.INFO, "MLA prefill attention: flash varlen (torch.nn.attention.varlen)")
        cu, longest = cu_seqlens_q.int32, cu_seqlens_q.max_length
        vp = F.pad(v.to(half), (0, d - dv))
        fn, causal = varlen
        o = fn(q.to(half), k.to(half), vp, cu, cu, longest, longest, scale=scale, **causal)
        return o[..., :dv].to(q.dtype)
    _log_once(logging.INFO, f"MLA prefill attention: SDPA per segment ({why})")
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for s in range(len(bq) - 1):
        out[bq[s] : bq[s + 1]] = _sdpa(q[bq[s] : bq[s + 1]], k[bk[s] : bk[s + 1]], v[bk[s] : bk[s + 1]], scale)
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
    """Same contract as :func:`k3.ops.mla.reference.latent_attention`; one-token segments (decode) run the
    Triton split-K kernel (kernel ``mla_decode``; reading nothing on the host), or with that kernel off masked
    dense attention over the cache capacity (also graph-safe); longer ones (chunked prefill on a cache) one SDPA
    call each."""
    if q.shape[0] == device_values(seq_ids).numel():
        seq_ids, lengths = device_values(seq_ids), device_values(lengths)
        if backend.kernel_choice("mla_decode") != "triton":
            return masked_decode(q, kv, seq_ids, lengths, scale, v_dim)
        from k3.ops.mla.triton_decode import mla_decode, supported

        if supported(v_dim, q.shape[-1] - v_dim):
            return mla_decode(q, kv, seq_ids, lengths, scale, v_dim, max_length)
        _log_once(
            logging.WARNING,
            f"MLA decode: r={v_dim}, dr={q.shape[-1] - v_dim} do not fit the Triton kernel "
            "(powers of two, dr >= 16); running masked dense attention over the whole cache capacity instead",
        )
        return masked_decode(q, kv, seq_ids, lengths, scale, v_dim)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    bq = as_segments(cu_seqlens_q).host
    for s, (slot, length) in enumerate(zip(host_values(seq_ids), host_values(lengths))):
        rows = kv[slot, :length].unsqueeze(1)
        out[bq[s] : bq[s + 1]] = _sdpa(q[bq[s] : bq[s + 1]], rows, rows[..., :v_dim], scale)
    return out
