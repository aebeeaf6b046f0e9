"""What scales a training step from outside the optimiser: the learning-rate schedule (linear warmup, then cosine
to a floor; docs/decisions.md, "Schedule") and the global gradient-norm clip."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor, nn


def cosine_schedule(step: int, total_steps: int, warmup_frac: float = 0.01, min_ratio: float = 0.1) -> float:
    """lr multiplier for 0-based optimiser step ``step``.

    Linear warmup over W = max(1, round(warmup_frac * total_steps)) steps: (step + 1) / W, so step 0 uses 1/W
    and step W - 1 uses 1. Then cosine from 1 at step W - 1 down to ``min_ratio`` at the last step
    total_steps - 1; later steps stay at ``min_ratio``.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps} must be positive")
    warmup = max(1, round(warmup_frac * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    span = total_steps - warmup  # steps W-1 .. total-1
    progress = min(1.0, (step - warmup + 1) / span) if span > 0 else 1.0
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    opt: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.01, min_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR with :func:`cosine_schedule`; call ``scheduler.step()`` after every ``opt.step()``."""
    fn = partial(cosine_schedule, total_steps=total_steps, warmup_frac=warmup_frac, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


def clip_grad_norm(model_or_params, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip the global gradient norm (``torch.nn.utils.clip_grad_norm_``); returns the norm before clipping."""
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
