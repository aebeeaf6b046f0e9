"""QK-Clip (Kimi K2's MuonClip) for the MLA layers (docs/architecture.md#muon): the per-head max pre-softmax logit
of a batch, and the in-place rescaling of a head's query and key weights that brings it down to tau."""

from __future__ import annotations

import torch
from torch import Tensor

from k3.model.mla import MultiheadLatentAttention
from k3.model.rope import rotate_half_rope
from k3.ops.segments import Segments, as_segments


def _q_weight(mla: MultiheadLatentAttention) -> Tensor:
    return mla.q_proj.weight if hasattr(mla, "q_proj") else mla.q_b_proj.weight


@torch.no_grad()
def mla_max_logits(
    mla: MultiheadLatentAttention, x_normed: Tensor, cu_seqlens: Segments | Tensor, query_chunk: int = 1024
) -> Tensor:
    """Per-head max pre-softmax logit (scale included, causal, within each segment) -> [H] fp32.

    x_normed [N, d] is the layer's MLA input (after ``input_layernorm``), packed by cu_seqlens [S+1] (Segments or
    a tensor, k3.ops.segments). Recomputes
    q and k like the naive forward (rope applied when the module has ``rope_theta``); queries in chunks of
    ``query_chunk`` to bound memory.
    """
    n, h, dn, dr = x_normed.shape[0], mla.num_heads, mla.dn, mla.dr
    q = mla.q_proj(x_normed) if hasattr(mla, "q_proj") else mla.q_b_proj(mla.q_a_layernorm(mla.q_a_proj(x_normed)))
    q = q.view(n, h, dn + dr)
    c_kv, k_pe = mla.kv_a_proj_with_mqa(x_normed).split([mla.r, dr], dim=-1)
    k_nope = mla.kv_b_proj(mla.kv_a_layernorm(c_kv)).view(n, h, dn + mla.dv)[..., :dn]
    q_nope, q_pe = q.split([dn, dr], dim=-1)
    bounds = as_segments(cu_seqlens).host
    if mla.rope_theta is not None:
        positions = torch.cat([torch.arange(b - a, device=x_normed.device) for a, b in zip(bounds[:-1], bounds[1:])])
        q_pe = rotate_half_rope(q_pe, positions, mla.rope_theta)
        k_pe = rotate_half_rope(k_pe, positions, mla.rope_theta)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)], dim=-1).float()
    best = torch.full((h,), float("-inf"), device=x_normed.device)
    for a, b in zip(bounds[:-1], bounds[1:]):
        ks = k[a:b].transpose(0, 1)  # [H, L, D]
        for i0 in range(a, b, query_chunk):
            i1 = min(b, i0 + query_chunk)
            scores = torch.matmul(q[i0:i1].transpose(0, 1), ks[:, : i1 - a].transpose(1, 2)) * mla.scale
            pos_q = torch.arange(i0 - a, i1 - a, device=x_normed.device)[:, None]
            pos_k = torch.arange(i1 - a, device=x_normed.device)[None, :]
            scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
            best = torch.maximum(best, scores.amax(dim=(1, 2)))
    return best


@torch.no_grad()
def qk_clip_(mla: MultiheadLatentAttention, max_logits_per_head: Tensor, tau: float = 100.0) -> Tensor:
    """K2 QK-Clip (alpha 0.5) for MLA, in place. Returns gamma [H] (1 for heads left alone).

    For every head with S_max > tau, gamma = tau / S_max: its q_nope rows (q_b_proj or q_proj) and k_nope rows
    (kv_b_proj) are scaled by sqrt(gamma), its q_pe rows by gamma; the shared k_pe (kv_a_proj_with_mqa) and the
    v rows are untouched. Every logit of that head is thereby scaled by gamma, so its max becomes tau. Every head
    is scaled (by exactly 1 when left alone) rather than asking the host whether any needs it (a sync).
    """
    h, dn, dr, dv = mla.num_heads, mla.dn, mla.dr, mla.dv
    s = max_logits_per_head.detach().float().reshape(-1)
    if s.numel() != h:
        raise ValueError(f"max_logits_per_head has {s.numel()} values for {h} heads")
    gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
    wq = _q_weight(mla).view(h, dn + dr, -1)
    wkv = mla.kv_b_proj.weight.view(h, dn + dv, -1)
    g = gamma.to(device=wq.device)
    wq[:, :dn].mul_(g.sqrt().to(wq.dtype)[:, None, None])
    wq[:, dn:].mul_(g.to(wq.dtype)[:, None, None])
    wkv[:, :dn].mul_(g.sqrt().to(wkv.dtype)[:, None, None])
    return gamma
