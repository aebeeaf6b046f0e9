"""RMSNorm and KDA's gated per-head RMSNorm as functions, each fused into one kernel on CUDA (k3.ops.fused);
the modules that hold their weights are k3.model.norm's (docs/architecture.md#precision: normalised in fp32)."""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops.dtypes import upcast
from k3.ops.fused import fused


@fused
def rms_norm(x: Tensor, weight: Tensor | None, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [..., D] -> x / rms(x) * weight, normalised in fp32 and cast back to x.dtype before the weight multiplies;
    the result in ``out_dtype`` (None: the promoted dtype of x and weight)."""
    x32 = upcast(x)
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = y if weight is None else weight * y
    return y if out_dtype is None else y.to(out_dtype)


@fused
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """x, gate [..., D] -> RMSNorm(x) * weight * sigmoid(gate), all in fp32, returned in ``out_dtype`` (None:
    x.dtype)."""
    x32 = upcast(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * upcast(weight)
    return (y * torch.sigmoid(upcast(gate))).to(x.dtype if out_dtype is None else out_dtype)
