"""Several linear maps of one input in one Triton launch: y_i = x @ W_i^T for up to 8 weights W_i [N_i, K].

Each program takes one block of BLOCK_N output columns of one weight, streams that block of the weight through K
once and multiplies it with x, BLOCK_M rows at a time (one pass at decode batch sizes): sum_i cdiv(N_i, BLOCK_N)
programs in one launch, where torch launches one GEMV per weight. The program's weight is found by comparing its
id with the running block counts (one ``if`` per weight slot, unused slots pruned at compile time).

Launch: BLOCK_K = 128, 4 stages (2 on a GPU whose shared memory does not fit 4, logged), 4 warps, and BLOCK_N = 32,
or 16 where that leaves fewer than 64 programs (more programs in flight for small maps): in
benchmarks/multi_linear_configs.py on an H200 at 64 rows, 5.6 us for a KDA layer's six maps (the fastest
configuration) and 4.7 us for the shared experts' two (the fastest, 4.5 us, takes BLOCK_K 256;
benchmarks/results/multi_linear_configs.md). It replaced Triton's autotuner, re-run in every process, whose choices
took 11.6-18.5 us per launch for the KDA maps inside compiled decode steps (5.6 us in the configurations' benchmark;
7.0-8.3 us in the step with this rule, benchmarks/results/profile_decode_sequence.txt).

``multi_linear_conv`` is the same launch with a KDA layer's short-conv decode step in the epilogue of its first
three maps (q, k, v): the conv of each output column with its sequence's state row, which it shifts in place, where
the default launches k3.ops.conv.triton_step's kernel after the maps. Opt-in until run on a GPU (K3_MAPS_CONV).

Forward only, for no-grad calls (decode): k3.ops.linear.multi_linear / multi_linear_conv pick it and log which path
runs.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from k3.ops.linear import MAX_WEIGHTS

_SIZES = [f"N{i}" for i in range(MAX_WEIGHTS)]
_fewer_stages: set[bool] = set()  # logged once: the rule's stages did not fit a GPU


@triton.jit
def _conv_epilogue(acc, y, rows, cols, M, n, CW, S, SLOTS, WIDTH: tl.constexpr, SILU: tl.constexpr):
    """The short-conv decode step of the map's outputs (k3.ops.conv.triton_step's equations), WIDTH 2..4: y[r, c] =
    act(sum_j cw[c, j] s[slot_r, c, j] + cw[c, W-1] x[r, c]) summed in tap order, with x the map's output rounded
    to y's dtype, and the state row shifted in place (s[slot_r, c, :] <- (s[slot_r, c, 1:], x[r, c])). Each tap is
    a [BLOCK_M, BLOCK_N] tensor of its own: 3-D [rows, columns, taps] blocks spilled registers at 64 rows."""
    x = acc.to(y.dtype.element_ty).to(tl.float32)  # [BLOCK_M, BLOCK_N], as the map would have stored it
    live = (rows[:, None] < M) & (cols[None, :] < n)
    slot = tl.load(SLOTS + rows, mask=rows < M, other=0).to(tl.int64)
    s_row = S + (slot[:, None] * n + cols[None, :]) * (WIDTH - 1)  # [BLOCK_M, BLOCK_N]: each row's tap 0
    cw = CW + cols * WIDTH
    t0 = tl.load(s_row, mask=live, other=0.0)
    t1 = tl.load(s_row + 1, mask=live & (WIDTH > 2), other=0.0)  # taps past the width: never read
    t2 = tl.load(s_row + 2, mask=live & (WIDTH > 3), other=0.0)
    out = t0.to(tl.float32) * tl.load(cw, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    if WIDTH > 2:
        out += t1.to(tl.float32) * tl.load(cw + 1, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    if WIDTH > 3:
        out += t2.to(tl.float32) * tl.load(cw + 2, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    out += x * tl.load(cw + WIDTH - 1, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    if SILU:
        out = out * tl.sigmoid(out)
    tl.store(y + rows[:, None].to(tl.int64) * n + cols[None, :], out.to(y.dtype.element_ty), mask=live)
    xs = x.to(S.dtype.element_ty)
    tl.debug_barrier()  # every tap loaded before the row moves (should a layout give one element to two threads)
    if WIDTH == 2:
        tl.store(s_row, xs, mask=live)
    if WIDTH == 3:
        tl.store(s_row, t1, mask=live)
        tl.store(s_row + 1, xs, mask=live)
    if WIDTH == 4:
        tl.store(s_row, t1, mask=live)
        tl.store(s_row + 1, t2, mask=live)
        tl.store(s_row + 2, xs, mask=live)


@triton.jit
def _mm_block(X, w, y, n, blk, M, stride_xm, CW, S, SLOTS, K: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CONV: tl.constexpr, WIDTH: tl.constexpr,
              SILU: tl.constexpr):
    """y[:, cols] = x @ w[cols, :]^T for this program's BLOCK_N columns (w [n, K] and y [M, n] row-major); with
    CONV, the short-conv step of those columns instead (:func:`_conv_epilogue`)."""
    cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                         mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
            wk = tl.load(w + cols[None, :].to(tl.int64) * K + ks[:, None],
                         mask=(ks[:, None] < K) & (cols[None, :] < n), other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(xk, wk, acc)
        if CONV:
            _conv_epilogue(acc, y, rows, cols, M, n, CW, S, SLOTS, WIDTH, SILU)
        else:
            tl.store(y + rows[:, None].to(tl.int64) * n + cols[None, :], acc.to(y.dtype.element_ty),
                     mask=(rows[:, None] < M) & (cols[None, :] < n))


@triton.jit
def _slot(X, w, y, n, pid, start, M, stride_xm, CW, S, SLOTS, K: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CONV: tl.constexpr, WIDTH: tl.constexpr,
          SILU: tl.constexpr):
    """Weight slot whose programs are [start, end): run this program's block if it is one; -> end."""
    end = start + tl.cdiv(n, BLOCK_N)
    if (pid >= start) & (pid < end):
        _mm_block(X, w, y, n, pid - start, M, stride_xm, CW, S, SLOTS, K, BLOCK_M, BLOCK_N, BLOCK_K, CONV, WIDTH,
                  SILU)
    return end


