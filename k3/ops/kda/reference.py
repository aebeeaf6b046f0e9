"""Pure-PyTorch reference implementation of Kimi Delta Attention (KDA).

Notation (per head, state S is K x V):

    S~  = Diag(exp(g_t)) S_{t-1}                       (channel-wise decay, g_t <= 0)
    S_t = S~ + beta_t k_t (v_t - S~^T k_t)^T           (delta-rule write on the decayed state)
    o_t = scale * S_t^T q_t                             (read-out after the update)

Layout is time-major, as in fla's ``chunk_kda``: q, k [B, T, H, K]; v [B, T, H, V];
g [B, T, H, K] (log-space decay); beta [B, T, H]. With ``cu_seqlens`` (offsets [N+1], 0 = c_0 < ... < c_N = T:
a k3.ops.segments.Segments or an int tensor) the batch must have B == 1 and holds N independent sequences.

Two functions compute the same thing:

* ``recurrent_kda`` - token-by-token loop, the readable ground truth.
* ``chunk_kda``     - exact chunkwise (WY / UT) form: the intra-chunk work is one batched
  triangular solve over every chunk, only the inter-chunk state passing is sequential.

Computation happens in ``promote(input dtype, float32)``, also under autocast; outputs are cast to ``v.dtype`` and
final states are returned in the compute dtype. Everything is differentiable by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.dtypes import autocast_off
from k3.ops.segments import Segments, as_segments, pack_segments, unpack_segments

__all__ = ["kda_gate", "l2norm", "recurrent_kda", "chunk_kda", "chunk_kda_raw", "kda_decode_step"]


# --------------------------------------------------------------------------------------------
# Gate
# --------------------------------------------------------------------------------------------


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> torch.Tensor:
    """Log-space decay g from the raw forget projection.

    Args:
        f: [..., H, K] raw forget projection.
        A_log: [H] per-head log rate.
        dt_bias: [H*K] per-channel bias.
        lower_bound: None for the Kimi-Linear gate ``g = -exp(A_log) * softplus(f + dt_bias)``
            (g in (-inf, 0)); a negative float l for the K3 gate
            ``g = l * sigmoid(exp(A_log) * (f + dt_bias))`` (g in (l, 0)).

    Returns:
        g: [..., H, K] in promote(f.dtype, float32).
    """
    H, K = f.shape[-2], f.shape[-1]
    if A_log.shape != (H,) or dt_bias.shape != (H * K,):
        raise ValueError(
            f"expected A_log [{H}] and dt_bias [{H * K}], got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}"
        )
    dtype = torch.promote_types(f.dtype, torch.float32)
    x = f.to(dtype) + dt_bias.to(dtype).view(H, K)
    rate = A_log.to(dtype).exp().view(H, 1)
    if lower_bound is None:
        return -rate * F.softplus(x)
    if lower_bound >= 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    return lower_bound * torch.sigmoid(rate * x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in promote(x.dtype, float32) (fla's convention)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens: Segments | None):
    """Shared argument checks; returns (compute dtype, scale, N)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != (B, T, H, K) or g.shape != (B, T, H, K) or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
        N = len(cu_seqlens.check(T))
    else:
        N = B
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [{N}, {H}, {K}, {V}], got {tuple(initial_state.shape)}")
    dtype = torch.float32
    for t in (q, k, v, g, beta):
        dtype = torch.promote_types(dtype, t.dtype)
    if initial_state is not None:
        dtype = torch.promote_types(dtype, initial_state.dtype)
    scale = K**-0.5 if scale is None else scale
    return dtype, scale, N


# --------------------------------------------------------------------------------------------
# Recurrent form
# --------------------------------------------------------------------------------------------


