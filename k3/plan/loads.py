"""Expert load statistics for planning: each MoE layer's share of token-slots per expert.

A *share* vector f [E] sums to 1: expert j receives T k f_j of the T k token-slots of a step in expectation. It
comes from a training run's router counts (``expert_loads.json``, written by the trainer beside its plots), from
any JSON of counts, or from a synthetic skew: expert popularity ~ rank^-s (Zipf). A token takes k *distinct*
experts, so no expert can take more than 1/k of the slots. :func:`simulate_routing` draws actual routes, to check
what the planner predicts from shares alone.

Summed counts hide what sets a straggler: each micro-batch routes its own tokens, and its slowest rank waits for
the hottest experts of that micro-batch. So the trainer also keeps per micro-batch counts (:class:`StepLoads`,
``expert_loads_steps.npz``, k3.train.step_loads; read by k3.plan.stragglers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor


def simulate_routing(log_weights: Tensor, tokens: int, k: int, generator: torch.Generator) -> Tensor:
    """Route ``tokens`` simulated tokens, each to k distinct experts drawn without replacement with probabilities
    proportional to exp(log_weights) (Gumbel top-k, which is sequential sampling without replacement).
    log_weights [E] -> counts [E] int64 (summing to tokens * k)."""
    e = log_weights.numel()
    counts = torch.zeros(e, dtype=torch.int64)
    for start in range(0, tokens, 8192):  # bounded memory for large token counts
        n = min(8192, tokens - start)
        u = torch.rand(n, e, generator=generator, dtype=torch.float64).clamp_min(1e-300)
        idx = torch.topk(log_weights.double() - torch.log(-torch.log(u)), k, dim=-1).indices
        counts += torch.bincount(idx.reshape(-1), minlength=e)
    return counts


def zipf_shares(num_layers: int, num_experts: int, k: int, s: float, seed: int = 0) -> Tensor:
    """Shares [L, E] (rows sum to 1) with popularity rank^-s, experts shuffled per layer; s = 0 is uniform (what
    Quantile Balancing aims at). A token takes k distinct experts, so no share exceeds 1/k: the excess of capped
    experts is spread over the others in proportion (water-filling)."""
    if not s >= 0 or not math.isfinite(s):
        raise ValueError(f"--zipf={s!r} must be a finite number >= 0")
    if not 0 < k <= num_experts:
        raise ValueError(f"top-k {k} must be in 1..{num_experts}")
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-s)
    f = base / base.sum()
    capped = torch.zeros(num_experts, dtype=torch.bool)
    while bool((f > 1 / k + 1e-15).any()):
        capped |= f > 1 / k
        free = (1 - capped.sum() / k) / base[~capped].sum()
        f = torch.where(capped, torch.full_like(f, 1 / k), base * free)
    return torch.stack([f[torch.randperm(num_experts, generator=g)] for _ in range(num_layers)])


def shares_from_counts(counts: dict[int, list[float]] | list[list[float]], num_layers: int, num_experts: int) -> Tensor:
    """Shares [num_layers, E] from per-layer counts (a list, or {layer: counts}); fewer layers than the model's
    repeat in order (a small run's statistics stand for a larger model's layers). Counts must have E entries."""
    rows = list(counts.values()) if isinstance(counts, dict) else list(counts)
    if not rows:
        raise ValueError("expert loads: no layer has counts")
    out = []
    for i, row in enumerate(rows):
        t = torch.tensor([float(x) for x in row], dtype=torch.float64)
        if t.numel() != num_experts:
            raise ValueError(f"expert loads: layer {i} has {t.numel()} experts, the model has {num_experts}")
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()) or float(t.sum()) <= 0:
            raise ValueError(f"expert loads: layer {i} needs finite, non-negative counts with a positive sum")
        out.append(t / t.sum())
    return torch.stack([out[i % len(out)] for i in range(num_layers)])


def read_loads(path: str | Path, num_layers: int, num_experts: int) -> Tensor:
    """Shares from ``path``: a run directory (its ``expert_loads.json``) or a JSON file holding
    ``{"layers": {layer: [counts...]}}``, ``{layer: [counts...]}`` or ``[[counts...], ...]``."""
    p = Path(path)
    if p.is_dir():
        p = p / "expert_loads.json"
    if not p.is_file():
        raise ValueError(f"expert loads: {p} not found (a training run writes expert_loads.json)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"expert loads: {p} is not JSON ({e})") from None
    if isinstance(data, dict) and "layers" in data:
        data = data["layers"]
    if isinstance(data, dict):
        data = {int(k): v for k, v in sorted(data.items(), key=lambda kv: int(kv[0]))}
    return shares_from_counts(data, num_layers, num_experts)
