"""Grouped matmul for groups of a few rows (decode): Triton, forward only.

At decode the expert-sorted buffer of k3.ops.moe.grouped holds a handful of rows per expert (B=64, k=8, E=64:
8 on average), so each expert's product is a weight stream: the time is reading w [E, N, K] once. ``torch._grouped_mm``
reached about half the copy bandwidth there (benchmarks/results/moe_decode_mm.md,
benchmarks/results/decode-quick-grouped_mm.md). Here each program takes one expert and one block of BLOCK_N output
columns, streams that block of the expert's weight through K, and multiplies it with the expert's rows BLOCK_M at
a time (one pass when the group fits BLOCK_M, the decode case: :func:`block_m`): E * N / BLOCK_N programs, each
reading its weights once per pass. Groups as in grouped.py: expert e owns rows [offs[e-1], offs[e]) (offs[-1] =
0), in any number, possibly none; rows after offs[E-1] are not written.

The default for no-grad batches of at most COUNT_PAIRS pairs where Triton is usable
(``K3_KERNELS=moe_small_groups=grouped_mm`` turns it off): faster than grouped_mm at every decode shape measured
(benchmarks/results/moe_decode_mm.md).
moe_experts logs which one runs.

``small_groups_glu`` is the same kernel for the up-projection with two weights and an epilogue: each program gathers
its group's rows from the tokens (through the routing's src_pair), multiplies them by its block of w1 and of w3 and
writes act(gate, up) (SiTU-GLU or SwiGLU), one launch where apart the row gather, two matmuls and the GLU take four.
The default where the small-groups kernel runs (``K3_KERNELS=moe_up_glu=torch`` turns it off,
grouped.up_glu_kernel), because it was faster in the decode step
(docs/decisions.md, "A kernel written without a GPU is opt-in until one has run it; then, if faster, the default").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.moe.layout import ALIGN, GLU_ACTS
from k3.ops.pdl import launch, wait_then_release

_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_stages=s, num_warps=4)
    for n in (32, 64, 128)
    for k in (64, 128, 256)
    for s in (3, 4)
]


@triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M"])
@triton.jit
def _small_groups_kernel(
    X,
    W,
    OFFS,
    Y,
    stride_xr,
    stride_we,
    stride_wn,
    stride_yr,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.load(OFFS + e)
    start = tl.where(e > 0, tl.load(OFFS + tl.maximum(e - 1, 0)), 0)
    w_base = W + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N]: w[e, col, :]
    m0 = start
    while m0 < end:  # (a while loop: Triton's interpreter, which the CPU tests use, cannot range over loaded bounds)
        rows = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                X + rows[:, None].to(tl.int64) * stride_xr + ks[None, :],
                mask=(rows[:, None] < end) & (ks[None, :] < K),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_base + ks[:, None], mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)  # [BK, BN]
            acc = tl.dot(x, w, acc)
        tl.store(
            Y + rows[:, None].to(tl.int64) * stride_yr + cols[None, :],
            acc.to(Y.dtype.element_ty),
            mask=(rows[:, None] < end) & (cols[None, :] < N),
        )
        m0 += BLOCK_M


# one num_stages: other values measured the same (Triton does pipeline the K loop: cp.async at 2-4 stages for sm_90a)
_GLU_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_stages=3, num_warps=4) for n in (32, 64, 128) for k in (64, 128)
]


@triton.jit
def _tanh(x):
    """tanh in fp32 from the sigmoid (Triton's interpreter has no libdevice tanh): 2 sigmoid(2x) - 1 is off by
    ~2e-7 absolute, so near 0, where that is a large relative error, x - x^3/3 (relative error < 2e-9 there)."""
    return tl.where(tl.abs(x) < 1e-2, x - x * x * x / 3.0, 2.0 * tl.sigmoid(2.0 * x) - 1.0)


@triton.autotune(configs=_GLU_CONFIGS, key=["N", "K", "BLOCK_M", "SITU"])
@triton.jit
def _small_groups_glu_kernel(
    X,
    SRC,
    W1,
    W3,
    OFFS,
    H,
    stride_xr,
    stride_we,
    stride_wn,
    stride_hr,
    pairs_per_token,
    beta,
    linear_beta,
    N: tl.constexpr,
    K: tl.constexpr,
    SITU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[r] = act(w1[e] @ x[token(r)], w3[e] @ x[token(r)]) for the rows r of group e, token(r) = SRC[r] // k;
    padding rows (SRC = -1) read zeros. Each product is rounded to h's dtype before the activation, as when the
    matmuls and the GLU run apart."""
    wait_then_release(PDL)
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.load(OFFS + e)
    start = tl.where(e > 0, tl.load(OFFS + tl.maximum(e - 1, 0)), 0)
    w_off = e.to(tl.int64) * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N]: w[e, col, :]
    m0 = start
    while m0 < end:
        rows = m0 + tl.arange(0, BLOCK_M)
        src = tl.load(SRC + rows, mask=rows < end, other=-1)
        token = tl.maximum(src, 0) // pairs_per_token
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                X + token[:, None].to(tl.int64) * stride_xr + ks[None, :],
                mask=(src[:, None] >= 0) & (ks[None, :] < K),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            w_mask = (ks[:, None] < K) & (cols[None, :] < N)
            acc1 = tl.dot(x, tl.load(W1 + w_off + ks[:, None], mask=w_mask, other=0.0), acc1)
            acc3 = tl.dot(x, tl.load(W3 + w_off + ks[:, None], mask=w_mask, other=0.0), acc3)
        g = acc1.to(H.dtype.element_ty).to(tl.float32)
        u = acc3.to(H.dtype.element_ty).to(tl.float32)
        if SITU:
            h = beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
        else:
            h = g * tl.sigmoid(g) * u
        tl.store(
            H + rows[:, None].to(tl.int64) * stride_hr + cols[None, :],
            h.to(H.dtype.element_ty),
            mask=(rows[:, None] < end) & (cols[None, :] < N),
        )
        m0 += BLOCK_M