@triton.jit(do_not_specialize=["M"] + _SIZES)
def _multi_linear_kernel(X, W0, W1, W2, W3, W4, W5, W6, W7, Y0, Y1, Y2, Y3, Y4, Y5, Y6, Y7,
                         N0, N1, N2, N3, N4, N5, N6, N7, M, stride_xm, CW0, CW1, CW2, S0, S1, S2, SLOTS,
                         G: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, CONV: tl.constexpr = False, WIDTH: tl.constexpr = 2,
                         SILU: tl.constexpr = False):
    """With CONV, slots 0-2 run the short-conv step on their outputs (conv weights CW_i, state pools S_i, rows'
    slots SLOTS); without, those pointers are never read."""
    pid = tl.program_id(0)
    end = _slot(X, W0, Y0, N0, pid, 0, M, stride_xm, CW0, S0, SLOTS, K, BLOCK_M, BLOCK_N, BLOCK_K, CONV, WIDTH,
                SILU)
    if G > 1:
        end = _slot(X, W1, Y1, N1, pid, end, M, stride_xm, CW1, S1, SLOTS, K, BLOCK_M, BLOCK_N, BLOCK_K, CONV,
                    WIDTH, SILU)
    if G > 2:
        end = _slot(X, W2, Y2, N2, pid, end, M, stride_xm, CW2, S2, SLOTS, K, BLOCK_M, BLOCK_N, BLOCK_K, CONV,
                    WIDTH, SILU)
    if G > 3:
        end = _slot(X, W3, Y3, N3, pid, end, M, stride_xm, X, X, X, K, BLOCK_M, BLOCK_N, BLOCK_K, False, WIDTH,
                    SILU)
    if G > 4:
        end = _slot(X, W4, Y4, N4, pid, end, M, stride_xm, X, X, X, K, BLOCK_M, BLOCK_N, BLOCK_K, False, WIDTH,
                    SILU)
    if G > 5:
        end = _slot(X, W5, Y5, N5, pid, end, M, stride_xm, X, X, X, K, BLOCK_M, BLOCK_N, BLOCK_K, False, WIDTH,
                    SILU)
    if G > 6:
        end = _slot(X, W6, Y6, N6, pid, end, M, stride_xm, X, X, X, K, BLOCK_M, BLOCK_N, BLOCK_K, False, WIDTH,
                    SILU)
    if G > 7:
        _slot(X, W7, Y7, N7, pid, end, M, stride_xm, X, X, X, K, BLOCK_M, BLOCK_N, BLOCK_K, False, WIDTH,
              SILU)


