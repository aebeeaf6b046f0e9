"""SiTU, SiTU-GLU and SwiGLU (docs/architecture.md#situ), and the gated FFN that uses them.

SiTU_b(x) = b * tanh(x / b) * sigmoid(x): SiLU with its linear factor soft-capped at b.
SiTU-GLU(g, u) = SiTU_4(g) * 25 * tanh(u / 25): bounded by 100, equal to SwiGLU to first order near 0.
Nonlinearities run in fp32 and the result is cast back to the input dtype. The gated forms are fused into one
kernel on CUDA (k3.ops.fused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from k3.ops.dtypes import upcast
from k3.ops.fused import fused
from k3.ops.linear import multi_linear


def situ(x: Tensor, beta: float = 4.0) -> Tensor:
    x32 = upcast(x)
    return (beta * torch.tanh(x32 / beta) * torch.sigmoid(x32)).to(x.dtype)


@fused
def situ_glu(g: Tensor, u: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    g32, u32 = upcast(g), upcast(u)
    y = beta * torch.tanh(g32 / beta) * torch.sigmoid(g32) * (linear_beta * torch.tanh(u32 / linear_beta))
    return y.to(g.dtype)


@fused
def swiglu(g: Tensor, u: Tensor) -> Tensor:
    return (F.silu(upcast(g)) * upcast(u)).to(g.dtype)


@dataclass(frozen=True)
class GLU:
    """The model's gated activation act(gate, up), by name: ``kind`` 'situ' (:func:`situ_glu` with beta /
    linear_beta) or 'silu' (:func:`swiglu`). Called like the function it names; a kernel that computes the
    activation itself (the MoE's fused up-projection, k3.ops.moe.small_groups.small_groups_glu) reads the fields."""

    kind: str
    beta: float = 4.0
    linear_beta: float = 25.0

    def __post_init__(self):
        if self.kind not in ("situ", "silu"):
            raise ValueError(f"hidden_act={self.kind!r} must be 'situ' or 'silu'")

    def __call__(self, g: Tensor, u: Tensor) -> Tensor:
        if self.kind == "situ":
            return situ_glu(g, u, self.beta, self.linear_beta)
        return swiglu(g, u)


def make_glu(hidden_act: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> GLU:
    """The gated activation named by ``hidden_act`` ('situ' or 'silu')."""
    return GLU(hidden_act, situ_beta, situ_linear_beta)


class GatedFFN(nn.Module):
    """down_proj(act(gate_proj(x), up_proj(x))): the dense FFN and the shared experts. x [..., d] -> [..., d]."""

    def __init__(self, hidden_size: int, intermediate_size: int, glu: GLU):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.glu = glu

    def forward(self, x: Tensor) -> Tensor:
        return self.finish(self.gate_proj(x), self.up_proj(x))

    def finish(self, gate: Tensor, up: Tensor) -> Tensor:
        """down_proj(act(gate, up)) from the two input maps [..., I] (computed by the caller) -> [..., d]. 2-D
        inputs (the model's packed tokens: the dense FFN and the shared experts, in training, prefill and decode) go
        through k3.ops.linear.multi_linear: the same linear in torch, one Triton launch for a decode step's GEMV."""
        h = self.glu(gate, up)
        return multi_linear(h, [self.down_proj.weight])[0] if h.dim() == 2 else self.down_proj(h)
