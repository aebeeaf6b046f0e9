"""Chunked KDA forward in Triton (docs/architecture.md#kda): the chunkwise form of
:func:`k3.ops.kda.reference.chunk_kda` (:mod:`k3.ops.kda.triton_chunk_bwd` adds its gradient).

Per head, a chunk of C = 64 positions with incoming state S_0 and G = inclusive cumsum of g ([C, K]):

    A_ij   = sum_c k_ic k_jc exp(G_ic - G_jc)  (j < i),     Bqk_ij = sum_c q_ic k_jc exp(G_ic - G_jc)  (j <= i)
    U      = L^-1 (beta * V),  Wk = L^-1 (beta * exp(G) * K),   L = I + Diag(beta) A   (unit lower triangular)
    W      = U - Wk S_0,   O = scale [(exp(G) * Q) S_0 + Bqk W],   S_C = exp(G_C) * S_0 + (exp(G_C - G) * K)^T W

Two launches:

* ``_intra_kernel``, one program per (chunk, head), everything but S: A and Bqk by one matmul per column block of
  16 positions, pivoted at the block's first position f: (x_i exp(G_i - G_f)) (k_j exp(G_f - G_j)) for rows i >= f
  and columns j in the block, so every row factor is <= 1 and every column factor is at most exp(spread of 16
  positions); L^-1 blockwise: the inverse of its 16 x 16 diagonal blocks as (I - N)(I + N^2)(I + N^4)(I + N^8)
  (N, the blocks' strictly lower part, has N^16 = 0), then four block rows of forward substitution. The key and
  value dims go in slices of up to 64 columns, so few [C, 64] tiles are live at once. Writes U, Wk and Bqk in fp32.
* ``_inter_kernel``, one program per (sequence, head, block of BV value columns): the state [K, BV] in fp32
  through the sequence's chunks, reading q, k, g (G recomputed) and U, Wk, Bqk; writes O and the final state.

Sequences are laid out one after another, each right-padded to a multiple of C with identity steps (zeros: no
decay, no write), so no chunk spans two sequences and no sequence is padded to the longest one. Valid when no
channel decays by more than MAX_BLOCK_SPREAD over 16 positions (the column factors stay in fp32 range): always
for K3's gate (g > -5 a position, at most 75 over a block); :func:`block_spread_ok` checks it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.kda.reference import _prepare
from k3.ops.segments import Segments, as_segments

CHUNK = 64
BLOCK = 16  # positions per column block of A and Bqk, and per diagonal block of L
MAX_BLOCK_SPREAD = 80.0  # largest G_f - G_j within a block: exp(80) ~ 5.5e34 and its products stay in fp32


@triton.jit
def _forward_substitution(Dinv, No, R, BLK: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr):
    """X with L X = R by block rows, L = I + Nd + No: X_a = Dinv_a (R_a - sum_{b<a} No_ab X_b)."""
    i = tl.arange(0, C)
    X = tl.zeros(R.shape, dtype=tl.float32)
    for a in tl.static_range(C // BLK):
        rhs = tl.where(((i // BLK) == a)[:, None], R - tl.dot(No, X, input_precision=PRECISION), 0.0)
        X += tl.dot(Dinv, rhs, input_precision=PRECISION)
    return X


@triton.jit
def _intra_kernel(
    Q,
    K_,
    V_,
    G_,
    BETA,
    U,
    WK,
    BQK,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    C: tl.constexpr,
    BLK: tl.constexpr,
    KB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One chunk of one head; the key and value dims in slices of KB columns, so that at most a few [C, KB]
    tiles are live at once."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, C)
    kb = tl.arange(0, KB)
    row = (c * C + i).to(tl.int64) * H + h  # [C]: the (position, head) rows of the chunk
    rows = i[:, None]
    cols = i[None, :]
    beta = tl.load(BETA + row).to(tl.float32)  # [C]

    A = tl.zeros([C, C], dtype=tl.float32)
    Bqk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in tl.static_range(0, DK, KB):
        at = row[:, None] * DK + k0 + kb[None, :]  # [C, KB]
        q = tl.load(Q + at).to(tl.float32)
        k = tl.load(K_ + at).to(tl.float32)
        G = tl.cumsum(tl.load(G_ + at).to(tl.float32), axis=0)
        for b in tl.static_range(C // BLK):
            f = b * BLK
            G_f = tl.sum(tl.where(rows == f, G, 0.0), axis=0)  # [KB]: G at the block's first position
            in_block = ((i >= f) & (i < f + BLK))[:, None]
            col_factor = tl.where(in_block, k * tl.exp(tl.where(in_block, G_f[None, :] - G, 0.0)), 0.0)
            row_decay = tl.exp(tl.where(rows >= f, G - G_f[None, :], float("-inf")))  # <= 1; 0 above f
            A += tl.dot(k * row_decay, tl.trans(col_factor), input_precision=PRECISION)
            Bqk += tl.dot(q * row_decay, tl.trans(col_factor), input_precision=PRECISION)
    tl.store(BQK + row[:, None] * C + cols, tl.where(rows >= cols, Bqk, 0.0))

    # L = I + N, N = Diag(beta) A strictly lower; its 16 x 16 diagonal blocks inverted by the product form
    N = tl.where(rows > cols, beta[:, None] * A, 0.0)
    Nd = tl.where((rows // BLK) == (cols // BLK), N, 0.0)
    power = Nd
    Dinv = tl.where(rows == cols, 1.0, 0.0) - Nd
    for _ in tl.static_range(3):  # Dinv = (I - Nd)(I + Nd^2)(I + Nd^4)(I + Nd^8)
        power = tl.dot(power, power, input_precision=PRECISION)
        Dinv += tl.dot(Dinv, power, input_precision=PRECISION)
    No = N - Nd  # the blocks below the diagonal

    for v0 in tl.static_range(0, DV, KB):  # U = L^-1 (beta V)
        at = row[:, None] * DV + v0 + kb[None, :]
        Rv = beta[:, None] * tl.load(V_ + at).to(tl.float32)
        tl.store(U + at, _forward_substitution(Dinv, No, Rv, BLK, C, PRECISION))
    for k0 in tl.static_range(0, DK, KB):  # Wk = L^-1 (beta exp(G) K)
        at = row[:, None] * DK + k0 + kb[None, :]
        G = tl.cumsum(tl.load(G_ + at).to(tl.float32), axis=0)
        Rk = beta[:, None] * tl.exp(G) * tl.load(K_ + at).to(tl.float32)
        tl.store(WK + at, _forward_substitution(Dinv, No, Rk, BLK, C, PRECISION))


@triton.jit
def _inter_kernel(
    Q,
    K_,
    G_,
    U,
    WK,
    BQK,
    CU_CHUNKS,
    S0,
    O,
    SN,
    HS,
    scale,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    HAS_S0: tl.constexpr,
    STORE_STATES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One sequence, head and block of BV value columns: the state through the sequence's chunks; with
    STORE_STATES the state entering each chunk goes to HS [chunks, H, DK, DV] (the backward pass reads it)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    i = tl.arange(0, C)
    kk = tl.arange(0, DK)
    state = (n * H + h).to(tl.int64) * DK * DV + kk[:, None] * DV + vv[None, :]  # [DK, BV] of S[n, h]
    if HAS_S0:
        S = tl.load(S0 + state).to(tl.float32)
    else:
        S = tl.zeros([DK, BV], dtype=tl.float32)
    c = tl.load(CU_CHUNKS + n)
    end = tl.load(CU_CHUNKS + n + 1)
    while c < end:  # (a while loop: Triton's interpreter cannot range over loaded bounds)
        if STORE_STATES:
            tl.store(HS + (c * H + h).to(tl.int64) * DK * DV + kk[:, None] * DV + vv[None, :], S)
        row = (c * C + i).to(tl.int64) * H + h
        q = tl.load(Q + row[:, None] * DK + kk[None, :]).to(tl.float32)
        k = tl.load(K_ + row[:, None] * DK + kk[None, :]).to(tl.float32)
        g = tl.load(G_ + row[:, None] * DK + kk[None, :]).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        G_last = tl.sum(g, axis=0)  # [DK]: G at the chunk's last position
        u = tl.load(U + row[:, None] * DV + vv[None, :])  # [C, BV]
        wk = tl.load(WK + row[:, None] * DK + kk[None, :])  # [C, DK]
        bqk = tl.load(BQK + row[:, None] * C + i[None, :])  # [C, C]
        w = u - tl.dot(wk, S, input_precision=PRECISION)
        o = tl.dot(q * tl.exp(G), S, input_precision=PRECISION)
        o = scale * tl.dot(bqk, w, o, input_precision=PRECISION)
        tl.store(O + row[:, None] * DV + vv[None, :], o.to(O.dtype.element_ty))
        k_to_end = k * tl.exp(G_last[None, :] - G)
        S = tl.exp(G_last)[:, None] * S + tl.dot(tl.trans(k_to_end), w, input_precision=PRECISION)
        c += 1
    tl.store(SN + state, S)


def block_spread_ok(g: Tensor) -> bool:
    """Whether no channel's g sums below -MAX_BLOCK_SPREAD over BLOCK - 1 consecutive positions (the most a
    column factor exp(G_f - G_j) spans), counting windows across sequence ends too (a bound); one host sync.
    True for K3's gate, g > -5: at most 75."""
    flat = g.detach().float().reshape(-1, *g.shape[2:])  # [B*T, H, K]
    if flat.shape[0] == 0 or float(flat.amin()) * (BLOCK - 1) >= -MAX_BLOCK_SPREAD:
        return True
    csum = torch.cat([flat.new_zeros(1, *flat.shape[1:]), flat.cumsum(0)])
    w = min(BLOCK - 1, flat.shape[0])
    return float((csum[:-w] - csum[w:]).amax()) <= MAX_BLOCK_SPREAD