@autocast_off  # the state and its products in fp32 also under autocast
def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA.

    Args:
        q, k: [B, T, H, K] (used as given; the caller L2-normalises them).
        v: [B, T, H, V].
        g: [B, T, H, K] log-space decay (<= 0).
        beta: [B, T, H] write strength.
        scale: read-out scale, default K**-0.5.
        initial_state: [N, H, K, V] or None (zeros); N = B, or the number of segments.
        output_final_state: also return the state after the last token of each sequence.
        cu_seqlens: [N+1] segment offsets (B must be 1).

    Returns:
        o: [B, T, H, V] in v.dtype; final_state: [N, H, K, V] in the compute dtype, or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    cu_seqlens = as_segments(cu_seqlens, q.device)
    dtype, scale, N = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    out_dtype = v.dtype
    q, k, v, g, beta = (pack_segments(t.to(dtype), cu_seqlens) for t in (q, k, v, g, beta))

    S = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(q.shape[1]):
        S = g[:, t].exp().unsqueeze(-1) * S  # S~ = Diag(exp(g_t)) S_{t-1}
        prediction = torch.einsum("nhk,nhkv->nhv", k[:, t], S)  # S~^T k_t
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - prediction)
        S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)  # + beta_t k_t (v_t - S~^T k_t)^T
        outputs.append(scale * torch.einsum("nhk,nhkv->nhv", q[:, t], S))
    o = torch.stack(outputs, dim=1)  # [N, Tmax, H, V]
    o = unpack_segments(o, cu_seqlens, T).to(out_dtype)
    return o, (S if output_final_state else None)


def _from_raw(q, k, f, b, A_log, dt_bias, lower_bound, l2norm_eps):
    """The raw projections -> the recurrence's inputs: q, k L2-normed, the gate g (log space), beta = sigmoid(b) in
    promote(b.dtype, fp32)."""
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.to(torch.promote_types(b.dtype, torch.float32)))
    return l2norm(q, l2norm_eps), l2norm(k, l2norm_eps), g, beta


def kda_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    state: torch.Tensor,
    slots: torch.Tensor,
    l2norm_eps: float = 1e-6,
    scale: float | None = None,
) -> torch.Tensor:
    """One new token for each of N cached sequences, from the raw projections; states updated in place.

    Args:
        q, k: [N, H, K] before L2 normalisation; v: [N, H, V].
        f: [N, H, K] raw forget projection (see :func:`kda_gate`); b: [N, H] raw beta logits.
        state: [S, H, K, V] the cache's state pool; slots: [N] distinct int indices into it.
        The rest as in :func:`kda_gate` / :func:`l2norm`.

    Returns:
        o: [N, H, V] in v.dtype; ``state[slots]`` holds the new states (in state.dtype). Reads nothing back to
        the host, so it can be captured in a CUDA graph.
    """
    q, k, g, beta = _from_raw(q, k, f, b, A_log, dt_bias, lower_bound, l2norm_eps)
    o, final = recurrent_kda(
        q[:, None],
        k[:, None],
        v[:, None],
        g[:, None],
        beta[:, None],
        scale=scale,
        initial_state=state[slots],
        output_final_state=True,
    )
    state.index_copy_(0, slots, final.to(state.dtype))
    return o[:, 0]


