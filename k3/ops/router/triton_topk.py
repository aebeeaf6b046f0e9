"""The MoE router after its GEMM in one Triton kernel: sigmoid, biased top-k, gather, renormalise, scale.

At decode the torch form (k3.ops.router.reference) is several small kernels per MoE layer even compiled: torch.topk's
gatherTopK between two fused kernels (the sigmoid with the bias add, the gather with the renormalisation), in a step
bound by its kernel count (docs/decisions.md, "Decode's small torch compositions in one launch each"). Here one program
takes one token row: it loads the row's E logits (BLOCK_E = next power of two >= E lanes, the rest masked), stores their
sigmoid, and picks the k largest keys score + bias by k rounds of argmax over the row (ties: the lowest expert index),
keeping each pick's expert and unbiased score in the lanes of two BLOCK_K vectors; it then renormalises and scales them.
The k picks come out in descending order of the key (the reference's order is unspecified: every consumer, k3.ops.moe
and k3.distributed.expert_parallel, treats a token's k choices as a set).

Forward only, for no-grad calls (decode): k3.ops.router.route picks it and logs which path runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.router import MAX_EXPERTS
from k3.ops.pdl import launch, wait_then_release


@triton.jit
def _router_topk_kernel(
    LOGITS,
    BIAS,
    SCORES,
    IDX,
    WEIGHT,
    E,
    scaling,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    avail = cols < E  # the experts not yet picked
    s = tl.sigmoid(tl.load(LOGITS + row * E + cols, mask=avail, other=0.0))  # [BLOCK_E] fp32
    tl.store(SCORES + row * E + cols, s, mask=avail)
    key = s + tl.load(BIAS + cols, mask=avail, other=0.0)
    key = tl.where(key != key, float("inf"), key)  # NaN ranks first, as in torch.topk (and keeps picks in range)
    lanes = tl.arange(0, BLOCK_K)
    idx = tl.zeros([BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in range(K):
        best = tl.max(tl.where(avail, key, float("-inf")), axis=0)
        pick = tl.min(tl.where(avail & (key == best), cols, BLOCK_E), axis=0)  # ties: the lowest index
        idx = tl.where(lanes == j, pick, idx)
        w = tl.where(lanes == j, tl.sum(tl.where(cols == pick, s, 0.0), axis=0), w)  # its unbiased score, exactly
        avail = avail & (cols != pick)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)  # lanes >= K hold 0
    out = row * K + lanes
    tl.store(IDX + out, idx.to(tl.int64), mask=lanes < K)
    tl.store(WEIGHT + out, w * scaling, mask=lanes < K)


@torch.library.custom_op("k3::router_topk", mutates_args=())
def router_topk(
    logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
) -> tuple[Tensor, Tensor, Tensor]:
    """logits [N, E] fp32, bias [E] fp32 -> scores [N, E] fp32, topk_idx [N, k] int64 (in descending order of
    score + bias, ties to the lowest index), topk_weight [N, k] fp32: the contract of
    :func:`k3.ops.router.reference.route` (E <= MAX_EXPERTS). A custom op (``torch.ops.k3.router_topk``): a
    compiled decode step keeps the launch inside its graph."""
    _check(logits, bias, top_k)
    logits, bias = logits.contiguous(), bias.contiguous()
    n, e = logits.shape
    scores = torch.empty_like(logits)
    idx = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    weight = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    if n:
        block_e = triton.next_power_of_2(e)
        _router_topk_kernel[(n,)](
            logits,
            bias,
            scores,
            idx,
            weight,
            e,
            scaling,
            K=top_k,
            RENORMALIZE=renormalize,
            BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=min(8, max(1, block_e // 256)),
            **launch(logits.device),
        )
    return scores, idx, weight


@router_topk.register_fake
def _(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    _check(logits, bias, top_k)
    n, e = logits.shape
    return logits.new_empty(n, e), logits.new_empty(n, top_k, dtype=torch.int64), logits.new_empty(n, top_k)


def _check(logits: Tensor, bias: Tensor, top_k: int) -> None:
    e = logits.shape[-1] if logits.dim() else 0
    if (
        logits.dim() != 2
        or logits.dtype != torch.float32
        or bias.dtype != torch.float32
        or tuple(bias.shape) != (e,)
        or bias.device != logits.device
        or not 1 <= top_k <= e
        or e > MAX_EXPERTS
    ):
        raise ValueError(
            f"router_topk: logits {tuple(logits.shape)} {logits.dtype} (fp32 [N, E], E <= "
            f"{MAX_EXPERTS}), bias {tuple(bias.shape)} {bias.dtype} (fp32 [E], same device) and "
            f"top_k={top_k} (1 <= k <= E) do not match"
        )
