"""Chunked KDA with a gradient, in Triton (docs/architecture.md#kda): :func:`chunk_kda`, the forward kernels of
:mod:`k3.ops.kda.triton_chunk` (keeping the state entering each chunk) and the backward kernels here.

Per chunk and head, with the forward's notation (G = cumsum g, Gam = exp(G), G_C = G at the chunk's last
position, Kt = exp(G_C - G) * K, W = U - Wk S_0) and incoming gradients dO and dS_C (of the state leaving the
chunk), the backward pass is

    dW  = scale Bqk^T dO + Kt dS_C                        dBqk = scale dO W^T (j <= i)
    dQt = scale dO S_0^T  (of Gam * Q)                    dKt  = W dS_C^T
    dWk = -dW S_0^T                                       dS_0 = exp(G_C) * dS_C + scale (Gam * Q)^T dO - Wk^T dW
    dRv = L^-T dW,  dRk = L^-T dWk                        dL   = -(dRv U^T + dRk Wk^T)  (j < i),  dA = beta * dL
    dV  = beta * dRv                                      dbeta = rowsum(dL * A + dRv * V + dRk * Gam * K)

and dA, dBqk reach q, k and G through A_ij = sum_c k_ic k_jc exp(G_ic - G_jc) and Bqk likewise, each column
block of 16 positions pivoted at its first position as in the forward (every exponent stays in fp32's range);
exp(G_C) S_0 and Kt add their G_C terms at the chunk's last position, and dg is the reverse cumulative sum of dG
within the chunk. G, exp(G) * q and exp(G_C - G) * k are formed once in torch; then three launches:

* ``_inter_bwd_kernel``, one program per (sequence, head, block of BV value columns), through the chunks from
  the last: dS carried in fp32, dW written, and the sums over value columns (dQt, dKt, dBqk, dWk and the G_C
  term) accumulated over the blocks by atomic adds (two blocks at V = 128: an exact, order-free sum).
* ``_solve_bwd_kernel``, one program per (chunk, head): A and L's blocks again, the two transposed solves, dv,
  dbeta, dA and dRk.
* ``_qkg_bwd_kernel``, one program per (chunk, head, 32 key columns): dq, dk and dg.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.kda.reference import _from_raw
from k3.ops.kda.triton_chunk import BLOCK, CHUNK, MAX_BLOCK_SPREAD, Forward, forward, pad, unpad
from k3.ops.segments import Segments, as_segments


@triton.jit
def _transposed_substitution(DinvT, NoT, R, BLK: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr):
    """X with L^T X = R by block rows from the last, L = I + Nd + No: X_a = Dinv_a^T (R_a - sum_{b>a} No_ba^T
    X_b); DinvT and NoT are Dinv^T and No^T."""
    i = tl.arange(0, C)
    X = tl.zeros(R.shape, dtype=tl.float32)
    for step in tl.static_range(C // BLK):
        a = C // BLK - 1 - step
        rhs = tl.where(((i // BLK) == a)[:, None], R - tl.dot(NoT, X, input_precision=PRECISION), 0.0)
        X += tl.dot(DinvT, rhs, input_precision=PRECISION)
    return X


@triton.jit
def _inter_bwd_kernel(
    QG,
    KEND,
    EGL,
    U,
    WK,
    BQK,
    HS,
    CU_CHUNKS,
    DO,
    DSN,
    DS0,
    DW,
    PQ,
    PK,
    PB,
    PW,
    PGC,
    scale,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    HAS_DSN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One sequence, head and block of BV value columns, through its chunks from the last: dS in fp32, dW, and the
    partial sums over these value columns. QG = exp(G) * q, KEND = exp(G_C - G) * k, EGL = exp(G_C)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    i = tl.arange(0, C)
    kk = tl.arange(0, DK)
    state = (n * H + h).to(tl.int64) * DK * DV + kk[:, None] * DV + vv[None, :]
    if HAS_DSN:
        dS = tl.load(DSN + state).to(tl.float32)
    else:
        dS = tl.zeros([DK, BV], dtype=tl.float32)
    first = tl.load(CU_CHUNKS + n)
    c = tl.load(CU_CHUNKS + n + 1) - 1
    while c >= first:
        row = (c * C + i).to(tl.int64) * H + h
        at_k = row[:, None] * DK + kk[None, :]
        at_v = row[:, None] * DV + vv[None, :]
        S0 = tl.load(HS + (c * H + h).to(tl.int64) * DK * DV + kk[:, None] * DV + vv[None, :])
        wk = tl.load(WK + at_k)
        w = tl.load(U + at_v) - tl.dot(wk, S0, input_precision=PRECISION)
        tl.atomic_add(PK + at_k, tl.dot(w, tl.trans(dS), input_precision=PRECISION))
        do = tl.load(DO + at_v)
        tl.atomic_add(PB + row[:, None] * C + i[None, :], tl.dot(do, tl.trans(w), input_precision=PRECISION))
        dw = tl.dot(tl.trans(tl.load(BQK + row[:, None] * C + i[None, :])), do, input_precision=PRECISION) * scale
        dw = tl.dot(tl.load(KEND + at_k), dS, dw, input_precision=PRECISION)
        tl.store(DW + at_v, dw)
        tl.atomic_add(PQ + at_k, tl.dot(do, tl.trans(S0), input_precision=PRECISION))
        tl.atomic_add(PW + at_k, tl.dot(dw, tl.trans(S0), input_precision=PRECISION))
        tl.atomic_add(PGC + (c * H + h).to(tl.int64) * DK + kk, tl.sum(S0 * dS, axis=1))
        egl = tl.load(EGL + (c * H + h).to(tl.int64) * DK + kk)
        dS = egl[:, None] * dS - tl.dot(tl.trans(wk), dw, input_precision=PRECISION)
        dS += scale * tl.dot(tl.trans(tl.load(QG + at_k)), do, input_precision=PRECISION)
        c -= 1
    tl.store(DS0 + state, dS)


@triton.jit
def _solve_bwd_kernel(
    K_,
    V_,
    G_,
    BETA,
    U,
    WK,
    DW,
    PW,
    DRK,
    DA,
    DVo,
    DBETA,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    C: tl.constexpr,
    BLK: tl.constexpr,
    KB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One chunk of one head: A and L's blocks again, dRv = L^-T dW (-> dv), dRk = L^-T dWk (stored), dbeta and
    dA. G_ holds G (the cumulative sums)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, C)
    kb = tl.arange(0, KB)
    row = (c * C + i).to(tl.int64) * H + h
    rows = i[:, None]
    cols = i[None, :]
    beta = tl.load(BETA + row).to(tl.float32)

    A = tl.zeros([C, C], dtype=tl.float32)  # as the forward computes it
    for k0 in tl.static_range(0, DK, KB):
        at = row[:, None] * DK + k0 + kb[None, :]
        k = tl.load(K_ + at).to(tl.float32)
        G = tl.load(G_ + at)
        for b in tl.static_range(C // BLK):
            f = b * BLK
            G_f = tl.sum(tl.where(rows == f, G, 0.0), axis=0)
            in_block = ((i >= f) & (i < f + BLK))[:, None]
            col_factor = tl.where(in_block, k * tl.exp(tl.where(in_block, G_f[None, :] - G, 0.0)), 0.0)
            row_decay = tl.exp(tl.where(rows >= f, G - G_f[None, :], float("-inf")))
            A += tl.dot(k * row_decay, tl.trans(col_factor), input_precision=PRECISION)
    A = tl.where(rows > cols, A, 0.0)
    Nd = tl.where((rows > cols) & ((rows // BLK) == (cols // BLK)), beta[:, None] * A, 0.0)
    power = Nd
    Dinv = tl.where(rows == cols, 1.0, 0.0) - Nd
    for _ in tl.static_range(3):
        power = tl.dot(power, power, input_precision=PRECISION)
        Dinv += tl.dot(Dinv, power, input_precision=PRECISION)
    DinvT = tl.trans(Dinv)
    NoT = tl.trans(beta[:, None] * A - Nd)

    dL = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in tl.static_range(0, DV, KB):
        at = row[:, None] * DV + v0 + kb[None, :]
        dRv = _transposed_substitution(DinvT, NoT, tl.load(DW + at), BLK, C, PRECISION)
        dL -= tl.dot(dRv, tl.trans(tl.load(U + at)), input_precision=PRECISION)
        dbeta += tl.sum(dRv * tl.load(V_ + at).to(tl.float32), axis=1)
        tl.store(DVo + at, beta[:, None] * dRv)
    for k0 in tl.static_range(0, DK, KB):
        at = row[:, None] * DK + k0 + kb[None, :]
        dRk = _transposed_substitution(DinvT, NoT, -tl.load(PW + at), BLK, C, PRECISION)
        tl.store(DRK + at, dRk)
        dL -= tl.dot(dRk, tl.trans(tl.load(WK + at)), input_precision=PRECISION)
        dbeta += tl.sum(dRk * tl.exp(tl.load(G_ + at)) * tl.load(K_ + at).to(tl.float32), axis=1)
    dL = tl.where(rows > cols, dL, 0.0)
    tl.store(DBETA + row, dbeta + tl.sum(dL * A, axis=1))
    tl.store(DA + row[:, None] * C + cols, beta[:, None] * dL)


@triton.jit
def _qkg_bwd_kernel(
    Q,
    K_,
    G_,
    BETA,
    DA,
    DRK,
    PQ,
    PK,
    PB,
    PGC,
    DQ,
    DKo,
    DG,
    scale,
    H: tl.constexpr,
    DK: tl.constexpr,
    C: tl.constexpr,
    BLK: tl.constexpr,
    KB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One chunk, head and block of KB key columns: dq, dk and dg from dA, dBqk (scale * PB) and the rest."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    k0 = tl.program_id(2) * KB
    i = tl.arange(0, C)
    kb = tl.arange(0, KB)
    row = (c * C + i).to(tl.int64) * H + h
    rows = i[:, None]
    cols = i[None, :]
    at = row[:, None] * DK + k0 + kb[None, :]
    beta = tl.load(BETA + row).to(tl.float32)
    q = tl.load(Q + at).to(tl.float32)
    k = tl.load(K_ + at).to(tl.float32)
    G = tl.load(G_ + at)
    G_last = tl.sum(tl.where(rows == C - 1, G, 0.0), axis=0)
    gam = tl.exp(G)
    to_end = tl.exp(G_last[None, :] - G)
    dRk = tl.load(DRK + at)
    dqt = scale * tl.load(PQ + at)
    dkt = tl.load(PK + at)
    dq = gam * dqt
    dk = to_end * dkt + beta[:, None] * gam * dRk
    dG = gam * q * dqt - to_end * k * dkt + beta[:, None] * gam * k * dRk
    dA = tl.load(DA + row[:, None] * C + cols)
    dB = scale * tl.where(rows >= cols, tl.load(PB + row[:, None] * C + cols), 0.0)
    dk_row = tl.zeros([C, KB], dtype=tl.float32)  # through A's row factor k_i; then its column factor k_j
    dk_col = tl.zeros([C, KB], dtype=tl.float32)
    dq_b = tl.zeros([C, KB], dtype=tl.float32)  # through Bqk's q_i; then its k_j
    dk_b = tl.zeros([C, KB], dtype=tl.float32)
    for b in tl.static_range(C // BLK):
        f = b * BLK
        G_f = tl.sum(tl.where(rows == f, G, 0.0), axis=0)
        in_block = ((i >= f) & (i < f + BLK))[:, None]
        col_scale = tl.where(in_block, tl.exp(tl.where(in_block, G_f[None, :] - G, 0.0)), 0.0)
        row_decay = tl.exp(tl.where(rows >= f, G - G_f[None, :], float("-inf")))
        dk_row += row_decay * tl.dot(dA, k * col_scale, input_precision=PRECISION)
        dq_b += row_decay * tl.dot(dB, k * col_scale, input_precision=PRECISION)
        dk_col += col_scale * tl.dot(tl.trans(dA), k * row_decay, input_precision=PRECISION)
        dk_b += col_scale * tl.dot(tl.trans(dB), q * row_decay, input_precision=PRECISION)
    dq += dq_b
    dk += dk_row + dk_col + dk_b
    dG += k * (dk_row - dk_col - dk_b) + q * dq_b
    pgc = tl.load(PGC + (c * H + h).to(tl.int64) * DK + k0 + kb)
    last = tl.exp(G_last) * pgc + tl.sum(to_end * k * dkt, axis=0)  # [KB]: G_C's own terms
    dG += tl.where(rows == C - 1, last[None, :], 0.0)
    tl.store(DQ + at, dq)
    tl.store(DKo + at, dk)
    tl.store(DG + at, tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG)  # reverse cumulative sum


def backward(f: Forward, do: Tensor, dsn: Tensor | None, precision: str = "tf32x3") -> tuple[Tensor, ...]:
    """Gradients in the padded layout, fp32: dq, dk, dg [Tp, H, K], dv [Tp, H, V], dbeta [Tp, H] and the initial
    states' [N, H, K, V], from dO [Tp, H, V] (fp32) and the final states' gradient (None: zero)."""
    tp, H, DK = f.qp.shape
    DV = f.vp.shape[-1]
    N = f.s_n.shape[0]
    f32 = dict(dtype=torch.float32, device=f.qp.device)
    G = f.gp.view(-1, CHUNK, H, DK).cumsum(1)  # [chunks, C, H, K]
    G_last = G[:, -1]
    qg = (f.qp.view_as(G) * G.exp()).view(tp, H, DK)
    kend = (f.kp.view_as(G) * (G_last[:, None] - G).exp()).view(tp, H, DK)
    G = G.view(tp, H, DK)
    dw = torch.empty(tp, H, DV, **f32)
    pq, pk, pw = (torch.zeros(tp, H, DK, **f32) for _ in range(3))
    pb = torch.zeros(tp, H, CHUNK, **f32)
    pgc = torch.zeros(tp // CHUNK, H, DK, **f32)
    ds0 = torch.empty(N, H, DK, DV, **f32)
    bv = min(DV, 64)
    _inter_bwd_kernel[(N, H, DV // bv)](
        qg,
        kend,
        G_last.exp(),
        f.u,
        f.wk,
        f.bqk,
        f.states,
        f.cu_chunks,
        do,
        ds0 if dsn is None else dsn.float().contiguous(),
        ds0,
        dw,
        pq,
        pk,
        pb,
        pw,
        pgc,
        f.scale,
        H=H,
        DK=DK,
        DV=DV,
        BV=bv,
        C=CHUNK,
        HAS_DSN=dsn is not None,
        PRECISION=precision,
        num_warps=8,
    )
    del qg, kend
    dq, dk, dg, drk = (torch.empty(tp, H, DK, **f32) for _ in range(4))
    dv = torch.empty(tp, H, DV, **f32)
    dbeta = torch.empty(tp, H, **f32)
    da = torch.empty(tp, H, CHUNK, **f32)
    kb = min(DK, DV, 64)
    if tp:
        _solve_bwd_kernel[(tp // CHUNK, H)](
            f.kp,
            f.vp,
            G,
            f.bp,
            f.u,
            f.wk,
            dw,
            pw,
            drk,
            da,
            dv,
            dbeta,
            H=H,
            DK=DK,
            DV=DV,
            C=CHUNK,
            BLK=BLOCK,
            KB=kb,
            PRECISION=precision,
            num_warps=8,
        )
        _qkg_bwd_kernel[(tp // CHUNK, H, DK // min(DK, 32))](
            f.qp,
            f.kp,
            G,
            f.bp,
            da,
            drk,
            pq,
            pk,
            pb,
            pgc,
            dq,
            dk,
            dg,
            f.scale,
            H=H,
            DK=DK,
            C=CHUNK,
            BLK=BLOCK,
            KB=min(DK, 32),
            PRECISION=precision,
            num_warps=4,
        )
    return dq, dk, dv, dg, dbeta, ds0


class _ChunkKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, cu_seqlens, precision, gate_bounded):
        f = forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, True, gate_bounded)
        ctx.save_for_backward(*f._replace(o=None)[:-1])  # all but the output and the scale
        ctx.scale, ctx.precision = f.scale, precision
        ctx.inputs = [(t.shape, t.dtype) for t in (q, k, v, g, beta)]
        ctx.state_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return unpad(f.index, f.o, v.shape), f.s_n

    @staticmethod
    def backward(ctx, do, dsn):
        f = Forward(*ctx.saved_tensors, ctx.scale)
        do_p = torch.zeros_like(f.u) if do is None else pad(f.index, do.float())
        grads = backward(f, do_p, dsn, ctx.precision)
        out = [unpad(f.index, t, shape).to(dtype) for t, (shape, dtype) in zip(grads[:5], ctx.inputs)]
        ds0 = None if ctx.state_dtype is None else grads[5].to(ctx.state_dtype)
        return (*out, ds0, None, None, None, None)


def chunk_kda(
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
    gate_bounded: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`k3.ops.kda.triton_chunk.chunk_kda_fwd` with a gradient: q, k, v, g, beta and the initial state
    receive theirs through o and the final state. Same arguments; the forward keeps, per chunk and head, the state
    entering it (K x V fp32) and its intermediates for the backward pass. ``gate_bounded``: as in
    :func:`k3.ops.kda.triton_chunk.forward`."""
    cu_seqlens = as_segments(cu_seqlens, q.device)
    o, s_n = _ChunkKDA.apply(q, k, v, g, beta, initial_state, scale, cu_seqlens, precision, gate_bounded)
    return o, (s_n if output_final_state else None)


@torch.compiler.disable  # the layout reads sequence lengths on the host; the kernels stay out of traced graphs
def chunk_kda_raw(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f: Tensor,
    b: Tensor,
    *,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float,
    l2norm_eps: float = 1e-6,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | Tensor | None = None,
    chunk_size: int = CHUNK,
) -> tuple[Tensor, Tensor | None]:
    """:func:`k3.ops.kda.reference.chunk_kda_raw` with the chunked recurrence by :func:`chunk_kda`: the norms, the
    gate and beta's sigmoid in torch, differentiable in every tensor argument. K3's bounded gate (``lower_bound``
    l, g in (l, 0)) keeps the kernels' exponentials in range when (BLOCK - 1) |l| <= MAX_BLOCK_SPREAD (l >= -5.33),
    so no host check is made; other gates raise."""
    if chunk_size != CHUNK or lower_bound is None or -lower_bound * (BLOCK - 1) > MAX_BLOCK_SPREAD:
        raise ValueError(
            f"chunk_kda_raw (Triton): needs chunk_size {CHUNK} and a gate lower bound >= "
            f"{-MAX_BLOCK_SPREAD / (BLOCK - 1):.2f}, got {chunk_size} and {lower_bound}"
        )
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
        gate_bounded=True,
    )
