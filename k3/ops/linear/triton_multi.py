"""Several linear maps of one input in one Triton launch: y_i = x @ W_i^T for up to 8 weights W_i [N_i, K].

Each program takes one block of BLOCK_N output columns of one weight, streams that block of the weight through K
once and multiplies it with x, BLOCK_M rows at a time (one pass at decode batch sizes): sum_i cdiv(N_i, BLOCK_N)
programs in one launch, where torch launches one GEMV per weight. The program's weight is found by comparing its
id with the running block counts (one ``if`` per weight slot, unused slots pruned at compile time).

Launch: BLOCK_K = 128, 4 stages (2 on a GPU whose shared memory does not fit 4, logged), 4 warps, and BLOCK_N = 32,
or 16 where that leaves fewer than 64 programs (more programs in flight for small maps): at 64 rows the fastest
fixed configuration for a KDA layer's six maps and within a few percent of it for the shared experts' two
(benchmarks/results/multi_linear_configs.md). A fixed rule, not Triton's autotuner, which re-runs in every process
and chose differently each time (docs/decisions.md, "Fixed launch rules where a kernel runs a few microseconds").

The last ``fp32`` weights' outputs are fp32 (a MoE router's logits): their weights in x's dtype (exact products,
fp32 sums) or in fp32 (x upcast, fp32 products: for bf16 x on the tensor cores, the weight split into three exact
bf16 parts, :func:`_dot_fp32_weight`).

Forward only, for no-grad calls (decode): k3.ops.linear.multi_linear picks it and logs which path runs.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from k3.ops.linear import MAX_WEIGHTS, weights_fit
from k3.ops.pdl import launch as pdl_launch, wait_then_release

_SIZES = [f"N{i}" for i in range(MAX_WEIGHTS)]
_fewer_stages: set[bool] = set()  # logged once: the rule's stages did not fit a GPU


@triton.jit
def _dot_fp32_weight(x, w, acc):
    """acc + x @ w for bf16 x [BM, BK] and fp32 w [BK, BN], exactly as fp32 products with fp32 sums: w is split into
    three bf16 parts, w = hi + mid + lo exactly (each part rounds the rest to bf16's 8 significant bits, and bf16
    has fp32's exponent range: exact for |w| >= 2^-110), and x times each part is a bf16 tensor-core product, exact
    in fp32. Triton's fp32 "ieee" dot runs on the CUDA cores, ~10x slower than the weight's read at K3's widths
    (benchmarks/results/multi_linear_configs-k3.md)."""
    hi = w.to(tl.bfloat16)
    rest = w - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(x, lo, acc)  # smallest first
    acc = tl.dot(x, mid, acc)
    return tl.dot(x, hi, acc)


@triton.jit
def _mm_block(
    X, w, y, n, blk, M, stride_xm, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """y[:, cols] = x @ w[cols, :]^T for this program's BLOCK_N columns (w [n, K] and y [M, n] row-major)."""
    cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(
                X + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            wk = tl.load(
                w + cols[None, :].to(tl.int64) * K + ks[:, None],
                mask=(ks[:, None] < K) & (cols[None, :] < n),
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
            if (wk.dtype == tl.float32) & (xk.dtype == tl.bfloat16):  # an fp32 weight (a router's), bf16 x:
                acc = _dot_fp32_weight(xk, wk, acc)  # exact products on the tensor cores
            elif wk.dtype == tl.float32:  # fp16 x: x upcast, fp32 products on the CUDA cores
                acc = tl.dot(xk.to(tl.float32), wk, acc, input_precision="ieee")
            else:
                acc = tl.dot(xk, wk, acc)
        tl.store(
            y + rows[:, None].to(tl.int64) * n + cols[None, :],
            acc.to(y.dtype.element_ty),
            mask=(rows[:, None] < M) & (cols[None, :] < n),
        )


@triton.jit
def _slot(
    X,
    w,
    y,
    n,
    pid,
    start,
    M,
    stride_xm,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weight slot whose programs are [start, end): run this program's block if it is one; -> end."""
    end = start + tl.cdiv(n, BLOCK_N)
    if (pid >= start) & (pid < end):
        _mm_block(X, w, y, n, pid - start, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)
    return end


@triton.jit(do_not_specialize=["M"] + _SIZES)
def _multi_linear_kernel(
    X,
    W0,
    W1,
    W2,
    W3,
    W4,
    W5,
    W6,
    W7,
    Y0,
    Y1,
    Y2,
    Y3,
    Y4,
    Y5,
    Y6,
    Y7,
    N0,
    N1,
    N2,
    N3,
    N4,
    N5,
    N6,
    N7,
    M,
    stride_xm,
    G: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # the last slots' programs first: fp32 ones are the slowest
    end = _slot(X, W0, Y0, N0, pid, 0, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)
    if G > 1:
        end = _slot(X, W1, Y1, N1, pid, end, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)
    if G > 2:
        end = _slot(X, W2, Y2, N2, pid, end, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)
    if G > 3:
        end = _slot(X, W3, Y3, N3, pid, end, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)
    if G > 4:
        end = _slot(X, W4, Y4, N4, pid, end, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)
    if G > 5:
        end = _slot(X, W5, Y5, N5, pid, end, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)
    if G > 6:
        end = _slot(X, W6, Y6, N6, pid, end, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)
    if G > 7:
        _slot(X, W7, Y7, N7, pid, end, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K)


def block_m(rows: int) -> int:
    """Rows per pass: the row count rounded up to a power of two, 16..64 (tl.dot needs 16)."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def launch_config(sizes: list[int]) -> dict:
    """The launch of maps with these output widths (module docstring): BLOCK_N, BLOCK_K, num_stages, num_warps."""
    wide = sum(triton.cdiv(n, 32) for n in sizes) >= 64
    return {"BLOCK_N": 32 if wide else 16, "BLOCK_K": 128, "num_stages": 4, "num_warps": 4}


@torch.library.custom_op("k3::multi_linear", mutates_args=())
def multi_linear(x: Tensor, weights: list[Tensor], fp32: int = 0) -> list[Tensor]:
    """x [M, K], weights [N_i, K] (1..MAX_WEIGHTS, x's dtype: bf16 or fp16) -> [x @ W_i^T, [M, N_i] each], fp32
    accumulation; the last ``fp32`` outputs in fp32, their weights in x's dtype or fp32 (x upcast). A custom op
    (``torch.ops.k3.multi_linear``): a compiled decode step keeps it inside its graph."""
    _check(x, weights, fp32)
    ys = _outputs(x, weights, fp32)
    if x.shape[0] and any(w.shape[0] for w in weights):
        ws, bm = [w.contiguous() for w in weights], block_m(x.shape[0])
        config = launch_config([w.shape[0] for w in ws])
        try:
            _run(x, ws, ys, bm, **config)
        except OutOfResources:  # a GPU with less shared memory per block than the rule's 4 stages need (~96 KB)
            if not _fewer_stages:
                _fewer_stages.add(True)
                logging.getLogger("k3.ops").warning(
                    "multi_linear: 4 stages do not fit this GPU's shared memory; launching with 2"
                )
            _run(x, ws, ys, bm, **(config | {"num_stages": 2}))
    return ys


@multi_linear.register_fake
def _(x: Tensor, weights: list[Tensor], fp32: int = 0) -> list[Tensor]:
    _check(x, weights, fp32)
    return _outputs(x, weights, fp32)


def _outputs(x: Tensor, weights: list[Tensor], fp32: int) -> list[Tensor]:
    n = len(weights) - fp32
    return [
        x.new_empty(x.shape[0], w.shape[0], dtype=x.dtype if i < n else torch.float32) for i, w in enumerate(weights)
    ]


def _check(x: Tensor, weights: list[Tensor], fp32: int) -> None:
    if (
        x.dim() != 2
        or x.dtype not in (torch.bfloat16, torch.float16)
        or not 1 <= len(weights) <= MAX_WEIGHTS
        or not weights_fit(x, weights, fp32)
        or any(w.device != x.device for w in weights)
    ):
        raise ValueError(
            f"multi_linear: x {tuple(x.shape)} {x.dtype} (bf16 / fp16 [M, K]) and weights "
            f"{[(tuple(w.shape), w.dtype) for w in weights]} with fp32={fp32} (1..{MAX_WEIGHTS} of "
            "[N, K], x's dtype, the last fp32 ones also fp32, and device) do not match"
        )


def _run(x: Tensor, weights: list[Tensor], ys: list[Tensor], bm: int, BLOCK_N: int, BLOCK_K: int, **launch) -> None:
    """Launch the kernel with these blocks (and optionally num_stages / num_warps in ``launch``)."""
    g = len(weights)
    pad = MAX_WEIGHTS - g
    sizes = [w.shape[0] for w in weights] + [0] * pad
    ws, outs = weights + [weights[0]] * pad, ys + [ys[0]] * pad  # unused slots: never read (G prunes them)
    if x.stride(1) != 1:
        x = x.contiguous()
    grid = (sum(triton.cdiv(n, BLOCK_N) for n in sizes),)
    _multi_linear_kernel[grid](
        x,
        *ws,
        *outs,
        *sizes,
        x.shape[0],
        x.stride(0),
        G=g,
        K=x.shape[1],
        BLOCK_M=bm,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        **launch,
        **pdl_launch(x.device),
    )
