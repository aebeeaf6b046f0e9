"""The two-phase form of the AttnRes depth mix (the paper's Algorithm 1; docs/architecture.md#attnres).

The pseudo-queries are parameters, not functions of the input, so every mix of a block can be scored against
the sources that stay fixed during the block (the bank of snapshots or block sums, the earlier outputs in
``full`` mode) at once:
- phase 1, once per block: for M queries q_m and S fixed sources v_i [N, d] with inverse RMS r_i,
      s_mi = r_i (v_i . q_m),  lse_m = log sum_i exp(s_mi),  o_m = sum_i exp(s_mi - lse_m) v_i
  (o_m is a convex combination: it is stored in the sources' dtype);
- phase 2, per mix: the live sources u_j (the running residual, a block's partial sum, the block's own outputs)
  are scored against the mix's query and merged with the online-softmax rule, o_m carrying weight exp(lse_m):
      h = (e^{lse_m} o_m + sum_j e^{t_j} u_j) / (e^{lse_m} + sum_j e^{t_j}),   t_j = (u_j . q_m) / rms(u_j).
Each fixed source is read once per block instead of twice per mix. The result equals
:func:`k3.ops.attn_res.reference.depth_mix` over [fixed..., live...] (same temperature, no 1/sqrt(d); logits,
softmax and sums in fp32, or fp64 for fp64 inputs). Both phases are ``@fused``: eager is their reference,
``torch.compile`` their fast path on CUDA (a few Triton kernels per call, forward and backward).
A long live list can be merged in pieces: ``attn_res_fold`` merges some live sources into (o_m, lse_m) and returns
the new pair (the same rule, keeping the log-sum-exp), so a compiled merge sees a bounded number of sources (it is
compiled once per count); a long fixed list is scored in pieces (``attn_res_phase1_pieces``) for the same reason.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops.dtypes import autocast_off, upcast
from k3.ops.fused import fused


ROWWISE_TOKENS = 2048  # compiled phase 1 of up to this many tokens (decode) scores by multiply-and-sum, fused
# into one kernel; above, and always eagerly (an [N, M, d] product is slow uncompiled), by GEMMs


def _logits(q32: Tensor, sources: list[Tensor], eps: float) -> Tensor:
    """fp32 (fp64) queries [M, d], sources S x [N, d] -> s [S, N, M], s_mi = r_i (v_i . q_m)."""
    logits = []
    for v in sources:
        v32 = upcast(v)
        rowwise = torch.compiler.is_compiling() and v.shape[0] <= ROWWISE_TOKENS
        dots = (v32.unsqueeze(1) * q32).sum(-1) if rowwise else v32 @ q32.T  # [N, M]
        logits.append(dots * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps))
    return torch.stack(logits)


def _weighted_sum(a: Tensor, sources: list[Tensor]) -> Tensor:
    """Weights a [S, N, M], sources S x [N, d] -> sum_i a_i v_i as [M, N, d] in a's dtype."""
    o = a[0].T.unsqueeze(-1) * upcast(sources[0])
    for i in range(1, len(sources)):
        o = o + a[i].T.unsqueeze(-1) * upcast(sources[i])
    return o


