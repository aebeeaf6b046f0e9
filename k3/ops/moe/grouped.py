"""Routed experts on the GPU with ``torch._grouped_mm`` (bf16, Hopper), no host synchronisation.

Token-expert pairs are sorted by expert; each expert's group of rows is padded to a multiple of 8 (grouped_mm
needs 16-byte-aligned groups; misaligned ones give silently wrong results), all with tensor ops of static
shape: the padded buffer has N*k + 8E rows whatever the routing. The tokens' rows are gathered into it, three
grouped GEMMs run (w1, w3, then w2 after the GLU), and each token sums its k weighted output rows; the backward
is gathers too (no scatter-add: no atomics, deterministic). Expert weights are used in bf16 (as under autocast).
grouped_mm also needs the model and expert widths to be multiples of 8 (16-byte strides); other widths (e.g. the
matched plain experts of an ablation, I' = 85) are zero-padded: the padded GLU columns are act(0) * 0 = 0 and the
padded output columns are cut off, so the result is the unpadded one.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops import backend
from k3.ops.fused import fused
from k3.ops.fp8 import ALIGN as FP8_ALIGN, grouped_mm_fp8
from k3.ops.moe.layout import ALIGN, COUNT_PAIRS, GLU_ACTS, ROUTE_MAX_EXPERTS


def available(device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] >= 9


def _pad(t: Tensor, pad: tuple[int, ...]) -> Tensor:
    """F.pad, but t itself when nothing is padded: F.pad copies even then, which at decode was a copy of every
    expert's weights per layer and step (docs/decisions.md, "Grouped experts copy no weights for a zero pad")."""
    return F.pad(t, pad) if any(pad) else t


class _Routing(NamedTuple):
    """Where each token-expert pair's row is in the padded, expert-sorted buffer, and back."""

    pair_rows: Tensor  # [N, k] int64: the buffer row of pair (token n, choice j)
    src_pair: Tensor  # [R] int64: the pair n*k + j a buffer row holds, -1 for padding rows
    offs: Tensor  # [E] int32: each expert's end row (grouped_mm's offsets)


def _route(topk_idx: Tensor, num_experts: int, align: int = ALIGN) -> _Routing:
    """Order the N*k pairs by expert (stably: by pair index within an expert) and give each expert a group of rows
    padded to a multiple of ``align``, in a buffer of R = N*k + align*E rows whatever the routing (static shapes,
    no host sync; grouped_mm needs ALIGN, the packed-experts kernel takes 1). A pair's rank within its expert is
    the number of earlier pairs with the same expert: up to COUNT_PAIRS pairs it is counted directly (one fused
    [P, P] compare-and-sum, where a sort of a few hundred keys is a slow kernel per layer at decode:
    benchmarks/results/decode-quick-grouped_mm.md); above, read
    off a stable argsort. Both give the same routing, as does the Triton program (:func:`route_kernel`)."""
    if route_kernel(topk_idx, num_experts) == "triton":
        from k3.ops.moe.triton_route import moe_route  # Triton: imported on use (GPUs only)

        return _Routing(*moe_route(topk_idx, num_experts, align))
    n, k = topk_idx.shape
    p, dev = n * k, topk_idx.device
    flat = topk_idx.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + align - 1) // align * align
    pad_end = padded.cumsum(0)
    pair = torch.arange(p, device=dev)
    if p <= COUNT_PAIRS:
        earlier = (flat.unsqueeze(0) == flat.unsqueeze(1)) & (pair.unsqueeze(0) < pair.unsqueeze(1))  # [i, j<i]
        dest = (pad_end - padded)[flat] + earlier.sum(1)  # the row of pair i
    else:
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        rank = pair - (counts.cumsum(0) - counts)[sorted_e]
        dest = torch.empty_like(pair).scatter_(0, order, (pad_end - padded)[sorted_e] + rank)
    src_pair = torch.full((p + align * num_experts,), -1, dtype=torch.int64, device=dev).scatter_(0, dest, pair)
    return _Routing(dest.view(n, k), src_pair, pad_end.to(torch.int32))


_route_logged: set[str] = set()


