"""Helpers the tests share."""

import torch


def rel(a, b) -> float:
    """Relative error ||a - b|| / ||b||, computed in fp64 (||a - b|| itself where b is zero)."""
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    nb = float(b.norm())
    diff = float((a - b).norm())
    return diff / nb if nb > 0 else diff