@fused
@autocast_off  # the logits' GEMM in fp32 also under autocast
def attn_res_phase1(queries: Tensor, sources: list[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """queries [M, d] (key-norm weight * pseudo-query, one per mix), sources S x [N, d] -> (o [M, N, d] in the
    sources' dtype, lse [M, N] in fp32 (fp64 for fp64 inputs)): each query's depth mix of the sources and the
    log-sum-exp of its logits."""
    s = _logits(upcast(queries), sources, eps)  # [S, N, M]
    lse = torch.logsumexp(s, 0)  # [N, M]
    return _weighted_sum(torch.exp(s - lse), sources).to(sources[0].dtype), lse.T.contiguous()


@fused
@autocast_off
def attn_res_logits(queries: Tensor, sources: list[Tensor], eps: float) -> Tensor:
    """Phase 1's logits of S sources [N, d] under M queries [M, d] -> s [S, N, M] in fp32 (fp64 for fp64)."""
    return _logits(upcast(queries), sources, eps)


@fused
def attn_res_weighted_sum(s: Tensor, lse: Tensor, sources: list[Tensor]) -> Tensor:
    """Phase 1's mix of S sources [N, d] under logits s [S, N, M] normalised by the log-sum-exp lse [N, M] of
    every source's logit (these and others) -> sum_i exp(s_i - lse) v_i, [M, N, d] in s's dtype."""
    return _weighted_sum(torch.exp(s - lse), sources)


def attn_res_phase1_pieces(queries: Tensor, sources: list[Tensor], eps: float, piece: int) -> tuple[Tensor, Tensor]:
    """attn_res_phase1 over S sources taken ``piece`` at a time: the logits of every piece, their log-sum-exp, then
    the sum of every piece's weighted sum. A compiled op is traced once per number of sources it takes, so a long
    source list (mode full late in a deep model: 169 at K3's last block) costs a few compiled versions of at most
    ``piece`` sources instead of one large version per block. Autograd keeps only the logits beside the sources.
    Same arguments and result as attn_res_phase1 (which it calls for S <= piece)."""
    if len(sources) <= piece:
        return attn_res_phase1(queries, sources, eps)
    pieces = [sources[i : i + piece] for i in range(0, len(sources), piece)]
    s = [attn_res_logits(queries, p, eps) for p in pieces]
    lse = torch.logsumexp(torch.stack([torch.logsumexp(si, 0) for si in s]), 0)  # [N, M]
    o = attn_res_weighted_sum(s[0], lse, pieces[0])
    for si, p in zip(s[1:], pieces[1:]):
        o = o + attn_res_weighted_sum(si, lse, p)
    return o.to(sources[0].dtype), lse.T.contiguous()


def source_logit(u: Tensor, query: Tensor, eps: float) -> Tensor:
    """A source's depth logit, row by row: u [N, d], query [d] -> (u . q) / rms(u), [N] in fp32 (fp64 for fp64)."""
    u32 = upcast(u)
    return (u32 * upcast(query)).sum(-1) * torch.rsqrt(u32.pow(2).mean(-1) + eps)


def _online_merge(o: Tensor, lse: Tensor, live: list[Tensor], query: Tensor, eps: float) -> tuple[Tensor, ...]:
    """(h [N, d], m [N], z [N]) in fp32 (fp64 for fp64): o (weight e^lse) and the live sources mixed by the softmax
    of their logits, h = o + sum_j a_j (u_j - o); m + log z is the log-sum-exp of all the logits."""
    logits = [upcast(lse)] + [source_logit(u, query, eps) for u in live]
    m = logits[0]
    for t in logits[1:]:
        m = torch.maximum(m, t)
    w = [torch.exp(t - m) for t in logits]
    z = sum(w)
    o32 = upcast(o)
    h = o32
    for wj, u in zip(w[1:], live):
        h = h + (wj / z).unsqueeze(-1) * (upcast(u) - o32)
    return h, m, z


@fused
def attn_res_merge(o: Tensor, lse: Tensor, live: list[Tensor], query: Tensor, eps: float) -> Tensor:
    """One mix's phase-1 result o [N, d], lse [N] merged with L >= 1 live sources [N, d] under its query [d]
    -> h [N, d] in o's dtype, as h = o + sum_j a_j (u_j - o) with a_j the softmax weight of u_j among the 1 + L
    logits: the module docstring's convex combination, exact where a live source repeats o (snapshot's first mix,
    the embedding twice: the query's gradient is then exactly 0, as the reference's). The price: rounding of
    order eps * max(|o|, |u_j|) instead of eps * |h| (they differ when |o| >> |h|; AttnRes's live residual is
    usually the largest source). Written row by row (dot products as multiply-and-sum, the softmax by hand) so
    that, compiled, it is one kernel fused with the residual add before it and the pre-norm after it
    (k3.model.attn_res.attn_res_merge_norm)."""
    return _online_merge(o, lse, live, query, eps)[0].to(o.dtype)


@fused
def attn_res_fold(o: Tensor, lse: Tensor, live: list[Tensor], query: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Merge L >= 1 live sources [N, d] into a phase-1 result o [N, d], lse [N] under ``query`` [d] -> (o' [N, d],
    lse' [N]), both in fp32 (fp64 for fp64 inputs): the depth mix of o's sources and ``live``, and the log-sum-exp
    of all their logits. attn_res_merge(o, lse, a + b) == attn_res_merge(*attn_res_fold(o, lse, a), b)."""
    h, m, z = _online_merge(o, lse, live, query, eps)
    return h, m + torch.log(z)