def block_m(rows: int) -> int:
    """Rows per pass: the row count rounded up to a power of two, 16..64 (tl.dot needs 16)."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def launch_config(sizes: list[int]) -> dict:
    """The launch of maps with these output widths (module docstring): BLOCK_N, BLOCK_K, num_stages, num_warps."""
    wide = sum(triton.cdiv(n, 32) for n in sizes) >= 64
    return {"BLOCK_N": 32 if wide else 16, "BLOCK_K": 128, "num_stages": 4, "num_warps": 4}


@torch.library.custom_op("k3::multi_linear", mutates_args=())
def multi_linear(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """x [M, K], weights [N_i, K] (1..MAX_WEIGHTS, x's dtype: bf16 or fp16) -> [x @ W_i^T, [M, N_i] each], fp32
    accumulation. A custom op (``torch.ops.k3.multi_linear``): a compiled decode step keeps it inside its graph."""
    _check(x, weights)
    ys = [x.new_empty(x.shape[0], w.shape[0]) for w in weights]
    _launch(x, weights, ys)
    return ys


@multi_linear.register_fake
def _(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    _check(x, weights)
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]


_Eight = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # MAX_WEIGHTS outputs


@torch.library.custom_op("k3::multi_linear_conv", mutates_args=("s0", "s1", "s2"))
def multi_linear_conv(x: Tensor, weights: list[Tensor], cw0: Tensor, cw1: Tensor, cw2: Tensor, s0: Tensor,
                      s1: Tensor, s2: Tensor, slots: Tensor, silu: bool) -> _Eight:
    """:func:`multi_linear` whose first three outputs go through the short-conv decode step on the way out (a KDA
    layer's q, k, v maps and their convs in the launch of its six maps): weights (3..MAX_WEIGHTS), conv weights
    cw_i [N_i, W] (W 2..4), state pools s_i [S, N_i, W-1] (contiguous, updated in place), slots [N] distinct rows of the
    pools -> (y_0, y_1, y_2 (conv'd, SiLU if ``silu``), x @ W_3^T, ..., then [M, 0] tensors up to MAX_WEIGHTS):
    equal to k3.ops.conv.triton_step's conv_steps of multi_linear's outputs. A custom op
    (``torch.ops.k3.multi_linear_conv``) mutating the pools; it returns a fixed number of tensors, as an op that
    mutates its inputs cannot return a list (functionalisation)."""
    _check(x, weights)
    _check_conv(x, weights, [cw0, cw1, cw2], [s0, s1, s2], slots)
    ys = _outputs(x, weights)
    _launch(x, weights, ys[:len(weights)],
            ([cw0.contiguous(), cw1.contiguous(), cw2.contiguous()], [s0, s1, s2], slots, silu))
    return tuple(ys)


@multi_linear_conv.register_fake
def _(x, weights, cw0, cw1, cw2, s0, s1, s2, slots, silu):
    _check(x, weights)
    _check_conv(x, weights, [cw0, cw1, cw2], [s0, s1, s2], slots)
    return tuple(_outputs(x, weights))


def _outputs(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """The maps' outputs [M, N_i], then empty [M, 0] ones up to MAX_WEIGHTS."""
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights] + [
        x.new_empty(x.shape[0], 0) for _ in range(MAX_WEIGHTS - len(weights))]


def _check(x: Tensor, weights: list[Tensor]) -> None:
    if (x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or not 1 <= len(weights) <= MAX_WEIGHTS
            or any(w.dim() != 2 or w.dtype != x.dtype or w.shape[1] != x.shape[1] or w.device != x.device
                   for w in weights)):
        raise ValueError(f"multi_linear: x {tuple(x.shape)} {x.dtype} (bf16 / fp16 [M, K]) and weights "
                         f"{[(tuple(w.shape), w.dtype) for w in weights]} (1..{MAX_WEIGHTS} of [N, K], x's dtype and "
                         "device) do not match")


def _check_conv(x: Tensor, weights: list[Tensor], cws: list[Tensor], states: list[Tensor], slots: Tensor) -> None:
    width = cws[0].shape[-1] if cws[0].dim() == 2 else 0
    ok = len(weights) >= 3 and 2 <= width <= 4 and slots.dim() == 1 and slots.shape[0] == x.shape[0]
    ok = ok and not slots.is_floating_point() and slots.device == x.device
    for w, cw, st in zip(weights, cws, states):
        ok = ok and cw.shape == (w.shape[0], width) and st.dim() == 3 and st.shape[1:] == (w.shape[0], width - 1)
        ok = ok and st.is_contiguous() and cw.device == st.device == x.device and st.dtype != torch.float64
    if not ok:
        raise ValueError(f"multi_linear_conv: weights {[tuple(w.shape) for w in weights]}, conv weights "
                         f"{[tuple(c.shape) for c in cws]}, states {[tuple(t.shape) for t in states]} and slots "
                         f"{tuple(slots.shape)} (3.. weights, cw_i [N_i, W], contiguous s_i [S, N_i, W-1], integer "
                         "slots [M] on x's device, W in 2..4) do not match")


def _launch(x: Tensor, weights: list[Tensor], ys: list[Tensor], conv: tuple | None = None) -> None:
    """Launch by the rule (:func:`launch_config`), retried with 2 stages where 4 do not fit the GPU."""
    if not (x.shape[0] and any(w.shape[0] for w in weights)):
        return
    ws, bm = [w.contiguous() for w in weights], block_m(x.shape[0])
    config = launch_config([w.shape[0] for w in ws])
    try:
        _run(x, ws, ys, bm, conv=conv, **config)
    except OutOfResources:  # a GPU with less shared memory per block than the rule's 4 stages need (~96 KB)
        if not _fewer_stages:
            _fewer_stages.add(True)
            logging.getLogger("k3.ops").warning("multi_linear: 4 stages do not fit this GPU's shared memory; "
                                                "launching with 2")
        _run(x, ws, ys, bm, conv=conv, **(config | {"num_stages": 2}))


def _run(x: Tensor, weights: list[Tensor], ys: list[Tensor], bm: int, BLOCK_N: int, BLOCK_K: int,
         conv: tuple | None = None, **launch) -> None:
    """Launch the kernel with these blocks (and optionally num_stages / num_warps in ``launch``); ``conv`` = (conv
    weights, state pools, slots, silu) of slots 0-2 for :func:`multi_linear_conv`."""
    g = len(weights)
    pad = MAX_WEIGHTS - g
    sizes = [w.shape[0] for w in weights] + [0] * pad
    ws, outs = weights + [weights[0]] * pad, ys + [ys[0]] * pad  # unused slots: never read (G prunes them)
    if x.stride(1) != 1:
        x = x.contiguous()
    grid = (sum(triton.cdiv(n, BLOCK_N) for n in sizes),)
    if conv is None:
        extra, flags = [x] * 7, {}  # conv pointers never read
    else:
        cws, states, slots, silu = conv
        width = cws[0].shape[1]
        extra = [*cws, *states, slots]
        flags = dict(CONV=True, WIDTH=width, SILU=silu)
    _multi_linear_kernel[grid](x, *ws, *outs, *sizes, x.shape[0], x.stride(0), *extra, G=g, K=x.shape[1], BLOCK_M=bm,
                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **flags, **launch)