def block_m(rows: int, groups: int, align: int = ALIGN) -> int:
    """Rows per pass. A group of more than BLOCK_M rows streams its expert's weights again for each further BLOCK_M,
    so BLOCK_M covers a large group, not the average one: k3.ops.moe.grouped's buffer holds the P pairs and
    ``align`` rows per group (ALIGN, or 1 for unpadded groups), so groups average mu = rows / groups - align pairs,
    and an expert's count under uniform routing is about Poisson(mu): BLOCK_M is mu + 4 sqrt(mu) padded to ALIGN,
    as a power of two in 16..64. At the decode benchmark's B=64 (k=8, E=64: mu = 8) that is 32, so its one or two
    groups of 24 rows per layer take one pass, not the two they took with the average (16) (docs/decisions.md,
    "Reads before the PDL wait; expert passes sized for large groups"). B=16 and B=1 keep 16."""
    mu = max(rows / max(groups, 1) - align, 0.0)
    large = -(-(mu + 4 * mu**0.5) // ALIGN) * ALIGN
    return min(64, max(16, triton.next_power_of_2(int(large))))


@torch.library.custom_op("k3::small_groups_mm", mutates_args=())
def small_groups_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """x [R, K], w [E, N, K] (same dtype, bf16 or fp16), offs [E] int32 group ends -> y [R, N] with
    y[r] = w[e] @ x[r] for the rows of group e (fp32 accumulation; rows after offs[-1] unwritten).
    A custom op (``torch.ops.k3.small_groups_mm``): a compiled decode step calls it inside its graph, where a
    ``torch.compiler.disable``d launch cut every MoE layer's graph in four."""
    _check(x, w, offs)
    x = x.contiguous()
    if w.stride(2) != 1:
        w = w.contiguous()
    y = torch.empty(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)
    _run(_small_groups_kernel, x, w, offs.to(torch.int32), y, block_m(x.shape[0], w.shape[0]))
    return y


@small_groups_mm.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    _check(x, w, offs)
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("k3::small_groups_glu", mutates_args=())
def small_groups_glu(
    x: Tensor,
    src_pair: Tensor,
    pairs_per_token: int,
    w1: Tensor,
    w3: Tensor,
    offs: Tensor,
    act: str,
    beta: float,
    linear_beta: float,
) -> Tensor:
    """The experts' up-projection and GLU in one launch, rows gathered on the fly: x [N, K] (the tokens), src_pair
    [R] int64 (the pair a buffer row holds, -1 for padding; pair // pairs_per_token is its token), w1 / w3
    [E, I, K], offs [E] int32 group ends -> h [R, I] = act(w1[e] x[token], w3[e] x[token]) for the rows of group e,
    act 'situ' (SiTU-GLU with beta / linear_beta) or 'silu' (SwiGLU); padding rows give act(0, 0) = 0; rows after
    offs[-1] are not written. What the dispatch gather, two small_groups_mm and the GLU compute apart (each
    product rounded to x's dtype before act, in fp32). A custom op (``torch.ops.k3.small_groups_glu``)."""
    _check_glu(x, src_pair, pairs_per_token, w1, w3, offs, act)
    x, src_pair = x.contiguous(), src_pair.contiguous()
    w1, w3 = w1.contiguous(), w3.contiguous()
    E, N, K = w1.shape
    h = torch.empty(src_pair.shape[0], N, device=x.device, dtype=x.dtype)
    bm = block_m(src_pair.shape[0], E)
    grid = lambda m: (E, triton.cdiv(N, m["BLOCK_N"]))  # noqa: E731
    _small_groups_glu_kernel[grid](
        x,
        src_pair,
        w1,
        w3,
        offs.to(torch.int32),
        h,
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        h.stride(0),
        pairs_per_token,
        beta,
        linear_beta,
        N=N,
        K=K,
        SITU=act == "situ",
        BLOCK_M=bm,
        **launch(x.device),
    )
    return h


@small_groups_glu.register_fake
def _(
    x: Tensor,
    src_pair: Tensor,
    pairs_per_token: int,
    w1: Tensor,
    w3: Tensor,
    offs: Tensor,
    act: str,
    beta: float,
    linear_beta: float,
) -> Tensor:
    _check_glu(x, src_pair, pairs_per_token, w1, w3, offs, act)
    return x.new_empty(src_pair.shape[0], w1.shape[1])


def _check_glu(
    x: Tensor, src_pair: Tensor, pairs_per_token: int, w1: Tensor, w3: Tensor, offs: Tensor, act: str
) -> None:
    _check(x, w1, offs, "small_groups_glu")
    if (
        w1.shape != w3.shape
        or w1.dtype != w3.dtype
        or act not in GLU_ACTS
        or src_pair.dim() != 1
        or src_pair.dtype != torch.int64
        or pairs_per_token < 1
    ):
        raise ValueError(
            f"small_groups_glu: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, src_pair "
            f"{tuple(src_pair.shape)} {src_pair.dtype} (int64 [R]), pairs_per_token={pairs_per_token} "
            f"and act={act!r} (one of {GLU_ACTS}) do not match"
        )


def _check(x: Tensor, w: Tensor, offs: Tensor, op: str = "small_groups_mm") -> None:
    if (
        x.dim() != 2
        or w.dim() != 3
        or w.shape[2] != x.shape[1]
        or tuple(offs.shape) != (w.shape[0],)
        or x.dtype != w.dtype
        or x.dtype not in (torch.bfloat16, torch.float16)
    ):
        raise ValueError(
            f"{op}: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} and offs "
            f"{tuple(offs.shape)} do not match"
        )


def _run(kernel, x: Tensor, w: Tensor, offs: Tensor, y: Tensor, bm: int, **meta) -> None:
    """Launch ``kernel``: the autotuned one, or (tests) the bare jit function with BLOCK_N / BLOCK_K in meta."""
    E, N, K = w.shape

    def grid(m):
        return E, triton.cdiv(N, m["BLOCK_N"])

    kernel[grid](
        x,
        w,
        offs,
        y,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        y.stride(0),
        N=N,
        K=K,
        BLOCK_M=bm,
        **meta,
        **launch(x.device),
    )