def kernel_device(device: torch.device) -> bool:
    """Where a Triton kernel of this module runs: CUDA tensors, or any under Triton's CPU interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def route_kernel(topk_idx: Tensor, num_experts: int) -> str:
    """What :func:`_route` runs: 'triton' (k3.ops.moe.triton_route, one program) where the kernel plan chose
    moe_route, the pairs are on a GPU and there are at most COUNT_PAIRS of them and ROUTE_MAX_EXPERTS experts,
    else 'torch' (:func:`k3.ops.backend.triton_or_torch`: logged once each, with the reason)."""

    def why_not() -> str:
        if not kernel_device(topk_idx.device):
            return "the routing is not on a GPU"
        if topk_idx.numel() > COUNT_PAIRS:
            return f"more than {COUNT_PAIRS} token-expert pairs"
        if num_experts > ROUTE_MAX_EXPERTS:
            return f"more than the kernel's {ROUTE_MAX_EXPERTS} experts"
        return ""

    return backend.triton_or_torch(
        "moe_route",
        "moe_experts: routing by",
        why_not,
        ("one Triton program (k3.ops.moe.triton_route)", "torch"),
        _route_logged,
    )


# Moving rows between tokens and the buffer. Every direction is a gather (no atomics, no sort, deterministic):
# out[n] = sum_j w[n, j] y[pair_rows[n, j]] reads the k rows of each token (compiled: one kernel, the gathered
# rows never stored), and the buffer's rows read their token through src_pair.


@fused
def gather_rows_sum(y: Tensor, rows: Tensor, weight: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """y [R, D], rows [N, k], weight [N, k] or None (ones) -> sum_j weight[n, j] y[rows[n, j]], [N, D], summed in
    promote(y.dtype, fp32) in the order j = 0..k-1 and returned in ``dtype`` (default: that). Written as k
    gathered terms rather than a sum over a gathered [N, k, D]: compiled, it is one element-wise kernel with k
    loads per output (each coalesced along D), where the reduction over k ran far below the bandwidth
    (docs/decisions.md, "Training-step GPU paths: MoE rows move by gathers only")."""
    acc = torch.promote_types(y.dtype, torch.float32)
    out = None
    for j in range(rows.shape[1]):
        term = y[rows[:, j]].to(acc)
        if weight is not None:
            term = term * weight[:, j].to(acc).unsqueeze(-1)
        out = term if out is None else out + term
    return out if dtype is None else out.to(dtype)


@fused
def spread_rows(g: Tensor, weight: Tensor, src_pair: Tensor, k: int, dtype: torch.dtype) -> Tensor:
    """The transpose of :func:`gather_rows_sum`: g [N, D], weight [N, k], src_pair [R] -> [R, D] in ``dtype``,
    row r = weight of its pair * g[its token] (in promote(g.dtype, fp32)), 0 for padding rows."""
    acc = torch.promote_types(g.dtype, torch.float32)
    p = src_pair.clamp(min=0)
    rows = g[p // k].to(acc) * weight.reshape(-1)[p].to(acc).unsqueeze(-1)
    return torch.where((src_pair >= 0).unsqueeze(-1), rows, 0.0).to(dtype)  # select: inf * 0 would be NaN


@fused
def gather_rows_dot(y: Tensor, rows: Tensor, g: Tensor) -> Tensor:
    """y [R, D], rows [N, k], g [N, D] -> <y[rows[n, j]], g[n]>, [N, k] in promote(y.dtype, fp32) (the combine
    weights' gradient)."""
    acc = torch.promote_types(y.dtype, torch.float32)
    return (y[rows].to(acc) * g.to(acc).unsqueeze(1)).sum(-1)


class _Dispatch(torch.autograd.Function):
    """x [N, D] -> the buffer [R, D]: row r holds x of its pair's token; padding rows hold token 0 and their
    gradient is dropped (moe_experts never reads their outputs, so it is 0 there)."""

    @staticmethod
    def forward(ctx, x: Tensor, route: _Routing) -> Tensor:
        ctx.rows = route.pair_rows
        return x.index_select(0, route.src_pair.clamp(min=0) // route.pair_rows.shape[1])

    @staticmethod
    def backward(ctx, g: Tensor):
        return gather_rows_sum(g, ctx.rows, None, g.dtype), None


class _Combine(torch.autograd.Function):
    """The buffer's outputs y [R, D] and the routing weights [N, k] -> sum_j w[n, j] y[pair_rows[n, j]], [N, D]
    summed in promote(y.dtype, fp32) and returned in ``dtype``."""

    @staticmethod
    def forward(ctx, y: Tensor, weight: Tensor, route: _Routing, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(y, weight)
        ctx.route = route
        return gather_rows_sum(y, route.pair_rows, weight, dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        y, weight = ctx.saved_tensors
        route = ctx.route
        k = route.pair_rows.shape[1]
        dy = spread_rows(g, weight, route.src_pair, k, y.dtype) if ctx.needs_input_grad[0] else None
        dw = gather_rows_dot(y, route.pair_rows, g).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dy, dw, None, None


_logged: set[str] = set()


def _experts_matmul(n_pairs: int, needs_grad: bool) -> str:
    """Which matmul runs the experts: 'triton' (k3.ops.moe.small_groups, forward only) where the kernel plan chose
    kernel moe_small_groups, no gradient is needed and there are at most COUNT_PAIRS pairs (decode); else
    'grouped_mm'. The kernel is the default where Triton is usable (faster than grouped_mm at every decode shape
    measured, benchmarks/results/moe_decode_mm.md). Logged once each."""
    choice, why = backend.kernel_choices()["moe_small_groups"]
    kernel = choice if not needs_grad and n_pairs <= COUNT_PAIRS else "grouped_mm"
    why = f" ({why})" if choice == "grouped_mm" and not needs_grad else ""
    if kernel + why not in _logged:
        _logged.add(kernel + why)
        backend.log.info(
            "moe_experts: expert matmuls by %s%s",
            "Triton small-groups kernel (k3.ops.moe.small_groups)" if kernel == "triton" else "torch._grouped_mm",
            why,
        )
    return kernel


_glu_logged: set[str] = set()


def up_glu_kernel(glu: Callable[[Tensor, Tensor], Tensor], device: torch.device) -> str:
    """Where the small-groups kernel runs the expert matmuls: 'triton' (one launch of
    k3.ops.moe.small_groups.small_groups_glu for the rows' gather, w1, w3 and the GLU) where the kernel plan
    chose moe_up_glu, the experts are on a GPU (or in Triton's interpreter) and ``glu`` names its form (a
    k3.model.activation.GLU), else 'torch' (they run apart). Chosen and logged by
    :func:`k3.ops.backend.triton_or_torch`."""

    def why_not() -> str:
        if not kernel_device(device):
            return "the experts are not on a GPU"
        if getattr(glu, "kind", None) not in GLU_ACTS:
            return "the GLU is not a named form (k3.model.activation.GLU), e.g. QAT's quantised one"
        return ""

    return backend.triton_or_torch(
        "moe_up_glu",
        "moe_experts: up-projection and GLU by",
        why_not,
        (
            "one Triton launch (k3.ops.moe.small_groups.small_groups_glu)",
            "the row gather, two matmuls and the GLU apart",
        ),
        _glu_logged,
    )


def _matmul(kernel: str, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """x [R, K] bf16, w [E, N, K] bf16 -> [R, N]: each group of rows times its expert's w^T, by ``kernel``
    ('triton', 'fp8' or 'grouped_mm')."""
    if kernel == "triton":
        from k3.ops.moe.small_groups import small_groups_mm  # Triton: imported on use (GPUs only)

        return small_groups_mm(x, w, offs)
    if kernel == "fp8":
        return grouped_mm_fp8(x, w, offs)
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


def moe_experts(
    x: Tensor,
    topk_idx: Tensor,
    topk_weight: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    glu: Callable[[Tensor, Tensor], Tensor],
    fp8: bool = False,
) -> Tensor:
    """Same contract as :func:`k3.ops.moe.reference.moe_experts`. Under QAT the weights, inputs and GLU output
    arrive fake-quantised (k3.ops.moe.moe_experts composes them), so this is the emulated MX path:
    dequantised values through bf16 grouped GEMMs, with no host synchronisation. ``fp8``: the three matmuls by
    torchao's FP8 grouped GEMM (k3.ops.fp8), groups and widths padded to its multiple of 16."""
    n, d = x.shape
    if n == 0:  # no token: nothing to route (the dispatch would read token 0)
        return x.new_zeros(0, w2.shape[1])  # as the loop
    align = FP8_ALIGN if fp8 else ALIGN
    route = _route(topk_idx, w1.shape[0], align)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weight, w1, w2, w3))
    kernel = "fp8" if fp8 else _experts_matmul(topk_idx.numel(), needs_grad)
    bf = torch.bfloat16
    pd, pi = -d % align, -w1.shape[1] % align
    w1b, w3b = (_pad(w.to(bf), (0, pd, 0, pi)) for w in (w1, w3))  # [E, I+pi, D+pd]
    w2b = _pad(w2.to(bf), (0, pi, 0, pd))  # [E, D+pd, I+pi]
    xb = _pad(x.to(bf), (0, pd))  # [N, D+pd]
    if kernel == "triton" and up_glu_kernel(glu, x.device) == "triton":  # gather, w1, w3 and the GLU in one launch
        from k3.ops.moe.small_groups import small_groups_glu  # Triton: imported on use (GPUs only)

        h = small_groups_glu(
            xb, route.src_pair, topk_idx.shape[1], w1b, w3b, route.offs, glu.kind, glu.beta, glu.linear_beta
        )
    else:
        xs = _Dispatch.apply(xb, route)  # [R, D+pd]
        h = glu(_matmul(kernel, xs, w1b, route.offs), _matmul(kernel, xs, w3b, route.offs))
    y = _matmul(kernel, h.to(bf), w2b, route.offs)  # [R, D+pd]
    return _Combine.apply(y, topk_weight, route, x.dtype)[:, :d]