def _layout(B: int, T: int, cu_seqlens: Segments | None, device) -> tuple[Tensor, Tensor]:
    """Where each padded position reads from: index [Tp] into the flat [B*T] positions (-1 for padding), and each
    sequence's chunks, cu_chunks [N+1] int32."""
    if cu_seqlens is None:
        starts, lengths = [b * T for b in range(B)], [T] * B
    else:
        lengths = cu_seqlens.check(T)
        starts = cu_seqlens.host[:-1]
    chunks = [-(-n // CHUNK) for n in lengths]
    pieces = []
    for s, n, m in zip(starts, lengths, chunks):
        idx = torch.full((m * CHUNK,), -1, dtype=torch.long)
        idx[:n] = torch.arange(s, s + n)
        pieces.append(idx)
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    cu = torch.tensor([0] + chunks, dtype=torch.int32).cumsum(0).to(torch.int32)
    return index.to(device), cu.to(device)


@torch.no_grad()
def chunk_kda_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | Tensor | None = None,
    precision: str = "tf32x3",
) -> tuple[Tensor, Tensor | None]:
    """Same arguments and results as :func:`k3.ops.kda.reference.chunk_kda` (chunk size 64), computed by the two
    Triton kernels in fp32. ``precision`` is the fp32 matmuls' ``input_precision`` on a GPU: "tf32x3" (three TF32
    products, about fp32's accuracy), "tf32" (one), or "ieee" (CUDA-core fp32, which these tiles spill badly);
    Triton's interpreter computes in fp32 whatever is asked. q, k [B, T, H, K] and v [B, T, H, V] with K and V
    powers of two from 16 to 128; g must satisfy :func:`block_spread_ok`. Returns o [B, T, H, V] in v.dtype and
    the final state [N, H, K, V] in fp32."""
    f = forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision)
    return unpad(f.index, f.o, v.shape), (f.s_n if output_final_state else None)