def chunk_kda_raw(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    l2norm_eps: float = 1e-6,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_kda` from the raw projections, as a KDA layer has them (training / prefill): the L2 norms,
    the gate and beta's sigmoid are part of the op, so a fast path can fuse them into its kernels.

    Args:
        q, k: [B, T, H, K] before L2 normalisation; v: [B, T, H, V].
        f: [B, T, H, K] raw forget projection (see :func:`kda_gate`); b: [B, T, H] raw beta logits.
        The rest as in :func:`kda_gate`, :func:`l2norm` and :func:`chunk_kda`.

    Returns:
        As :func:`chunk_kda`; differentiable in every tensor argument, A_log and dt_bias included.
    """
    q, k, g, beta = _from_raw(q, k, f, b, A_log, dt_bias, lower_bound, l2norm_eps)
    return chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


# --------------------------------------------------------------------------------------------
# Chunked form
# --------------------------------------------------------------------------------------------


def _intra_chunk_scores(q, k, G, sub):
    """Intra-chunk decayed scores, computed without ever forming exp(-G).

    Args:
        q, k: [..., C, K]; G: [..., C, K] inclusive cumulative log-decay within the chunk.
        sub: sub-chunk size (divides C).

    Returns:
        A:   [..., C, C], A_ij = sum_c k_ic k_jc exp(G_ic - G_jc) for j < i, else 0.
        Bqk: [..., C, C], Bqk_ij = sum_c q_ic k_jc exp(G_ic - G_jc) for j <= i, else 0.
    """
    *lead, C, K = q.shape
    n = C // sub
    qs, ks, Gs = (t.reshape(*lead, n, sub, K) for t in (q, k, G))
    eye_n = torch.eye(n, dtype=torch.bool, device=q.device)
    neg_inf = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)

    # Diagonal sub-blocks: exact pairwise decay exp(G_i - G_j), j <= i, [..., n, sub, sub, K].
    incl = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()
    diff = Gs.unsqueeze(-2) - Gs.unsqueeze(-3)
    decay = torch.where(incl[:, :, None], diff, neg_inf).exp()  # masked before exp: no overflow
    kk = torch.einsum("...ic,...jc,...ijc->...ij", ks, ks, decay) * incl.tril(-1)
    qk = torch.einsum("...ic,...jc,...ijc->...ij", qs, ks, decay)

    # Off-diagonal sub-blocks (row block a > column block b), pivoting on m = last position of b:
    # (x_i exp(G_i - G_m)) @ (k_j exp(G_m - G_j))^T, both factors have exponents <= 0.
    Gm = Gs[..., -1, :]  # [..., n, K]
    below = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)  # a > b
    row_exp = Gs.unsqueeze(-3) - Gm.unsqueeze(-3).unsqueeze(-2)  # [..., a, b, sub, K]
    row_decay = torch.where(below[:, :, None, None], row_exp, neg_inf).exp()
    col = (ks * (Gm.unsqueeze(-2) - Gs).exp()).transpose(-1, -2).unsqueeze(-4)  # [..., 1, b, K, sub]
    kk_off = (ks.unsqueeze(-3) * row_decay) @ col  # [..., a, b, sub, sub]
    qk_off = (qs.unsqueeze(-3) * row_decay) @ col

    def assemble(diag, off):  # [..., n, sub, sub] + [..., n, n, sub, sub] -> [..., C, C]
        blocks = off + eye_n[:, :, None, None] * diag.unsqueeze(-3)
        return blocks.transpose(-3, -2).reshape(*lead, C, C)

    return assemble(kk, kk_off), assemble(qk, qk_off)


# Largest log-decay spread within a chunk (G_first - G_last, per channel) for which the factored form below
# stays inside fp32 range: every factor and every product (masked entries included) is <= e^80 ~ 5.5e34.
FACTORED_MAX_SPREAD = 80.0


def _factored_scores(q, k, G):
    """A and Bqk of :func:`_intra_chunk_scores` as two plain matmuls, exact when exp(+-G) cannot overflow.

    exp(G_i - G_j) = exp(G_i - G_m) exp(G_m - G_j) with m the chunk's middle position, so
    Bqk = (q exp(G - G_m)) (k exp(G_m - G))^T masked to j <= i, and A likewise with k for q and j < i. Valid
    when the chunk's spread G_first - G_last <= FACTORED_MAX_SPREAD in every channel, the usual case (gates of
    a trained model decay far less than -80 per 64 tokens); :func:`chunk_kda` checks this and otherwise uses
    the sub-chunked form, which is safe for any g <= 0.
    """
    C = q.shape[-2]
    Gm = G[..., C // 2 : C // 2 + 1, :]
    right = (k * (Gm - G).exp()).transpose(-1, -2)  # [..., K, C]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = ((k * (G - Gm).exp()) @ right) * incl.tril(-1)
    Bqk = ((q * (G - Gm).exp()) @ right) * incl
    return A, Bqk


@autocast_off  # the state and its products in fp32 also under autocast
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA; same arguments and results as :func:`recurrent_kda` (plus ``chunk_size``).

    Per head, chunk of C positions with incoming state S_0 and G = inclusive cumsum of g ([C, K]):

        T    = (I + Diag(beta) A)^{-1} Diag(beta)          (unit lower-triangular solve)
        U    = T V,   Wk = T (exp(G) * K)
        W    = U - Wk S_0                                   (pseudo-values, [C, V])
        O    = scale * [(exp(G) * Q) S_0 + Bqk W]
        S_C  = exp(G_C) * S_0 + (exp(G_C - G) * K)^T W

    with A, Bqk from :func:`_factored_scores` when every chunk's decay spread fits fp32, else from
    :func:`_intra_chunk_scores`, whose sub-chunks of min(16, chunk_size) keep every exponent <= 0, so that
    form is safe for any g <= 0. Sequences are right-padded to a multiple
    of C with identity steps.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    sub = min(16, C)
    if C % sub != 0:
        raise ValueError(f"chunk_size must be a multiple of {sub}, got {C}")
    cu_seqlens = as_segments(cu_seqlens, q.device)
    dtype, scale, N = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    out_dtype = v.dtype

    def to_chunks(t):  # [B, T, H, ...] -> [N, H, n_chunks, C, ...]
        t = pack_segments(t.to(dtype), cu_seqlens, multiple=C)
        t = t.reshape(N, -1, C, *t.shape[2:])  # [N, n_chunks, C, H, ...]
        return t.movedim(3, 1)

    q, k, v, g = (to_chunks(t) for t in (q, k, v, g))
    beta = to_chunks(beta).unsqueeze(-1)  # [N, H, n, C, 1]
    n_chunks = q.shape[2]

    # Intra-chunk part, vectorised over (segments, heads, chunks).
    G = g.cumsum(dim=-2)  # [N, H, n, C, K]
    if bool(((G[..., 0, :] - G[..., -1, :]) <= FACTORED_MAX_SPREAD).all()):
        A, Bqk = _factored_scores(q, k, G)
    else:
        A, Bqk = _intra_chunk_scores(q, k, G, sub)
    eye = torch.eye(C, dtype=dtype, device=q.device)
    L = eye + beta * A  # unit lower triangular
    rhs = beta * torch.cat([v, G.exp() * k], dim=-1)
    UW = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    U, Wk = UW[..., :V], UW[..., V:]  # T V, T (exp(G) K)
    G_last = G[..., -1:, :]  # [N, H, n, 1, K]
    k_to_end = (G_last - G).exp() * k  # exp(G_C - G) * K
    decay_chunk = G_last.exp().transpose(-1, -2)  # [N, H, n, K, 1]

    # Inter-chunk state passing: the only sequential loop.
    S = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dtype)
    states, pseudo_values = [], []
    for c in range(n_chunks):
        states.append(S)
        W = U[:, :, c] - Wk[:, :, c] @ S
        pseudo_values.append(W)
        S = decay_chunk[:, :, c] * S + k_to_end[:, :, c].transpose(-1, -2) @ W
    S0 = torch.stack(states, dim=2)  # [N, H, n, K, V]
    W = torch.stack(pseudo_values, dim=2)  # [N, H, n, C, V]

    o = scale * ((G.exp() * q) @ S0 + Bqk @ W)  # [N, H, n, C, V]
    o = o.movedim(1, 3).reshape(N, n_chunks * C, H, V)
    o = unpack_segments(o, cu_seqlens, T).to(out_dtype)
    return o, (S if output_final_state else None)
