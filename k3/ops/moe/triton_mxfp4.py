"""Packed MXFP4 experts in Triton, forward only (docs/architecture.md#mx, docs/architecture.md#latentmoe).

Weight-only MXFP4: the experts' E2M1 codes (two a byte, low nibble = even column) and E8M0 scales (one a 32
columns, 2^(s - 127), 0xFF = NaN) are read straight from the packed bank, only for the experts the batch routes
to, and dequantised in registers; activations are bf16, products accumulate in fp32. At decode an expert's
product is a weight stream, and the stream is 4.25 bits a weight instead of bf16's 16.

The structure is k3.ops.moe.small_groups': token-expert pairs are ordered by expert into groups of rows
(k3.ops.moe.grouped._route, unpadded: no GLU or combine work on padding rows); each program takes one expert and
one block of BLOCK_N output columns,
streams that block of the expert's codes and scales through K and multiplies it with the group's rows BLOCK_M at
a time. Experts without rows cost one program that reads nothing. The up-projection gathers its rows from the
tokens on the fly (through the routing's src_pair); the down-projection reads the
GLU output's rows in place; each token then sums its k weighted rows (grouped.gather_rows_sum).

Decode batches (up to cuda_mxfp4.ROWS_PER_EXPERT rows an expert on average) run k3.ops.moe.cuda_mxfp4 where the
kernel plan chose it: at one or two rows an expert, an MMA with the weights as its register operand spends fewer
instructions a weight than any ``tl.dot`` form (docs/decisions.md). The rest:

The matmul is Triton's own MX primitive, ``tl.dot_scaled`` (bf16 rows x E2M1 codes with E8M0 scales): on Hopper,
which has no MX tensor-core instruction, Triton upcasts the codes to bf16 in registers with its packed conversion,
applies the scales and runs a bf16 MMA; on GPUs with native MX support the same call lowers to it. Against our
own per-element dequantisation (shifts and selects per code, one cache load per byte and per scale) it was 4.4x
faster at K3's expert shapes and B=64 (docs/decisions.md, "Packed MXFP4 experts"); an fp16 upcast of our own did
not beat it, and at decode it is instruction-bound, not memory-bound (docs/decisions.md, "Where the packed matmul's
time goes on Hopper"). The loads are the packed bytes [BLOCK_K / 2, BLOCK_N] (contiguous along K) and the scales
[BLOCK_N, BLOCK_K / 32], as ``tl.dot_scaled`` takes them.

Numerics as the reference (k3.ops.moe.mxfp4.moe_experts_reference on bf16) within bf16 rounding: each weight is
code x scale (exact in bf16 but for E8M0 0, 2^-127, which Triton may take as 0), fp32 accumulation, each matmul's
output rounded to bf16, the GLU applied to those, the combine summed in fp32; a NaN scale gives NaN products.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops import backend
from k3.ops.moe import cuda_mxfp4, grouped
from k3.ops.moe.small_groups import block_m
from k3.ops.pdl import launch, wait_then_release

GROUP = 32
ROUTE_ALIGN = 1  # the routing's groups are unpadded: the kernel reads any row count
_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_stages=3, num_warps=4) for n in (64, 128, 256) for k in (64, 128)
] + [triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_stages=3, num_warps=8)]  # prefill's best on an H200


@triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M", "GATHER", "rows_bucket"])
@triton.jit
def _mxfp4_groups_kernel(
    X,
    SRC,
    P,
    S,
    OFFS,
    Y,
    stride_xr,
    stride_pe,
    stride_pn,
    stride_se,
    stride_sn,
    stride_yr,
    pairs_per_token,
    rows_bucket,
    N: tl.constexpr,
    K: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[r] = W_e x[r] for the rows r of group e, W_e = e2m1(P[e]) * e8m0(S[e]) [N, K]. GATHER: x[r] is the token
    row X[SRC[r] // pairs_per_token] (zeros where SRC[r] = -1), else X[r]. rows_bucket is read only by the
    autotuner (its key)."""
    wait_then_release(PDL)
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.load(OFFS + e)
    start = tl.where(e > 0, tl.load(OFFS + tl.maximum(e - 1, 0)), 0)
    p_base = P + e.to(tl.int64) * stride_pe + cols[None, :].to(tl.int64) * stride_pn  # [1, BLOCK_N]: P[e, col, :]
    s_base = S + e.to(tl.int64) * stride_se + cols[None, :].to(tl.int64) * stride_sn  # [1, BLOCK_N]: S[e, col, :]
    m0 = start
    while m0 < end:  # (a while loop over loaded bounds, as in small_groups)
        rows = m0 + tl.arange(0, BLOCK_M)
        if GATHER:
            src = tl.load(SRC + rows, mask=rows < end, other=-1)
            x_rows = tl.maximum(src, 0) // pairs_per_token
            x_ok = src >= 0
        else:
            x_rows = rows
            x_ok = rows < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                X + x_rows[:, None].to(tl.int64) * stride_xr + ks[None, :],
                mask=x_ok[:, None] & (ks[None, :] < K),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            k2 = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            codes = tl.load(
                p_base + k2[:, None], mask=(k2[:, None] < K // 2) & (cols[None, :] < N), other=0
            )  # [BLOCK_K / 2, BLOCK_N]: two E2M1 codes a byte along K, the first in the low bits
            scale = tl.load(
                tl.trans(s_base) + g[None, :], mask=(cols[:, None] < N) & (g[None, :] < K // 32), other=127
            )  # [BLOCK_N, BLOCK_K / 32]
            acc = tl.dot_scaled(x, None, "bf16", codes, scale, "e2m1", acc)
        tl.store(
            Y + rows[:, None].to(tl.int64) * stride_yr + cols[None, :],
            acc.to(Y.dtype.element_ty),
            mask=(rows[:, None] < end) & (cols[None, :] < N),
        )
        m0 += BLOCK_M


def _check(
    x: Tensor, src_pair: Optional[Tensor], pairs_per_token: int, packed: Tensor, scale: Tensor, offs: Tensor
) -> None:
    e, n, half = packed.shape if packed.dim() == 3 else (0, 0, 0)
    if (
        x.dim() != 2
        or x.dtype != torch.bfloat16
        or packed.dtype != torch.uint8
        or scale.dtype != torch.uint8
        or packed.dim() != 3
        or x.shape[1] != 2 * half
        or (2 * half) % GROUP
        or tuple(scale.shape) != (e, n, 2 * half // GROUP)
        or tuple(offs.shape) != (e,)
        or pairs_per_token < 1
        or (src_pair is not None and (src_pair.dim() != 1 or src_pair.dtype != torch.int64))
    ):
        raise ValueError(
            f"mxfp4_groups_mm: x {tuple(x.shape)} {x.dtype} (bf16), packed {tuple(packed.shape)} "
            f"{packed.dtype}, scale {tuple(scale.shape)} {scale.dtype} (uint8 [E, N, K / 2] and "
            f"[E, N, K / {GROUP}]), offs {tuple(offs.shape)}, src_pair "
            f"{None if src_pair is None else (tuple(src_pair.shape), src_pair.dtype)} and "
            f"pairs_per_token={pairs_per_token} do not match"
        )


@torch.library.custom_op("k3::mxfp4_groups_mm", mutates_args=())
def mxfp4_groups_mm(
    x: Tensor,
    src_pair: Optional[Tensor],
    pairs_per_token: int,
    packed: Tensor,
    scale: Tensor,
    offs: Tensor,
    groups_max: Optional[int] = None,
) -> Tensor:
    """Grouped matmul with packed MXFP4 weights: packed uint8 [E, N, K / 2], scale uint8 [E, N, K / 32], offs [E]
    int32 group ends. With src_pair [R] int64: x [T, K] are the tokens and row r of the result reads token
    src_pair[r] // pairs_per_token (zeros for -1), R = len(src_pair); without: x [R, K] are the rows. Returns
    y [R, N] in x.dtype, y[r] = W_e x_r for the rows of group e (fp32 accumulation; rows after offs[-1] are not
    written). A custom op (``torch.ops.k3.mxfp4_groups_mm``), so a compiled decode step keeps it in its graph.
    Up to cuda_mxfp4.ROWS_PER_EXPERT rows an expert on average it runs k3.ops.moe.cuda_mxfp4's kernel where the
    kernel plan chose it (``moe_mxfp4_rows``; ``groups_max``: at most this many experts have rows), else this
    module's."""
    _check(x, src_pair, pairs_per_token, packed, scale, offs)
    rows = src_pair.shape[0] if src_pair is not None else x.shape[0]
    if rows <= cuda_mxfp4.ROWS_PER_EXPERT * packed.shape[0] and backend.kernel_choice("moe_mxfp4_rows") == "cuda":
        return cuda_mxfp4.mxfp4_rows_mm(x, src_pair, pairs_per_token, packed, scale, offs, groups_max)
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous()
    gather = src_pair is not None
    src = src_pair.contiguous() if gather else offs  # an unread placeholder without gathering
    e, n, _ = packed.shape
    y = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    grid = lambda m: (e, triton.cdiv(n, m["BLOCK_N"]))  # noqa: E731
    _mxfp4_groups_kernel[grid](
        x,
        src,
        packed,
        scale,
        offs.to(torch.int32),
        y,
        x.stride(0),
        packed.stride(0),
        packed.stride(1),
        scale.stride(0),
        scale.stride(1),
        y.stride(0),
        pairs_per_token,
        triton.next_power_of_2(rows),  # tuned per batch size: B=1 and B=64 share BLOCK_M but not the best tile
        N=n,
        K=x.shape[1],
        GATHER=gather,
        BLOCK_M=block_m(rows, e, ROUTE_ALIGN),
        **launch(x.device),
    )
    return y


@mxfp4_groups_mm.register_fake
def _(
    x: Tensor,
    src_pair: Optional[Tensor],
    pairs_per_token: int,
    packed: Tensor,
    scale: Tensor,
    offs: Tensor,
    groups_max: Optional[int] = None,
) -> Tensor:
    _check(x, src_pair, pairs_per_token, packed, scale, offs)
    return x.new_empty(src_pair.shape[0] if src_pair is not None else x.shape[0], packed.shape[1])


def moe_mxfp4(
    x: Tensor, topk_idx: Tensor, topk_weight: Tensor, bank: tuple[Tensor, ...], glu: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """The routed experts on packed MXFP4 weights, no gradient: x [N, D], topk_idx [N, k] int64, topk_weight [N, k],
    bank (w1_packed, w1_scale, w2_packed, w2_scale, w3_packed, w3_scale) with w1 / w3 [E, I, D / 2] and
    [E, I, D / 32], w2 [E, D, I / 2] and [E, D, I / 32] -> [N, D] in x.dtype. Three launches (w1, w3, w2) and
    the combine; no host synchronisation."""
    w1p, w1s, w2p, w2s, w3p, w3s = bank
    k = topk_idx.shape[1]
    route = grouped._route(topk_idx, w1p.shape[0], ROUTE_ALIGN)
    xb = x.to(torch.bfloat16)
    hit = min(w1p.shape[0], topk_idx.numel())  # experts with rows, at most
    gate = mxfp4_groups_mm(xb, route.src_pair, k, w1p, w1s, route.offs, hit)  # [R, I]
    up = mxfp4_groups_mm(xb, route.src_pair, k, w3p, w3s, route.offs, hit)
    h = glu(gate, up).to(torch.bfloat16)
    y = mxfp4_groups_mm(h, None, 1, w2p, w2s, route.offs, hit)  # [R, D]
    return grouped.gather_rows_sum(y, route.pair_rows, topk_weight, x.dtype)
