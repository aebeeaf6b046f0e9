"""RMSNorm (weights multiply after the fp32 normalisation is cast back, like the HF checkpoints expect) and KDA's
gated per-head RMSNorm; both fused into one kernel on CUDA (k3.ops.fused). Norms that feed only matmuls return
autocast's dtype under autocast (:func:`matmul_dtype`), the cast inside the norm's kernel."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from k3.ops.norm import gated_rms_norm, rms_norm

__all__ = ["GatedRMSNorm", "RMSNorm", "gated_rms_norm", "matmul_dtype", "rms_norm"]


def matmul_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype autocast would cast x to for a matmul (its dtype where autocast is on for x's device and x is a
    float below fp64), else None. Norms whose outputs feed matmuls return it, the cast fused into the norm's
    kernel: one cast per norm instead of one per consumer (a KDA layer's input feeds six projections), and the
    consumers' gradients summed in that dtype before the one cast back."""
    if x.is_floating_point() and x.dtype != torch.float64 and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return None


class RMSNorm(nn.Module):
    """``cast``: the output feeds only matmuls, so under autocast it is returned in autocast's dtype
    (:func:`matmul_dtype`); False where it also feeds something else (the image embeddings spliced into the text
    stream; a MoE's input, which also feeds its fp32 router and, without a latent projection, its routed sum,
    returned in its input's dtype)."""

    def __init__(self, dim: int, eps: float = 1e-6, cast: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cast = cast

    def out_dtype(self, x: Tensor) -> torch.dtype | None:
        """The ``out_dtype`` of this norm of x (rms_norm's argument)."""
        return matmul_dtype(x) if self.cast else None

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.out_dtype(x))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + ("" if self.cast else ", cast=False")


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * sigmoid(gate), all in fp32 (KDA's per-head output norm). x, gate [..., D] -> x.dtype, or
    autocast's dtype under autocast when ``cast`` (it feeds o_proj)."""

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, self.out_dtype(x))