class Forward(NamedTuple):
    """The padded layout and what the forward pass computed in it (the backward pass reads all of it)."""

    index: Tensor  # [Tp]: each padded position's flat [B*T] source, -1 for padding
    cu_chunks: Tensor  # [N+1] int32
    qp: Tensor  # [Tp, H, K] and the like: the inputs, zeros at padding (g, beta in fp32)
    kp: Tensor
    vp: Tensor
    gp: Tensor
    bp: Tensor
    u: Tensor  # [Tp, H, V] fp32: L^-1 (beta V)
    wk: Tensor  # [Tp, H, K] fp32: L^-1 (beta exp(G) K)
    bqk: Tensor  # [Tp, H, C] fp32: each chunk's Bqk rows
    o: Tensor  # [Tp, H, V] in v.dtype
    s_n: Tensor  # [N, H, K, V] fp32: the final states
    states: Tensor | None  # [Tp / C, H, K, V] fp32: the state entering each chunk (keep_states)
    scale: float


def pad(index: Tensor, t: Tensor) -> Tensor:
    """[B, T, H, ...] -> [Tp, H, ...] by the layout's index, zeros at padding."""
    valid = index >= 0
    flat = t.reshape(-1, *t.shape[2:])[index.clamp(min=0)]
    return torch.where(valid.view(-1, *([1] * (flat.dim() - 1))), flat, 0).contiguous()


