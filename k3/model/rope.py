"""Rotary position embedding: MLA's decoupled rope head (docs/architecture.md#mla) and the vision tower's 2-D
rotary embedding, one half of the head per axis (k3.model.vision)."""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops.dtypes import upcast


def rotate_half_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding on the last dim (two halves), x [N, ..., dr], positions [N] -> same shape/dtype."""
    dr = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dr, 2, device=x.device, dtype=torch.float32) / dr))
    angles = upcast(positions)[:, None] * inv_freq[None, :]  # [N, dr/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dr // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    x1, x2 = upcast(x).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
