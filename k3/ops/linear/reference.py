"""Several linear maps of one input, in PyTorch: the reference of k3.ops.linear.triton_multi."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from k3.ops.dtypes import autocast_off, upcast


@autocast_off
def fp32_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K] @ weight [N, K]^T in at least fp32, x and the weight upcast, also under autocast (a MoE router's
    logits: docs/precision.md) -> [M, N]."""
    return F.linear(upcast(x), upcast(weight))


def multi_linear(x: Tensor, weights: list[Tensor], fp32: int = 0) -> list[Tensor]:
    """x [M, K], weights [N_i, K] -> [x @ W_i^T, [M, N_i] each] (nn.Linear without bias, one call per weight); the
    last ``fp32`` maps in at least fp32, x and the weight upcast (a MoE router's logits)."""
    if not 0 <= fp32 <= len(weights):
        raise ValueError(f"multi_linear: fp32={fp32} must be between 0 and the number of weights ({len(weights)})")
    n = len(weights) - fp32
    return [F.linear(x, w) for w in weights[:n]] + [fp32_linear(x, w) for w in weights[n:]]