def unpad(index: Tensor, t: Tensor, shape) -> Tensor:
    """[Tp, H, ...] -> [B, T, H, ...] (shape's first two dims), dropping the padding."""
    valid = index >= 0
    out = t.new_zeros(shape[0] * shape[1], *t.shape[1:])
    out[index[valid]] = t[valid]
    return out.view(*shape[:2], *t.shape[1:])


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    cu_seqlens: Segments | Tensor | None,
    precision: str = "tf32x3",
    keep_states: bool = False,
    gate_bounded: bool = False,
) -> Forward:
    """The forward pass of :func:`chunk_kda_fwd` with its intermediates (and, with ``keep_states``, the state
    entering every chunk) in the padded layout. ``gate_bounded``: the caller knows g satisfies
    :func:`block_spread_ok` (a gate with a lower bound), which then is not checked (a host sync)."""
    B, T, H, DK = q.shape
    DV = v.shape[-1]
    cu_seqlens = as_segments(cu_seqlens, q.device)
    dtype, scale, N = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if dtype != torch.float32 or any(d not in (16, 32, 64, 128) for d in (DK, DV)):
        raise ValueError(
            f"chunk_kda_fwd: head dims {DK} / {DV} (16, 32, 64 or 128) and fp32 or narrower inputs, got {dtype}"
        )
    if not gate_bounded and not block_spread_ok(g):
        raise ValueError(
            f"chunk_kda_fwd: g decays some channel by more than {MAX_BLOCK_SPREAD} over {BLOCK - 1} positions; "
            "use the reference or fla's chunk_kda for such gates"
        )
    index, cu_chunks = _layout(B, T, cu_seqlens, q.device)
    qp, kp, vp, gp, bp = (pad(index, t) for t in (q, k, v, g.float(), beta.float()))
    tp = index.shape[0]
    u = q.new_empty(tp, H, DV, dtype=torch.float32)
    wk = q.new_empty(tp, H, DK, dtype=torch.float32)
    bqk = q.new_empty(tp, H, CHUNK, dtype=torch.float32)
    o = q.new_empty(tp, H, DV, dtype=v.dtype)
    s_n = q.new_empty(N, H, DK, DV, dtype=torch.float32)
    states = q.new_empty(tp // CHUNK, H, DK, DV, dtype=torch.float32) if keep_states else None
    s0 = initial_state.float().contiguous() if initial_state is not None else s_n
    if tp:
        _intra_kernel[(tp // CHUNK, H)](
            qp,
            kp,
            vp,
            gp,
            bp,
            u,
            wk,
            bqk,
            H=H,
            DK=DK,
            DV=DV,
            C=CHUNK,
            BLK=BLOCK,
            KB=min(DK, DV, 64),
            PRECISION=precision,
            num_warps=8,
        )
    bv = min(DV, 64)
    _inter_kernel[(N, H, DV // bv)](
        qp,
        kp,
        gp,
        u,
        wk,
        bqk,
        cu_chunks,
        s0,
        o,
        s_n,
        s_n if states is None else states,
        scale,
        H=H,
        DK=DK,
        DV=DV,
        BV=bv,
        C=CHUNK,
        HAS_S0=initial_state is not None,
        STORE_STATES=keep_states,
        PRECISION=precision,
        num_warps=8,
    )
    return Forward(index, cu_chunks, qp, kp, vp, gp, bp, u, wk, bqk, o, s_n, states, scale)
