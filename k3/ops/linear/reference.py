"""Several linear maps of one input, in PyTorch: the reference of k3.ops.linear.triton_multi."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def multi_linear(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """x [M, K], weights [N_i, K] -> [x @ W_i^T, [M, N_i] each] (nn.Linear without bias, one call per weight)."""
    return [F.linear(x, w) for w in weights]
