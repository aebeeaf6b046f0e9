"""The short causal conv on the flat token stream: one convolution over all segments back to back, then the few
outputs that read across a segment start recomputed. No padding per segment, no host sync, nothing saved for the
backward beyond what the convolution keeps.

The reference packs segments into a right-padded batch (a gather), convolves, and unpacks with a boolean mask,
which reads its size back to the host (a sync per call on a GPU) and whose backward is a sort-based index
accumulate. Here, for token t of segment s at offset p = t - start_s, the reference reads

    y_t[c] = act( sum_{j=0}^{W-1} weight[c, W-1-j] * u_{t,j}[c] ),   u_{t,j} = x_{t-j}                if j <= p
                                                                     = initial_state[s, c, W-1-j+p] if j > p

(zeros for no initial state). One causal conv over the stream computes every output with u_{t,j} = x_{t-j};
that is right except at the first W-1 tokens of each segment (K <= N (W-1) tokens), whose outputs are computed
again from their own inputs and history ([K, W, C] gathered) and written over the conv's (distinct targets, so
deterministic on CUDA; no sort in the backward; no cancellation, unlike subtracting the wrong terms). The token
and lag tables are built from the segment lengths with vectorised CPU ops and kept with the ``Segments`` (the
layers of a forward share them). Same contract and dtype rules as the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from k3.ops.dtypes import no_autocast
from k3.ops.conv.reference import check_arguments
from k3.ops.segments import Segments, as_segments, to_device


class _Boundary(NamedTuple):
    """The first W-1 tokens of every segment (K of them) and their lags j = 0..W-1, on the device."""

    t: torch.Tensor  # [K] flat position
    seg: torch.Tensor  # [K] its segment
    src: torch.Tensor  # [K, W] t - j, clamped to >= 0
    own: torch.Tensor  # [K, W] j <= p: the input is the segment's own token t - j, else its history
    hcol: torch.Tensor  # [K, W] that history column, W-1-j+p (clamped where unused)


def _boundary(lengths: list[int], W: int, device: torch.device) -> _Boundary:
    lens = torch.tensor(lengths)
    starts = lens.cumsum(0) - lens
    p = torch.arange(W - 1)
    keep = p[None, :] < lens[:, None]  # [N, W-1]: offset p exists in the segment (host tensors: no sync)
    seg = torch.arange(len(lengths))[:, None].expand(-1, W - 1)[keep]
    pk = p[None, :].expand(len(lengths), -1)[keep]
    t = starts[seg] + pk
    j = torch.arange(W)
    own = j[None, :] <= pk[:, None]
    hcol = (W - 1 - j[None, :] + pk[:, None]).clamp(0, max(W - 2, 0))
    parts = (t, seg, (t[:, None] - j[None, :]).clamp(min=0), own, hcol)
    return _Boundary(*(to_device(part, device) for part in parts))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See :func:`k3.ops.conv.reference.causal_conv1d` (x [B, T, C], weight [C, W] -> y [B, T, C], state)."""
    cu_seqlens = as_segments(cu_seqlens, x.device)
    B, T, C, W, lengths = check_arguments(x, weight, initial_state, cu_seqlens, activation)
    N = len(lengths)

    with no_autocast(x.device):  # compute in promote(x.dtype, fp32) also under autocast
        dtype = torch.promote_types(x.dtype, torch.float32)
        dev = x.device
        flat = x.reshape(B * T, C).to(dtype)  # segments back to back
        history = None if initial_state is None else initial_state.to(dtype)
        w = weight.to(dtype)
        # [BT, C], reading x_{t-j} for every lag, across segment starts too
        y = F.conv1d(F.pad(flat.T.unsqueeze(0), (W - 1, 0)), w.unsqueeze(1), groups=C)[0].T
        b = (
            _boundary(lengths, W, dev)
            if cu_seqlens is None  # the layers of a forward share the tables
            else cu_seqlens.derived(("conv", W, str(dev)), lambda: _boundary(lengths, W, dev))
        )
        if b.t.numel():  # the first W-1 outputs of every segment, from their own inputs and history
            k = b.t.numel()
            lag_w = w.T.flip(0)  # [W, C]: row j is weight[:, W-1-j]
            own_x = flat.index_select(0, b.src.reshape(-1)).view(k, W, C)
            past = 0.0 if history is None else history[b.seg[:, None], :, b.hcol]  # [K, W, C]
            u = torch.where(b.own.unsqueeze(-1), own_x, past)  # select, not mask-multiply: inf * 0 is NaN
            y = y.index_copy(0, b.t, (u * lag_w).sum(1))
        if activation == "silu":
            y = F.silu(y)
        y = y.reshape(B, T, C).to(x.dtype)

    final_state = None
    if output_final_state:  # the last W-1 inputs of each segment, reaching into its history when shorter
        lens = to_device(torch.tensor(lengths), dev)
        starts = torch.cumsum(lens, 0) - lens
        m = torch.arange(W - 1, device=dev)
        ends = starts + lens
        t = ends[:, None] - (W - 1) + m[None, :]  # [N, W-1] flat positions
        own = t >= starts[:, None]
        tail = flat[t.clamp(min=0)].transpose(1, 2)  # [N, C, W-1]
        hist = history if history is not None else flat.new_zeros(N, C, W - 1)
        col = (m[None, :] + lens[:, None]).clamp(max=W - 2)  # history index m + L when t is before the start
        from_hist = hist.gather(2, col[:, None, :].expand(N, C, W - 1))
        final_state = torch.where(own[:, None, :], tail, from_hist)
    return y, final_state
