"""The short causal conv on the flat token stream: one convolution over all segments back to back, then the few
outputs that read across a segment start corrected. No padding per segment, no host sync, nothing saved for the
backward beyond what the convolution keeps.

The reference packs segments into a right-padded batch (a gather), convolves, and unpacks with a boolean mask,
which reads its size back to the host (a sync per call on a GPU) and whose backward is a sort-based index
accumulate. Here, for token t of segment s at offset p = t - start_s, the reference reads

    y_t[c] = act( sum_{j=0}^{W-1} weight[c, W-1-j] * u_{t,j}[c] ),   u_{t,j} = x_{t-j}                if j <= p
                                                                     = initial_state[s, c, W-1-j+p] if j > p

(zeros for no initial state). One causal conv over the stream computes every term with u_{t,j} = x_{t-j}; only
the pairs j > p (at most W(W-1)/2 per segment, listed on the host from the segment lengths) differ, so those
terms are subtracted again and the history terms added, with index_select / index_add (no sort in the backward).
Same contract and dtype rules as the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.dtypes import no_autocast
from k3.ops.segments import segment_lengths, to_device


def _crossing_terms(lengths: list[int], W: int, with_history: bool) -> tuple[list, list]:
    """The (token, lag j) pairs with j > p (offset in the segment), on the host: ``cross`` = (t, t - j, kernel
    column) where the stream has a token at t - j (another segment's, to subtract), ``hist`` = (t, segment,
    history column, kernel column) for the initial-state terms."""
    cross, hist = [], []
    start = 0
    for s, length in enumerate(lengths):
        for p in range(min(W - 1, length)):
            for j in range(p + 1, W):
                if start + p - j >= 0:
                    cross.append((start + p, start + p - j, W - 1 - j))
                if with_history:
                    hist.append((start + p, s, W - 1 - j + p, W - 1 - j))
        start += length
    return cross, hist


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                  activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """See :func:`k3.ops.conv.reference.causal_conv1d` (x [B, T, C], weight [C, W] -> y [B, T, C], state)."""
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [{C}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
        lengths = segment_lengths(cu_seqlens, T)
    else:
        lengths = [T] * B
    N = len(lengths)
    if initial_state is not None and initial_state.shape != (N, C, W - 1):
        raise ValueError(f"initial_state must be [{N}, {C}, {W - 1}], got {tuple(initial_state.shape)}")

    with no_autocast(x.device):  # compute in promote(x.dtype, fp32) also under autocast
        dtype = torch.promote_types(x.dtype, torch.float32)
        dev = x.device
        flat = x.reshape(B * T, C).to(dtype)  # segments back to back
        history = None if initial_state is None else initial_state.to(dtype)
        w = weight.to(dtype)
        # [BT, C], reading x_{t-j} for every lag, across segment starts too
        y = F.conv1d(F.pad(flat.T.unsqueeze(0), (W - 1, 0)), w.unsqueeze(1), groups=C)[0].T
        cross, hist = _crossing_terms(lengths, W, history is not None)
        wt = w.T  # [W, C]
        if cross:
            t_i, src, col = to_device(torch.tensor(cross).T.contiguous(), dev)
            y = y.index_add(0, t_i, flat.index_select(0, src) * wt.index_select(0, col), alpha=-1)
        if hist:
            t_i, seg, hcol, col = to_device(torch.tensor(hist).T.contiguous(), dev)
            y = y.index_add(0, t_i, history[seg, :, hcol] * wt.index_select(0, col))
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
