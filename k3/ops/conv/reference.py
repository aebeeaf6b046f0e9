"""Pure-PyTorch reference for the depthwise causal short convolution used before KDA.

For every channel c and kernel width W (4 in Kimi Linear / K3), no bias:

    y_t[c] = act( sum_{i=0}^{W-1} weight[c, i] * x_{t-(W-1)+i}[c] )

Positions before the start of a sequence are read from ``initial_state`` [N, C, W-1] (oldest
first; zeros when None). The final state is the last W-1 inputs of each sequence, which for a
sequence shorter than W-1 still contains the older entries of its initial state - so running
[0:t1] and then [t1:T] with the returned state equals one run over [0:T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.dtypes import no_autocast
from k3.ops.segments import Segments, as_segments, pack_segments, unpack_segments

__all__ = ["causal_conv1d", "causal_conv1d_step"]


def check_arguments(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: Segments | None,
    activation: str | None,
) -> tuple[int, int, int, int, list[int]]:
    """Validate :func:`causal_conv1d`'s arguments (one ValueError each); returns B, T, C, W and the N segment
    lengths (the B rows when ``cu_seqlens`` is None)."""
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [{C}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
        lengths = list(cu_seqlens.check(T))
    else:
        lengths = [T] * B
    N = len(lengths)
    if initial_state is not None and initial_state.shape != (N, C, W - 1):
        raise ValueError(f"initial_state must be [{N}, {C}, {W - 1}], got {tuple(initial_state.shape)}")
    return B, T, C, W, lengths


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv1d with optional SiLU.

    Args:
        x: [B, T, C] input.
        weight: [C, W] per-channel kernel (nn.Conv1d weight[:, 0, :]).
        initial_state: [N, C, W-1] previous inputs, oldest first, or None (zeros);
            N = B, or the number of segments when ``cu_seqlens`` is given.
        output_final_state: also return the last W-1 inputs of each sequence.
        cu_seqlens: [N+1] segment offsets (B must be 1; a Segments or a tensor, k3.ops.segments); segments are
            independent.
        activation: "silu" or None.

    Returns:
        y: [B, T, C] in x.dtype; final_state: [N, C, W-1] in promote(x.dtype, float32), or None.
    """
    cu_seqlens = as_segments(cu_seqlens, x.device)
    B, T, C, W, lengths = check_arguments(x, weight, initial_state, cu_seqlens, activation)
    N = len(lengths)

    with no_autocast(x.device):  # compute in promote(x.dtype, fp32) also under autocast
        dtype = torch.promote_types(x.dtype, torch.float32)
        xs = pack_segments(x.to(dtype), cu_seqlens).transpose(1, 2)  # [N, C, Tmax]
        history = xs.new_zeros(N, C, W - 1) if initial_state is None else initial_state.to(dtype)
        xs = torch.cat([history, xs], dim=-1)  # [N, C, W-1+Tmax]: token t sits at index W-1+t

        y = F.conv1d(xs, weight.to(dtype).unsqueeze(1), groups=C)  # [N, C, Tmax]
        if activation == "silu":
            y = F.silu(y)
        y = unpack_segments(y.transpose(1, 2), cu_seqlens, T).to(x.dtype)

    final_state = None
    if output_final_state:
        # last W-1 inputs of a sequence of length L sit at indices L .. L+W-2 of xs
        lens = torch.tensor(lengths, device=x.device)
        index = lens[:, None] + torch.arange(W - 1, device=x.device)  # [N, W-1]
        final_state = torch.gather(xs, 2, index[:, None, :].expand(N, C, W - 1))
    return y, final_state


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new input per sequence: x [N, C] extends the sequences in ``state[slots]`` ([S, C, W-1] pool,
    oldest first), which is updated in place. Returns y [N, C] in x.dtype; the same numbers as
    :func:`causal_conv1d` over the whole history. No host reads (CUDA-graph safe)."""
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    window = torch.cat([state[slots].to(dtype), x.unsqueeze(-1).to(dtype)], dim=-1)  # [N, C, W]
    y = (window * weight.to(dtype)).sum(-1)
    state.index_copy_(0, slots, window[..., 1:].to(state.dtype))
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)
