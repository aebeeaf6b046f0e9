"""Grouped matmul for groups of a few rows (decode): Triton, forward only.

At decode the expert-sorted buffer of k3.ops.moe.grouped holds a handful of rows per expert (B=64, k=8, E=64:
8 on average), so each expert's product is a weight stream: the time is reading w [E, N, K] once. ``torch._grouped_mm``
reached about half the copy bandwidth there on an H200 (benchmarks/results/profile_decode.txt: 33 launches, 1.01 ms
for ~2.2 GB of expert weights per step). Here each program takes one expert and one block of BLOCK_N output
columns, streams that block of the expert's weight through K, and multiplies it with the expert's rows BLOCK_M at
a time (one pass when the group fits BLOCK_M, the decode case): E * N / BLOCK_N programs, each reading its
weights once. Groups as in grouped.py: expert e owns rows [offs[e-1], offs[e]) (offs[-1] = 0), in any number,
possibly none; rows after offs[E-1] are not written.

The default for no-grad batches of at most COUNT_PAIRS pairs where Triton is usable (``K3_MOE_SMALL_GROUPS=
grouped_mm`` turns it off): 1.3-2x grouped_mm's speed at decode on an H200 (benchmarks/results/moe_decode_mm.md).
moe_experts logs which one runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_stages=s, num_warps=4)
            for n in (32, 64, 128) for k in (64, 128, 256) for s in (3, 4)]


@triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M"])
@triton.jit
def _small_groups_kernel(X, W, OFFS, Y, stride_xr, stride_we, stride_wn, stride_yr, N: tl.constexpr, K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
            x = tl.load(X + rows[:, None].to(tl.int64) * stride_xr + ks[None, :],
                        mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_base + ks[:, None], mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)  # [BK, BN]
            acc = tl.dot(x, w, acc)
        tl.store(Y + rows[:, None].to(tl.int64) * stride_yr + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rows[:, None] < end) & (cols[None, :] < N))
        m0 += BLOCK_M


def block_m(rows: int, groups: int) -> int:
    """Rows per pass: the average group (padded to 8 by the router) rounded up to a power of two, 16..64."""
    return min(64, max(16, triton.next_power_of_2(-(-rows // max(groups, 1)))))


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


def _check(x: Tensor, w: Tensor, offs: Tensor) -> None:
    if (x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or tuple(offs.shape) != (w.shape[0],)
            or x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"small_groups_mm: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} and offs "
                         f"{tuple(offs.shape)} do not match")


def _run(kernel, x: Tensor, w: Tensor, offs: Tensor, y: Tensor, bm: int, **meta) -> None:
    """Launch ``kernel``: the autotuned one, or (tests) the bare jit function with BLOCK_N / BLOCK_K in meta."""
    E, N, K = w.shape

    def grid(m):
        return E, triton.cdiv(N, m["BLOCK_N"])

    kernel[grid](x, w, offs, y, x.stride(0), w.stride(0), w.stride(1), y.stride(0), N=N, K=K, BLOCK_M=bm, **meta)
