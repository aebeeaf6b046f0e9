"""Packed MXFP4 experts at decode in CUDA: the weights as the MMA's register operand (docs/architecture.md#mx,
docs/kernels.md#decode).

At decode an expert has one or two rows, so its matmul is a stream of weights, 4.25 bits each: the kernel is fast
when it spends few instructions a weight. ``tl.dot`` makes the rows the MMA's M (at least 16) and dequantises the
weights into the shared-memory operand; here the roles swap: each warp's MMA (``mma.sync`` m16n8k16, bf16 in, fp32
out) takes 16 weight rows as its register operand A and 8 token rows as its N, so the weights go from a 16-byte
load through a few bit operations straight into the MMA.

Per warp: 16 x M_TILES output features of one expert; per step 128 input columns, of which thread (g, q) of the
warp (g = lane / 4, q = lane % 4) holds 32 (one E8M0 scale group) of rows g and g + 8 of each tile: 16 bytes of
codes a row, one 128-bit load, issued a step ahead of its use. The MMA's K order inside a step is our choice as
long as both operands agree: the thread's pair of columns for an MMA register is (8j + p, 8j + 4 + p) of its 32
(word j of the 16 bytes, nibble p and nibble p of the word's upper half), so two shifts and two masks of the word
put both codes in place in the two bf16 halves of a register (sign to bit 15, exponent and mantissa to bits 8..6:
the code's value times 2^-126, a bf16 subnormal for exponent 0); one bf16x2 multiply by 2^(s - 1) makes it
code x 2^(s - 127), the dequantised weight exactly (scales above 2^1 take a second multiply, warp-uniformly; 0xFF
gives NaN). The activation row is loaded as its 32 bf16 columns and paired the same way with one byte permute.
Weights stream past L1 (``ld.global.nc.L1::no_allocate``, 128-byte L2 fetches); activations, reused by every warp,
are cached. Blocks go only to experts with rows when the caller bounds their number (``groups_max``).
Measurements and what was tried: docs/decisions.md, "Packed MXFP4 experts at decode in CUDA".

Numerics equal k3.ops.moe.mxfp4.moe_experts_reference on bf16 within bf16 rounding: the same bf16 weights, fp32
accumulation (in the MMA's order), the output rounded to bf16. Experts with more than 8 rows stream their weights
once per 8 rows; prefill goes to k3.ops.moe.triton_mxfp4.

Compiled at first use with NVRTC (``torch.cuda._compile_kernel``, which ships with PyTorch's CUDA builds); needs
compute capability 8.0 or later.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

M_TILES = 2  # 16-row MMA tiles a warp computes (its activations are loaded once for all of them)
WARPS = 4
BLOCK_N = 16 * M_TILES * WARPS
ROWS_PER_EXPERT = 8  # buffer rows an expert on average up to which k3::mxfp4_groups_mm runs this kernel

_SOURCE = r"""
// Compile-time: NDIM, KDIM (the weight shape), M_TILES, WARPS.
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
struct U4 { u32 x, y, z, w; };

