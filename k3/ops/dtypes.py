"""Precision helper shared by the reference ops and model code."""

import contextlib

import torch
from torch import Tensor


def upcast(x: Tensor) -> Tensor:
    """x in at least fp32 (bf16/fp16 -> fp32; fp64 stays fp64 so gradchecks and fp64 truths stay exact)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def no_autocast(device: torch.device):
    """A context in which autocast is off on ``device`` (ops that document their own compute dtype keep it)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
