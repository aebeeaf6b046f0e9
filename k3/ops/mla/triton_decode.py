"""Absorbed-MLA decode on the GPU: split-K flash decoding straight over the latent cache (Triton).

One query token per sequence, q [B, H, r + dr]; the cache rows kv[slot, :L] = [c_kv (r), k_pe (dr)] are both
keys (all r + dr columns) and values (the first r). Each program takes one sequence, one split of its rows and
a group of BLOCK_H heads, reads every row of its split once for all those heads, and keeps an online softmax;
a second kernel merges the splits by their log-sum-exp (one program per sequence, head and block of columns).
Bytes moved ~ sum_b L_b (r + dr) * 2 per head group, which is the bandwidth floor of a latent-cache decode when
BLOCK_H covers all heads.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.pdl import launch, wait_then_release


@triton.jit
def _mla_decode_kernel(
    Q,
    KV,
    SLOT,
    LEN,
    O,
    LSE,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kvs,
    stride_kvt,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_ls,
    H,
    SPLIT_ROWS,
    R: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    b = tl.program_id(0)
    split = tl.program_id(1)
    hg = tl.program_id(2)
    slot = tl.load(SLOT + b).to(tl.int64)
    length = tl.load(LEN + b)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, DR)
    q_base = Q + b * stride_qb + heads[:, None] * stride_qh
    qc = tl.load(q_base + offs_r[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, R]
    qp = tl.load(q_base + R + offs_p[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, DR]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    start = split * SPLIT_ROWS
    end = tl.minimum(start + SPLIT_ROWS, length)
    kv_base = KV + slot * stride_kvs
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        rows = kv_base + offs_n[:, None] * stride_kvt
        kc = tl.load(rows + offs_r[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, R]
        kp = tl.load(rows + R + offs_p[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, DR]
        s = tl.dot(qc, tl.trans(kc)) + tl.dot(qp, tl.trans(kp))  # [BLOCK_H, BLOCK_N] fp32
        s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc)
        m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    o_ptr = O + b * stride_ob + split * stride_os + heads[:, None] * stride_oh + offs_r[None, :]
    tl.store(o_ptr, out, mask=hmask[:, None])
    lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
    tl.store(LSE + b * stride_lb + split * stride_ls + heads, lse, mask=hmask)


def supported(r: int, dr: int) -> bool:
    """Whether the kernel takes latent width r and rope width dr (powers of two, dr >= 16)."""
    return r > 0 and dr >= 16 and not r & (r - 1) and not dr & (dr - 1)


@triton.jit
def _mla_combine_kernel(
    O,
    LSE,
    Y,
    S,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_ls,
    stride_yb,
    stride_yh,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[b, h, cols] = sum_s w_s o[b, s, h, cols] / sum_s w_s, w_s = 2^(lse[b, s, h] - max_s lse): the softmax
    over all rows, put together from the splits' (all -inf: an empty sequence, 0). One pass over the splits,
    BLOCK_S at a time, each block's log-sum-exps and outputs loaded together, the running sums rescaled to the
    running maximum (online softmax): at most 32 splits are one round of loads."""
    wait_then_release(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    lse_base = LSE + b * stride_lb + h
    m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)  # fp32 scalars, carried by the loop
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_base + ss * stride_ls, mask=ss < S, other=float("-inf"))  # [BLOCK_S]
        o = tl.load(
            O + b * stride_ob + ss[:, None] * stride_os + h * stride_oh + cols[None, :],
            mask=(ss < S)[:, None],
            other=0.0,
        )  # [BLOCK_S, BLOCK_R]
        m_new = tl.maximum(m, tl.max(lse, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no row yet: every weight is 0
        alpha = tl.exp2(m - ref)
        w = tl.exp2(lse - ref)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    y = acc / tl.where(den > 0, den, 1.0)
    tl.store(Y + b * stride_yb + h * stride_yh + cols, y.to(Y.dtype.element_ty))


@torch.library.custom_op("k3::mla_decode", mutates_args=())
def _launch(
    q: Tensor,
    kv: Tensor,
    slots: Tensor,
    lengths: Tensor,
    scale: float,
    splits: int,
    split_rows: int,
    groups: int,
    R: int,
    DR: int,
    block_h: int,
    block_n: int,
    num_stages: int,
    num_warps: int,
) -> Tensor:
    """Run the two kernels: the splits' outputs o [B, splits, H, R] and log2-sum-exps lse [B, splits, H] (fp32),
    then their merge -> [B, H, R] in q.dtype. A custom op: a compiled decode step keeps it inside its graph. The
    merge is Triton because inductor compiled the torch epilogue into a slow reduction per layer (docs/decisions.md,
    "MLA decode's split merge in Triton")."""
    B, H = q.shape[:2]
    pdl = launch(q.device)
    o = torch.empty(B, splits, H, R, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, splits, H, device=q.device, dtype=torch.float32)
    _mla_decode_kernel[(B, splits, groups)](
        q,
        kv,
        slots,
        lengths,
        o,
        lse,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        lse.stride(0),
        lse.stride(1),
        H,
        split_rows,
        R=R,
        DR=DR,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        num_stages=num_stages,
        num_warps=num_warps,
        **pdl,
    )
    y = torch.empty(B, H, R, device=q.device, dtype=q.dtype)
    block_s = min(32, triton.next_power_of_2(splits))
    block_r = min(R, 4096 // block_s)  # [BLOCK_S, BLOCK_R] outputs in flight per program
    _mla_combine_kernel[(B, H, R // block_r)](
        o,
        lse,
        y,
        splits,
        o.stride(0),
        o.stride(1),
        o.stride(2),
        lse.stride(0),
        lse.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_S=block_s,
        BLOCK_R=block_r,
        **pdl,
    )
    return y


@_launch.register_fake
def _(q, kv, slots, lengths, scale, splits, split_rows, groups, R, DR, block_h, block_n, num_stages, num_warps):
    return q.new_empty(q.shape[0], q.shape[1], R)


def mla_decode(
    q: Tensor,
    kv: Tensor,
    seq_ids: Tensor,
    lengths: Tensor,
    scale: float,
    v_dim: int,
    max_length: int | None = None,
    block_n: int | None = None,
    num_stages: int | None = None,
    num_warps: int | None = None,
    programs_per_sm: int | None = None,
    block_h: int | None = None,
) -> Tensor:
    """q [B, H, r + dr] (one token per sequence); kv [slots, capacity, r + dr]; seq_ids, lengths [B] (int);
    -> [B, H, v_dim] in q.dtype. ``max_length`` (host int) sizes the splits; default reads ``lengths`` once.
    Launch: block_h heads a program (a power of two >= 16; default the heads' power of two up to 32), block_n rows
    per iteration, num_stages, num_warps, and sequences split into as many splits as keep the programs at most
    programs_per_sm per SM (splits of at least 256 rows). Defaults, from the launch choices in
    benchmarks/results/tune_mla_decode*.md: one group of up to 32 heads, 32 rows, 3 stages, 4 warps (8 for 32
    heads) and 2 programs an SM, one whole wave of programs (more splits were no faster); several groups of 32
    (K3's 96 heads), 64 rows, 2 stages, 4 warps and 8 programs an SM, where the one-group defaults left a large
    batch one split a sequence (docs/decisions.md, "MLA decode launch defaults for several head groups")."""
    B, H, D = q.shape
    R, DR = v_dim, D - v_dim
    if not supported(R, DR):
        raise ValueError(f"mla_decode needs power-of-two r={R} and dr={DR} >= 16")
    q = q.to(kv.dtype).contiguous()
    max_length = int(lengths.max()) if max_length is None else max_length
    block_h = block_h or min(32, max(16, triton.next_power_of_2(H)))
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"mla_decode: block_h={block_h} must be a power of two >= 16")
    groups = triton.cdiv(H, block_h)
    many = groups > 1
    block_n = block_n or (64 if many else 32)
    num_stages = num_stages or (2 if many else 3)
    num_warps = num_warps or (4 if many or block_h == 16 else 8)
    programs_per_sm = programs_per_sm or (8 if many else 2)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = max(1, min(triton.cdiv(max_length, 256), programs_per_sm * sms // (B * groups)))
    split_rows = triton.cdiv(triton.cdiv(max_length, splits), block_n) * block_n
    splits = triton.cdiv(max_length, split_rows)
    return _launch(
        q,
        kv,
        seq_ids.to(torch.int32).contiguous(),
        lengths.to(torch.int32).contiguous(),
        scale,
        splits,
        split_rows,
        groups,
        R,
        DR,
        block_h,
        block_n,
        num_stages,
        num_warps,
    )
