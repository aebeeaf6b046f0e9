"""Causal depthwise short convolution with state. ``causal_conv1d(x [B,T,C], weight [C,W], ...) -> (y, state)``;
``causal_conv1d_step`` for one decode token per sequence (state pool updated in place)."""

import logging

from k3.ops import backend
from k3.ops.conv import fla as _fla
from k3.ops.conv.flat import causal_conv1d as causal_conv1d_flat
from k3.ops.conv.reference import causal_conv1d as causal_conv1d_reference
from k3.ops.conv.reference import causal_conv1d_step

_named: set = set()


def _fast(x, weight, **kwargs):
    """fla's fused Triton kernel on CUDA when fla-core is installed (a KDA layer's three convs fwd + bwd at 4K
    tokens: 0.14 ms against the flat form's 0.35 ms, H200), else (and for fp64, which fla does not take) the
    flat form, which runs anywhere: on a GPU it saves the reference's host sync and padding; on 2 CPU cores a
    [2048, 256] conv over 6 documents with backward takes 6 ms instead of 24. The reference stays the
    independent check (tests/ops/test_conv.py)."""
    use_fla = _fla.available(x.device) and x.dtype in _fla.DTYPES
    if (x.device.type, use_fla) not in _named:
        _named.add((x.device.type, use_fla))
        logging.getLogger("k3.ops").info("op causal_conv1d fast path on %s: %s", x.device.type,
                                         "fla Triton kernel" if use_fla else "flat form (PyTorch)")
    return (_fla.causal_conv1d if use_fla else causal_conv1d_flat)(x, weight, **kwargs)


backend.register("causal_conv1d", "reference", causal_conv1d_reference)
backend.register("causal_conv1d", "fast", _fast, supports=lambda d: True)


def causal_conv1d(x, weight, *, initial_state=None, output_final_state=False, cu_seqlens=None, activation="silu"):
    """See :func:`k3.ops.conv.reference.causal_conv1d`."""
    return backend.dispatch("causal_conv1d", x.device, x, weight, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, activation=activation)


__all__ = ["causal_conv1d", "causal_conv1d_step"]
