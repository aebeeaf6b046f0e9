"""The short causal conv on the flat token stream: W shifted, masked multiply-adds, no packing.

The reference packs segments into a right-padded batch (a gather), convolves, and unpacks with a boolean mask,
which reads its size back to the host (a sync per call on a GPU) and whose backward is a sort-based index
accumulate. Here every token t of segment s (offset p = t - start_s) reads

    y_t[c] = act( sum_{j=0}^{W-1} weight[c, W-1-j] * u_{t,j}[c] ),   u_{t,j} = x_{t-j}                if j <= p
                                                                     = initial_state[s, c, W-1-j+p] if j > p

(zeros in place of the initial state when there is none), so the whole op is W element-wise passes over [T, C]
plus, for a segment shorter than W-1, a gather of its history; nothing is read back to the host beyond the
segment offsets (whose host copy the model attaches). Same contract and dtype rules as the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.segments import segment_lengths, to_device


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

    dtype = torch.promote_types(x.dtype, torch.float32)
    dev = x.device
    flat = x.reshape(B * T, C).to(dtype)  # segments back to back
    lens = to_device(torch.tensor(lengths), dev)  # no blocking host-to-device copy
    seg = torch.repeat_interleave(torch.arange(N, device=dev), lens, output_size=B * T)  # [BT] segment of t
    starts = torch.cumsum(lens, 0) - lens
    p = torch.arange(B * T, device=dev) - starts[seg]  # offset inside its segment
    history = None if initial_state is None else initial_state.to(dtype)
    w = weight.to(dtype)
    padded = F.pad(flat, (0, 0, W - 1, 0))  # row W-1+t holds token t
    y = flat * w[:, W - 1]
    for j in range(1, W):
        shifted = padded[W - 1 - j:W - 1 - j + B * T]  # x_{t-j}
        inside = (p >= j).unsqueeze(1)
        if history is None:
            u = shifted * inside
        else:  # the first j tokens of a segment read its history column W-1-j+p
            col = (W - 1 - j + p).clamp(max=W - 2)
            u = torch.where(inside, shifted, history[seg, :, col])
        y = y + u * w[:, W - 1 - j]
    if activation == "silu":
        y = F.silu(y)
    y = y.reshape(B, T, C).to(x.dtype)

    final_state = None
    if output_final_state:  # the last W-1 inputs of each segment, reaching into its history when shorter
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
