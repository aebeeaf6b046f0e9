"""RMSNorm (weights multiply after the fp32 normalisation is cast back, like the HF checkpoints expect) and KDA's
gated per-head RMSNorm; both fused into one kernel on CUDA (k3.ops.fused)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from k3.ops.dtypes import upcast
from k3.ops.fused import fused


@fused
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x [..., D] -> x / rms(x) * weight, normalised in fp32, returned in x.dtype."""
    x32 = upcast(x)
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


@fused
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x, gate [..., D] -> RMSNorm(x) * weight * sigmoid(gate), all in fp32, returned in x.dtype."""
    x32 = upcast(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * upcast(weight)
    return (y * torch.sigmoid(upcast(gate))).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * sigmoid(gate), all in fp32 (KDA's per-head output norm). x, gate [..., D] -> x.dtype."""

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
