"""Precision helpers shared by the reference ops and model code (the rules: docs/precision.md)."""

import contextlib
import functools
from typing import Callable, TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable)


def upcast(x: Tensor) -> Tensor:
    """x in at least fp32 (bf16/fp16 -> fp32; fp64 stays fp64 so gradchecks and fp64 truths stay exact)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def no_autocast(device: torch.device):
    """A context in which autocast is off on ``device`` (ops that document their own compute dtype keep it)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _first_tensor(args, kwargs) -> Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor):
            return a[0]
    return None


def autocast_off(fn: F) -> F:
    """Decorator: ``fn`` computes in the dtypes it documents also when called under autocast.

    Autocast lowers every matrix product (linear, matmul, einsum, bmm) to bf16 / fp16, including products whose
    inputs the op upcast on purpose: the MoE router, the AttnRes depth logits and the KDA state recurrence are fp32
    by the architecture (docs/precision.md). The decorator turns autocast off on the device of the first tensor
    argument for the call; outside autocast it changes nothing. Compiled callers keep it (dynamo traces the
    context)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        t = _first_tensor(args, kwargs)
        if t is None or not torch.is_autocast_enabled(t.device.type):
            return fn(*args, **kwargs)
        with torch.autocast(t.device.type, enabled=False):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
