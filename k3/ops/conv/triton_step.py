"""A KDA layer's three short-conv decode steps (q, k, v) in one Triton launch.

For one new token per sequence, channel c of input i (x_i [N, C_i], weight w_i [C_i, W], state pool s_i [S, C_i,
W-1], oldest first):

  y_i[n, c] = act( sum_{j<W-1} w_i[c, j] s_i[slot_n, c, j] + w_i[c, W-1] x_i[n, c] )     in fp32, stored in x's dtype
  s_i[slot_n, c, :] <- (s_i[slot_n, c, 1:], x_i[n, c])                                       in place, in s_i's dtype

exactly :func:`k3.ops.conv.reference.causal_conv1d_step` for each i. Each program takes one token and BLOCK_C channels
of one of the three inputs. Compiled, the torch form became two combo kernels per KDA layer (window gathers by slot with
bounds checks, fp32 windows materialised: docs/decisions.md, "Decode's small torch compositions in one launch each");
this is one launch that reads each state row once.

Forward only, for no-grad calls (decode): k3.ops.conv.causal_conv1d_steps picks it and logs which path runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.pdl import launch, wait_then_release

BLOCK_C = 256  # channels per program


@triton.jit
def _one(
    X,
    Wt,
    St,
    Y,
    slot,
    n,
    cb,
    C,
    stride_x,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """Channel block ``cb`` of token ``n`` for one input: y and the state row's shift. The state row's taps and the
    weights are read before the wait (k3.ops.pdl: the kernel before this one does not write them), x after."""
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cs < C
    js = tl.arange(0, BLOCK_W)  # window taps; the last (WIDTH - 1) is the new input
    old = js < WIDTH - 1
    s_row = St + slot * C * (WIDTH - 1) + cs[:, None] * (WIDTH - 1)
    s = tl.load(s_row + js[None, :], mask=cmask[:, None] & old[None, :], other=0.0)  # [BLOCK_C, BLOCK_W]
    w = tl.load(Wt + cs[:, None] * WIDTH + js[None, :], mask=cmask[:, None] & (js < WIDTH)[None, :], other=0.0)
    nxt = tl.load(s_row + js[None, :] + 1, mask=cmask[:, None] & (js < WIDTH - 2)[None, :], other=0.0)
    wait_then_release(PDL)
    x = tl.load(X + n * stride_x + cs, mask=cmask, other=0.0)
    window = tl.where((js == WIDTH - 1)[None, :], x.to(tl.float32)[:, None], s.to(tl.float32))
    y = tl.sum(window * w.to(tl.float32), axis=1)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(Y + n * C + cs, y.to(Y.dtype.element_ty), mask=cmask)
    # the shifted row: tap j takes tap j + 1 (the new input at the end), stored over the old one once every thread
    # of the program has loaded it (another thread may hold tap j + 1 of the same row)
    shifted = tl.where((js == WIDTH - 2)[None, :], x.to(St.dtype.element_ty)[:, None], nxt)
    tl.debug_barrier()
    tl.store(s_row + js[None, :], shifted, mask=cmask[:, None] & old[None, :])


@triton.jit
def _conv_steps_kernel(
    X0,
    X1,
    X2,
    W0,
    W1,
    W2,
    S0,
    S1,
    S2,
    Y0,
    Y1,
    Y2,
    SLOTS,
    C0,
    C1,
    C2,
    sx0,
    sx1,
    sx2,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    n = tl.program_id(0)
    blk = tl.program_id(1)
    slot = tl.load(SLOTS + n).to(tl.int64)
    end0 = tl.cdiv(C0, BLOCK_C)
    end1 = end0 + tl.cdiv(C1, BLOCK_C)
    if blk < end0:
        _one(X0, W0, S0, Y0, slot, n, blk, C0, sx0, WIDTH, BLOCK_W, SILU, BLOCK_C, PDL)
    elif blk < end1:
        _one(X1, W1, S1, Y1, slot, n, blk - end0, C1, sx1, WIDTH, BLOCK_W, SILU, BLOCK_C, PDL)
    else:
        _one(X2, W2, S2, Y2, slot, n, blk - end1, C2, sx2, WIDTH, BLOCK_W, SILU, BLOCK_C, PDL)


@torch.library.custom_op("k3::conv_steps", mutates_args=("s0", "s1", "s2"))
def conv_steps(
    x0: Tensor,
    x1: Tensor,
    x2: Tensor,
    w0: Tensor,
    w1: Tensor,
    w2: Tensor,
    s0: Tensor,
    s1: Tensor,
    s2: Tensor,
    slots: Tensor,
    silu: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """x_i [N, C_i], w_i [C_i, W], s_i [S, C_i, W-1] (updated in place), slots [N] distinct ints in [0, S) ->
    y_i [N, C_i] in x_i's dtype (the module docstring's equations). A custom op (``torch.ops.k3.conv_steps``) that
    mutates the three state pools: a compiled decode step keeps it inside its graph, on the cache's own tensors."""
    _check([x0, x1, x2], [w0, w1, w2], [s0, s1, s2], slots)
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in (x0, x1, x2)]
    ys = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    n, width = x0.shape[0], w0.shape[1]
    if n:
        blocks = sum(triton.cdiv(x.shape[1], BLOCK_C) for x in xs)
        _conv_steps_kernel[(n, blocks)](
            *xs,
            *(w.contiguous() for w in (w0, w1, w2)),
            s0,
            s1,
            s2,
            *ys,
            slots,
            *(x.shape[1] for x in xs),
            *(x.stride(0) for x in xs),
            WIDTH=width,
            BLOCK_W=triton.next_power_of_2(width),
            SILU=silu,
            BLOCK_C=BLOCK_C,
            **launch(x0.device),
        )
    return tuple(ys)


@conv_steps.register_fake
def _(x0, x1, x2, w0, w1, w2, s0, s1, s2, slots, silu):
    _check([x0, x1, x2], [w0, w1, w2], [s0, s1, s2], slots)
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (x0, x1, x2))


def _check(xs: list[Tensor], ws: list[Tensor], ss: list[Tensor], slots: Tensor) -> None:
    n, width = xs[0].shape[0], ws[0].shape[-1]
    ok = slots.dim() == 1 and slots.shape[0] == n and not slots.is_floating_point() and width >= 2
    for x, w, s in zip(xs, ws, ss):
        ok = ok and x.dim() == 2 and x.shape[0] == n and w.shape == (x.shape[1], width) and s.dim() == 3
        ok = ok and s.shape[1:] == (x.shape[1], width - 1) and s.is_contiguous() and x.device == w.device == s.device
    if not ok:
        raise ValueError(
            f"conv_steps: inputs {[tuple(x.shape) for x in xs]}, weights {[tuple(w.shape) for w in ws]}, "
            f"states {[tuple(s.shape) for s in ss]} and slots {tuple(slots.shape)} (x_i [N, C_i], w_i "
            "[C_i, W], contiguous s_i [S, C_i, W-1], integer slots [N], W >= 2) do not match"
        )
