"""Causal depthwise short convolution with state. ``causal_conv1d(x [B,T,C], weight [C,W], ...) -> (y, state)``;
``causal_conv1d_step`` for one decode token per sequence (state pool updated in place), and
``causal_conv1d_steps`` for a KDA layer's three (q, k, v) at once: on the fast backend one Triton launch
(k3.ops.conv.triton_step) for calls that need no gradient, where the kernel plan chose kernel conv_step (on
where Triton is usable); the reference's three steps otherwise. Each choice is logged once, with the reason when it is
torch."""

import logging

import torch

from k3.ops import backend
from k3.ops.conv import fla as _fla
from k3.ops.conv.flat import causal_conv1d as causal_conv1d_flat
from k3.ops.conv.reference import causal_conv1d as causal_conv1d_reference
from k3.ops.conv.reference import causal_conv1d_step

_named: set = set()


def _fast(x, weight, **kwargs):
    """fla's fused Triton kernel on CUDA when fla-core is installed (faster there than the flat form), else (and
    for fp64, which fla does not take) the flat form, which runs anywhere: on a GPU it saves the reference's host
    sync and padding, on a CPU it is faster than the reference (docs/decisions.md, "Training-step GPU paths: the
    short conv"). The reference stays the independent check (tests/ops/test_conv.py)."""
    use_fla = _fla.available(x.device) and x.dtype in _fla.DTYPES
    if (x.device.type, use_fla) not in _named:
        _named.add((x.device.type, use_fla))
        logging.getLogger("k3.ops").debug(
            "op causal_conv1d fast path on %s: %s",
            x.device.type,
            "fla Triton kernel" if use_fla else "flat form (PyTorch)",
        )
    return (_fla.causal_conv1d if use_fla else causal_conv1d_flat)(x, weight, **kwargs)


backend.register("causal_conv1d", "reference", causal_conv1d_reference)
backend.register("causal_conv1d", "fast", _fast, supports=lambda d: True)


def causal_conv1d(x, weight, *, initial_state=None, output_final_state=False, cu_seqlens=None, activation="silu"):
    """See :func:`k3.ops.conv.reference.causal_conv1d`."""
    return backend.dispatch(
        "causal_conv1d",
        x.device,
        x,
        weight,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        activation=activation,
    )


def causal_conv1d_steps(xs, weights, *, states, slots, activation="silu"):
    """:func:`causal_conv1d_step` of three inputs: xs, weights, states lists of 3 ([N, C_i], [C_i, W],
    [S, C_i, W-1]) -> [y_i [N, C_i]], each state pool updated in place."""
    return backend.dispatch(
        "causal_conv1d_steps", xs[0].device, xs, weights, states=states, slots=slots, activation=activation
    )


def _steps_reference(xs, weights, *, states, slots, activation="silu"):
    return [
        causal_conv1d_step(x, w, state=s, slots=slots, activation=activation)
        for x, w, s in zip(xs, weights, states, strict=True)
    ]


_steps_logged: set[str] = set()


def steps_kernel(xs, weights, states, activation) -> str:
    """'triton' where the kernel plan chose conv_step, no gradient is needed, there are three inputs
    with activation silu or None, none fp64, contiguous state pools and a width of at least 2; else 'torch'
    (:func:`k3.ops.backend.triton_or_torch`, logged once each)."""

    def why_not() -> str:
        if torch.is_grad_enabled() and any(t.requires_grad for t in [*xs, *weights]):
            return "a gradient is needed"
        if len(xs) != 3 or activation not in ("silu", None):
            return "the kernel takes three inputs and activation silu or None"
        if any(t.dtype == torch.float64 for t in [*xs, *weights, *states]):
            return "fp64 inputs (the kernel computes in fp32)"
        if any(not s.is_contiguous() for s in states) or any(w.shape[-1] < 2 for w in weights):
            return "the kernel takes contiguous state pools and widths of at least 2"
        return ""

    return backend.triton_or_torch(
        "conv_step",
        "causal_conv1d_steps:",
        why_not,
        ("one Triton launch (k3.ops.conv.triton_step)", "three torch steps (reference)"),
        _steps_logged,
    )


def _steps_fast(xs, weights, *, states, slots, activation="silu"):
    if steps_kernel(xs, weights, states, activation) == "triton":
        from k3.ops.conv.triton_step import conv_steps  # Triton: imported on use (GPUs only)

        return list(conv_steps(*xs, *weights, *states, slots, activation == "silu"))
    return _steps_reference(xs, weights, states=states, slots=slots, activation=activation)


backend.register("causal_conv1d_steps", "reference", _steps_reference, label="three torch steps")
backend.register(
    "causal_conv1d_steps",
    "fast",
    _steps_fast,
    lambda d: d.type == "cuda",
    label="kernel conv_step where no gradient is needed, else torch",
)

__all__ = ["causal_conv1d", "causal_conv1d_step", "causal_conv1d_steps"]
