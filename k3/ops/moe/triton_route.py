"""The expert-sorted routing of k3.ops.moe.grouped (``_route``) in one Triton program, for decode-sized batches.

At decode the torch form is several small kernels per MoE layer even when compiled (the expert counts by a scatter-add,
the padded cumulative ends, the [P, P] compare-and-sum of the ranks, the -1 fill and scatter of the buffer's pair
index), in a step bound by its kernel count (docs/decisions.md, "Decode's small torch compositions in one launch each").
Here one program holds all P = N*k pairs (P <= COUNT_PAIRS) in one block:

  counts   = histogram of the pairs' experts              (tl.histogram, masked to the live pairs)
  pad_end  = cumsum(counts rounded up to ALIGN)            (the offsets grouped_mm and small_groups_mm read)
  order    = sort of the keys expert * BLOCK_P + pair      (stable by pair within an expert; dead lanes last)
  the pair at sorted position s, of expert e, goes to row pad_end[e] - padded[e] + s - first[e], where first[e]
  is the sorted position of expert e's first pair (the exclusive cumsum of the counts)

then fills the buffer's pair index with -1 and, after a barrier, writes each pair's index at its row. The result equals
the torch form's exactly (both are the unique stable order). The default for at most COUNT_PAIRS pairs on a GPU
(``K3_KERNELS=moe_route=torch`` turns it off) because it was faster in the decode step (docs/decisions.md, "A kernel
written without a GPU is opt-in until one has run it; then, if faster, the default"). grouped.route_kernel chooses and
logs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.moe.layout import ALIGN, COUNT_PAIRS, ROUTE_MAX_EXPERTS as MAX_EXPERTS
from k3.ops.pdl import launch, wait_then_release


@triton.jit
def _route_kernel(
    IDX,
    PAIR_ROWS,
    SRC_PAIR,
    OFFS,
    P,
    E,
    R,
    ALIGN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    lanes = tl.arange(0, BLOCK_P)
    live = lanes < P
    expert = tl.load(IDX + lanes, mask=live, other=0).to(tl.int32)  # [BLOCK_P]
    counts = tl.histogram(expert, BLOCK_E, mask=live)  # [BLOCK_E] int32
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    pad_end = tl.cumsum(padded, 0)
    experts = tl.arange(0, BLOCK_E)
    tl.store(OFFS + experts, pad_end, mask=experts < E)
    start = pad_end - padded  # each expert's first row
    first = tl.cumsum(counts, 0) - counts  # each expert's first sorted position
    key = tl.sort(tl.where(live, expert * BLOCK_P + lanes, BLOCK_E * BLOCK_P))  # by expert, then by pair
    e_sorted = tl.minimum(key // BLOCK_P, BLOCK_E - 1)  # dead lanes (sorted last, masked below) clamped in range
    pair = key % BLOCK_P
    row = tl.gather(start, e_sorted, 0) + lanes - tl.gather(first, e_sorted, 0)  # lanes = sorted positions
    tl.store(PAIR_ROWS + pair, row.to(tl.int64), mask=live)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        tl.store(SRC_PAIR + rows, tl.full([BLOCK_R], -1, tl.int64), mask=rows < R)
    tl.debug_barrier()  # the -1 fill lands before the pairs' rows are written (one program: one thread block)
    tl.store(SRC_PAIR + row, pair.to(tl.int64), mask=live)


@torch.library.custom_op("k3::moe_route", mutates_args=())
def moe_route(topk_idx: Tensor, num_experts: int, align: int = ALIGN) -> tuple[Tensor, Tensor, Tensor]:
    """topk_idx [N, k] int64 (experts in [0, num_experts); others are undefined behaviour, as for the torch form's
    indexing) -> pair_rows [N, k] int64, src_pair [N*k + align*E] int64, offs [E] int32: exactly
    ``k3.ops.moe.grouped._route``'s fields (N*k <= COUNT_PAIRS, E <= MAX_EXPERTS). A custom op
    (``torch.ops.k3.moe_route``): a compiled decode step keeps the launch inside its graph."""
    _check(topk_idx, num_experts)
    n, k = topk_idx.shape
    p = n * k
    pair_rows = torch.empty(n, k, dtype=torch.int64, device=topk_idx.device)
    src_pair = torch.empty(p + align * num_experts, dtype=torch.int64, device=topk_idx.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=topk_idx.device)
    block_p = triton.next_power_of_2(max(p, 1))
    _route_kernel[(1,)](
        topk_idx.contiguous(),
        pair_rows,
        src_pair,
        offs,
        p,
        num_experts,
        src_pair.numel(),
        ALIGN=align,
        BLOCK_P=block_p,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_R=1024,
        num_warps=8 if block_p > 512 else 4,
        **launch(topk_idx.device),
    )
    return pair_rows, src_pair, offs


@moe_route.register_fake
def _(topk_idx: Tensor, num_experts: int, align: int = ALIGN) -> tuple[Tensor, Tensor, Tensor]:
    _check(topk_idx, num_experts)
    n, k = topk_idx.shape
    return (
        topk_idx.new_empty(n, k),
        topk_idx.new_empty(n * k + align * num_experts),
        topk_idx.new_empty(num_experts, dtype=torch.int32),
    )


def _check(topk_idx: Tensor, num_experts: int) -> None:
    if (
        topk_idx.dim() != 2
        or topk_idx.dtype != torch.int64
        or topk_idx.numel() > COUNT_PAIRS
        or not 1 <= num_experts <= MAX_EXPERTS
    ):
        raise ValueError(
            f"moe_route: topk_idx {tuple(topk_idx.shape)} {topk_idx.dtype} (int64 [N, k], N*k <= "
            f"{COUNT_PAIRS}) and num_experts={num_experts} (1..{MAX_EXPERTS}) do not match"
        )
