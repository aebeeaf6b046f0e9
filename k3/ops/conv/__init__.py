"""Causal depthwise short convolution with state. ``causal_conv1d(x [B,T,C], weight [C,W], ...) -> (y, state)``;
``causal_conv1d_step`` for one decode token per sequence (state pool updated in place)."""

from k3.ops import backend
from k3.ops.conv.flat import causal_conv1d as causal_conv1d_flat
from k3.ops.conv.reference import causal_conv1d as causal_conv1d_reference
from k3.ops.conv.reference import causal_conv1d_step

backend.register("causal_conv1d", "reference", causal_conv1d_reference)
# the flat form runs anywhere and is the default everywhere: on a GPU it saves the reference's host sync and
# padding; on 2 CPU cores a [2048, 256] conv over 6 documents with backward takes 6 ms instead of 24 (a small
# preset training step: within noise). The reference stays the independent check (tests/ops/test_conv.py).
backend.register("causal_conv1d", "fast", causal_conv1d_flat, supports=lambda d: True)


def causal_conv1d(x, weight, *, initial_state=None, output_final_state=False, cu_seqlens=None, activation="silu"):
    """See :func:`k3.ops.conv.reference.causal_conv1d`."""
    return backend.dispatch("causal_conv1d", x.device, x, weight, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, activation=activation)


__all__ = ["causal_conv1d", "causal_conv1d_step"]