__device__ __forceinline__ U4 load_weights(const u8* p) {  // streamed past L1; L2 fetches 128 bytes a miss
  U4 v;
  asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ U4 load_rows(const u16* p) {  // activations: every warp of the expert reads them
  U4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// Codes at bits 4p..4p+3 and 16+4p..19+4p of w -> bf16x2 (value x 2^-126): sign to bit 15, e1 e0 m to bits 8..6.
// Plain shifts (no bit needs to wrap), so the left ones can run as integer multiplies beside the logic ops.
__device__ __forceinline__ u32 decode(u32 w, int p) {
  const u32 mag = p < 2 ? w << (6 - 4 * p) : w >> (4 * p - 6);
  return (mag & 0x01C001C0u) | ((w << (12 - 4 * p)) & 0x80008000u);
}
__device__ __forceinline__ u32 mul2(u32 a, u32 b) {  // bf16x2 a * b, one rounding (a * b + -0)
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
__device__ __forceinline__ u32 pair(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u16 to_bf16(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
// A row of the warp's tiles exists (rows past N, where N is not a multiple of the warp's 16 x M_TILES, do not).
#define ROW_OK(t, h) (NDIM % (16 * M_TILES) == 0 || n_g + 16 * (t) + 8 * (h) < NDIM)
struct Step {  // one thread's operands for 128 columns: codes of rows g, g + 8 of each tile, their scales, x
  U4 w[M_TILES][2];
  u32 s[M_TILES][2];
  u32 x[16];
};

__device__ __forceinline__ void load_step(Step& st, const u8* pw, const u8* ps, int n_g, const u16* xrow, int kt,
                                          bool k_ok, bool x_ok) {
  // pw / ps: row g of the warp's first tile (codes / scales); row g + 16t + 8h is a constant offset away
#pragma unroll
  for (int t = 0; t < M_TILES; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = ROW_OK(t, h) ? 16 * t + 8 * h : 0;  // rows past N reread a row (their output is not stored)
      st.w[t][h] = k_ok ? load_weights(pw + row * (KDIM / 2) + kt / 2) : U4{0u, 0u, 0u, 0u};
      st.s[t][h] = k_ok ? (u32)ps[row * (KDIM / 32) + kt / 32] : 127u;
    }
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    U4 xv = (k_ok && x_ok) ? load_rows(xrow + kt + 8 * v) : U4{0u, 0u, 0u, 0u};
    st.x[4 * v] = xv.x, st.x[4 * v + 1] = xv.y, st.x[4 * v + 2] = xv.z, st.x[4 * v + 3] = xv.w;
  }
}

// The 8 MMAs of a step. Each code pair (value x 2^-126) is multiplied by 2^(s - 1), which is the dequantised weight
// for scales s <= 128 (2^(s - 127) <= 2); BIG (some lane of the warp has a larger scale) multiplies by 2^126 and
// then by 2^(s - 127), NaN for s = 0xFF.
template <bool BIG>
__device__ __forceinline__ void mma_step(float (&acc)[M_TILES][4], const Step& st) {
  u32 m1[M_TILES][2], m2[M_TILES][2];
#pragma unroll
  for (int t = 0; t < M_TILES; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 s = st.s[t][h];
      if (BIG) {
        m1[t][h] = s <= 128u ? s * 0x00800080u + 0x3F003F00u : 0x7E807E80u;
        m2[t][h] = s <= 128u ? 0x3F803F80u : (s == 255u ? 0x7FC07FC0u : s * 0x00800080u);
      } else {
        m1[t][h] = s * 0x00800080u + 0x3F003F00u;
      }
    }
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // MMA i: words j = i / 2 of the codes, nibbles p = 2u and 2u + 1
    const int j = i >> 1, u = i & 1;
    const u32 b0 = pair(st.x[4 * j + u], st.x[4 * j + 2 + u], 0x5410u);  // columns 8j + 2u, 8j + 4 + 2u
    const u32 b1 = pair(st.x[4 * j + u], st.x[4 * j + 2 + u], 0x7632u);  // columns 8j + 2u + 1, 8j + 5 + 2u
#pragma unroll
    for (int t = 0; t < M_TILES; ++t) {
      const U4& wl = st.w[t][0];
      const U4& wh = st.w[t][1];
      const u32 lo = j == 0 ? wl.x : j == 1 ? wl.y : j == 2 ? wl.z : wl.w;
      const u32 hi = j == 0 ? wh.x : j == 1 ? wh.y : j == 2 ? wh.z : wh.w;
      u32 a0 = mul2(decode(lo, 2 * u), m1[t][0]), a2 = mul2(decode(lo, 2 * u + 1), m1[t][0]);
      u32 a1 = mul2(decode(hi, 2 * u), m1[t][1]), a3 = mul2(decode(hi, 2 * u + 1), m1[t][1]);
      if (BIG) {
        a0 = mul2(a0, m2[t][0]), a2 = mul2(a2, m2[t][0]);
        a1 = mul2(a1, m2[t][1]), a3 = mul2(a3, m2[t][1]);
      }
      mma(acc[t], a0, a1, a2, a3, b0, b1);
    }
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) mxfp4_rows(
    const u16* __restrict__ X, const long long* __restrict__ SRC, const u8* __restrict__ P,
    const u8* __restrict__ S, const int* __restrict__ OFFS, u16* __restrict__ Y, int stride_x, int pairs_per_token,
    int gather, int experts) {
  const int lane = threadIdx.x & 31;
  // The expert: block x itself where the grid has a block for every expert, else the x-th expert with rows (a
  // warp-wide scan of the group ends), so batches that select few of many experts launch no empty blocks.
  int e = blockIdx.x;
  if (gridDim.x < experts) {
    e = -1;
    for (int base = 0, j = blockIdx.x; base < experts && e < 0; base += 32) {
      const int c = base + lane;
      const bool has = c < experts && OFFS[c] > (c > 0 ? OFFS[c - 1] : 0);
      const u32 mask = __ballot_sync(0xffffffffu, has);
      const u32 hit = __ballot_sync(0xffffffffu, has && __popc(mask & ((1u << lane) - 1u)) == j);
      if (hit) e = base + __ffs(hit) - 1;
      j -= __popc(mask);
    }
    if (e < 0) return;
  }
  const int end = OFFS[e];
  const int start = e > 0 ? OFFS[e - 1] : 0;
  const int g = lane >> 2, q = lane & 3;
  const int n_warp = (blockIdx.y * WARPS + (threadIdx.x >> 5)) * (16 * M_TILES);
  if (start >= end || n_warp >= NDIM) return;
  const int n_g = n_warp + g;
  const int n_row = NDIM % (16 * M_TILES) == 0 ? n_g : min(n_g, NDIM - 1);  // a row that exists: g may be past N
  const u8* pw = P + ((long long)e * NDIM + n_row) * (KDIM / 2);
  const u8* ps = S + ((long long)e * NDIM + n_row) * (KDIM / 32);
  for (int r0 = start; r0 < end; r0 += 8) {
    const int r = r0 + g;  // this thread's activation row: the MMA's column g
    bool x_ok = r < end;
    long long xr = x_ok ? r : 0;
    if (gather) {
      const long long src = x_ok ? SRC[r] : -1;
      x_ok = src >= 0;
      xr = x_ok ? src / pairs_per_token : 0;
    }
    const u16* xrow = X + xr * stride_x;
    float acc[M_TILES][4];
#pragma unroll
    for (int t = 0; t < M_TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    Step cur, nxt;
    load_step(cur, pw, ps, n_g, xrow, 32 * q, 32 * q < KDIM, x_ok);
#pragma unroll 2
    for (int k0 = 0; k0 < KDIM; k0 += 128) {  // the next step's loads are in flight while this one computes
      const int kn = k0 + 128 + 32 * q;
      load_step(nxt, pw, ps, n_g, xrow, kn, kn < KDIM, x_ok);
      bool big = false;
#pragma unroll
      for (int t = 0; t < M_TILES; ++t) big |= cur.s[t][0] > 128u || cur.s[t][1] > 128u;
      if (__any_sync(0xffffffffu, big))
        mma_step<true>(acc, cur);
      else
        mma_step<false>(acc, cur);
      cur = nxt;
    }
#pragma unroll
    for (int t = 0; t < M_TILES; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = n_g + 16 * t + 8 * (c >> 1), row = r0 + 2 * q + (c & 1);
        if (n < NDIM && row < end) Y[(long long)row * NDIM + n] = to_bf16(acc[t][c]);
      }
  }
}
"""


def why_not(device: torch.device) -> str:
    """Why the kernel cannot run on ``device`` ("" where it can): a CUDA GPU of compute capability >= 8.0 and
    PyTorch's NVRTC compiler."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs compute capability 8.0 or later (mma.sync bf16)"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return "this PyTorch has no torch.cuda._compile_kernel (NVRTC)"
    try:
        from torch.cuda._utils import _get_gpu_rtc_library

        _get_gpu_rtc_library()
    except (OSError, RuntimeError) as err:
        return f"NVRTC cannot be loaded ({err})"
    return ""


@functools.cache
def _kernel(device_index: int, n: int, k: int):
    """The kernel compiled for one device and one weight shape [n, k] (NVRTC, once per process; the shape as
    constants turns every row's address into an offset from one pointer)."""
    opts = [f"-DM_TILES={M_TILES}", f"-DWARPS={WARPS}", f"-DNDIM={n}", f"-DKDIM={k}", "-std=c++17"]
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(_SOURCE, "mxfp4_rows", nvcc_options=opts)


def mxfp4_rows_mm(
    x: Tensor,
    src_pair: Optional[Tensor],
    pairs_per_token: int,
    packed: Tensor,
    scale: Tensor,
    offs: Tensor,
    groups_max: Optional[int] = None,
) -> Tensor:
    """k3.ops.moe.triton_mxfp4.mxfp4_groups_mm's contract (checked there) on this kernel: packed uint8
    [E, N, K / 2], scale uint8 [E, N, K / 32], offs [E] int32 group ends; x [T, K] bf16 gathered through
    src_pair [R] (token src_pair[r] // pairs_per_token, zeros for -1) or x [R, K] the rows -> y [R, N] bf16.
    ``groups_max``: at most this many experts have rows (e.g. the number of token-expert pairs): one block row
    for each of them instead of each expert."""
    x, packed = (
        t.contiguous() if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
        for t in (x, packed)
    )  # 16-byte loads
    scale = scale.contiguous()
    gather = src_pair is not None
    rows = src_pair.shape[0] if gather else x.shape[0]
    e, n, half = packed.shape
    y = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    if rows == 0:
        return y
    src = src_pair.contiguous() if gather else offs
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    _kernel(index, n, 2 * half)(
        grid=(min(e, rows, groups_max or e), -(-n // BLOCK_N), 1),
        block=(32 * WARPS, 1, 1),
        args=[x, src, packed, scale, offs.to(torch.int32), y, x.stride(0), pairs_per_token, int(gather), e],
    )
    return y
