"""The MoE router from its input in one Triton launch: the fp32 GEMM, sigmoid, biased top-k, renormalise, scale.

At decode the router is three kernels per MoE layer on an H200 (benchmarks/results/profile_decode_s26.txt): cuBLAS's
fp32 split-K GEMM (4.3-6.5 us for [64, 1024] x [1024, 64]), its split-K reduction (~2 us) and the top-k kernel of
k3.ops.router.triton_topk (2.4 us), for a product of 4M multiply-adds. Here one launch does all of it:

  phase 1: program (b, s) multiplies the rows x [N, D] by experts b*BLOCK_E.. of the weight over the s-th of SPLITS
           slices of D (fp32 products and sums, as F.linear in fp32) and stores the partial logits PART[s] [N, E];
  phase 2: the last program to finish (a ticket counter, taken after each program's stores) sums the partials in
           split order, then runs triton_topk's top-k (``_topk_rows``: sigmoid, k rounds of argmax of score + bias,
           ties to the lowest expert, NaN first as torch.topk; the unbiased scores, renormalised) row block by row
           block, and scales. It resets the counter for the next launch.

The sums run in a fixed order, so the result is deterministic; it equals the torch route of F.linear's logits up to
fp32 summation order. The counter is one int32 per device, kept at 0 between launches: launches on one stream only
(a decode step), where each finishes before the next starts. Forward only, opt-in until measured on a GPU
(``K3_ROUTER_GEMM=triton``; k3.ops.router.gemm_topk_kernel chooses and logs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.router import MAX_EXPERTS, MAX_LOGITS
from k3.ops.router.triton_topk import _topk_rows

BLOCK_E = 16  # experts per phase-1 program (tl.dot's smallest side)
BLOCK_D = 64  # the reduction's step
TARGET_PROGRAMS = 32  # phase 1 spreads the weight over about this many programs (a guess: not measured yet)
_counters: dict[torch.device, Tensor] = {}


@triton.jit
def _router_gemm_topk_kernel(X, W, BIAS, PART, COUNTER, SCORES, IDX, WEIGHT, N, E, D, stride_x, scaling,
                             D_SPLIT: tl.constexpr, SPLITS: tl.constexpr, K: tl.constexpr,
                             RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_EALL: tl.constexpr, BLOCK_K: tl.constexpr,
                             ROWS: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % SPLITS
    cols = (pid // SPLITS) * BLOCK_E + tl.arange(0, BLOCK_E)
    d0 = split * D_SPLIT
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
        for dd in range(0, D_SPLIT, BLOCK_D):
            ds = d0 + dd + tl.arange(0, BLOCK_D)
            x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + ds[None, :],
                        mask=(rows[:, None] < N) & (ds[None, :] < D), other=0.0).to(tl.float32)  # [BN, BD]
            w = tl.load(W + cols[None, :].to(tl.int64) * D + ds[:, None],
                        mask=(cols[None, :] < E) & (ds[:, None] < D), other=0.0).to(tl.float32)  # [BD, BE]
            acc = tl.dot(x, w, acc, input_precision="ieee")
        tl.store(PART + (split * N + rows[:, None]).to(tl.int64) * E + cols[None, :], acc,
                 mask=(rows[:, None] < N) & (cols[None, :] < E))
    tl.debug_barrier()  # every thread's partials stored before the ticket (released by the atomic below)
    ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:  # the last program: every partial is in memory
        tl.atomic_xchg(COUNTER, 0, sem="relaxed", scope="gpu")
        ecols = tl.arange(0, BLOCK_EALL)
        emask = ecols < E
        bias = tl.load(BIAS + ecols, mask=emask, other=0.0)
        lanes = tl.arange(0, BLOCK_K)
        for r0 in range(0, N, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            live = (rows[:, None] < N) & emask[None, :]  # [ROWS, BLOCK_EALL]
            logit = tl.zeros([ROWS, BLOCK_EALL], dtype=tl.float32)
            for s in range(SPLITS):
                logit += tl.load(PART + (s * N + rows[:, None]).to(tl.int64) * E + ecols[None, :], mask=live,
                                 other=0.0, cache_modifier=".cg")
            sc, idx, w = _topk_rows(logit, live, bias, ecols, lanes, K, RENORMALIZE, BLOCK_EALL)
            tl.store(SCORES + rows[:, None].to(tl.int64) * E + ecols[None, :], sc, mask=live)
            out = rows[:, None].to(tl.int64) * K + lanes[None, :]
            keep = (rows[:, None] < N) & (lanes[None, :] < K)
            tl.store(IDX + out, idx.to(tl.int64), mask=keep)
            tl.store(WEIGHT + out, w * scaling, mask=keep)


def _counter(device: torch.device) -> Tensor:
    """The device's ticket counter (one int32, 0 between launches). Made outside a CUDA-graph capture and kept;
    first asked for inside one, a counter for that call alone (its zeroing is captured with it)."""
    c = _counters.get(device)
    if c is None:
        c = torch.zeros(1, dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _counters[device] = c
    return c


def launch_shape(n: int, e: int, d: int) -> dict:
    """Phase 1's blocks: D cut into SPLITS slices (a multiple of BLOCK_D each) so that the E / BLOCK_E expert blocks
    times SPLITS make about TARGET_PROGRAMS programs; phase 2's row blocks hold at most 4096 logits (a few arrays of
    them live at once: 16 values each per thread of its 8 warps)."""
    blocks = triton.cdiv(e, BLOCK_E)
    steps = triton.cdiv(d, BLOCK_D)
    splits = max(1, min(steps, TARGET_PROGRAMS // blocks))
    d_split = triton.cdiv(steps, splits) * BLOCK_D
    splits = triton.cdiv(d, d_split)  # no empty slice
    block_eall = triton.next_power_of_2(e)
    return dict(D_SPLIT=d_split, SPLITS=splits, BLOCK_N=min(64, max(16, triton.next_power_of_2(n))),
                BLOCK_EALL=block_eall, ROWS=max(1, min(triton.next_power_of_2(n), 4096 // block_eall)),
                programs=blocks * splits)


@torch.library.custom_op("k3::router_gemm_topk", mutates_args=())
def router_gemm_topk(x: Tensor, weight: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """x [N, D], weight [E, D] (each bf16, fp16 or fp32), bias [E] fp32 -> scores [N, E] fp32 = sigmoid(x @ w^T in
    fp32), topk_idx [N, k] int64 (descending score + bias, ties to the lowest index), topk_weight [N, k] fp32: the
    contract of :func:`k3.ops.router.reference.route` on fp32 logits (E <= MAX_EXPERTS, N * E <= MAX_LOGITS). A
    custom op (``torch.ops.k3.router_gemm_topk``): a compiled decode step keeps the launch inside its graph."""
    _check(x, weight, bias, top_k)
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    n, d = x.shape
    e = weight.shape[0]
    scores = torch.empty(n, e, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, top_k, dtype=torch.int64, device=x.device)
    topk_weight = torch.empty(n, top_k, dtype=torch.float32, device=x.device)
    if n:
        shape = launch_shape(n, e, d)
        programs = shape.pop("programs")
        part = torch.empty(shape["SPLITS"], n, e, dtype=torch.float32, device=x.device)
        _router_gemm_topk_kernel[(programs,)](
            x, weight, bias, part, _counter(x.device), scores, idx, topk_weight, n, e, d, x.stride(0), scaling,
            K=top_k, RENORMALIZE=renormalize, BLOCK_E=BLOCK_E, BLOCK_D=BLOCK_D,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=8, **shape)
    return scores, idx, topk_weight


@router_gemm_topk.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
      ) -> tuple[Tensor, Tensor, Tensor]:
    _check(x, weight, bias, top_k)
    n, e = x.shape[0], weight.shape[0]
    return (x.new_empty(n, e, dtype=torch.float32), x.new_empty(n, top_k, dtype=torch.int64),
            x.new_empty(n, top_k, dtype=torch.float32))


def _check(x: Tensor, weight: Tensor, bias: Tensor, top_k: int) -> None:
    e = weight.shape[0] if weight.dim() == 2 else 0
    floats = (torch.bfloat16, torch.float16, torch.float32)
    if (x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.dtype not in floats
            or x.dtype not in floats or bias.dtype != torch.float32
            or tuple(bias.shape) != (e,) or not x.device == weight.device == bias.device or not 1 <= top_k <= e
            or e > MAX_EXPERTS or x.shape[0] * e > MAX_LOGITS):
        raise ValueError(f"router_gemm_topk: x {tuple(x.shape)} {x.dtype} ([N, D] bf16, fp16 or fp32), weight "
                         f"{tuple(weight.shape)} {weight.dtype} ([E, D] bf16, fp16 or fp32, E <= {MAX_EXPERTS}, "
                         f"N * E <= {MAX_LOGITS}), bias {tuple(bias.shape)} {bias.dtype} (fp32 [E]), one device, and "
                         f"top_k={top_k} (1 <= k <= E) do not match")
