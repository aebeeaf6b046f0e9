"""Precision helper shared by the reference ops and model code."""

import torch
from torch import Tensor


def upcast(x: Tensor) -> Tensor:
    """x in at least fp32 (bf16/fp16 -> fp32; fp64 stays fp64 so gradchecks and fp64 truths stay exact)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
