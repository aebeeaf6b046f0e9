"""Expert load statistics for planning: each MoE layer's share of token-slots per expert.

A *share* vector f [E] sums to 1: expert j receives T k f_j of the T k token-slots of a step in expectation. It
comes from a training run's router counts (``expert_loads.json``, written by the trainer beside its plots), from
any JSON of counts, or from a synthetic skew: expert popularity ~ rank^-s (Zipf). A token takes k *distinct*
experts, so no expert can take more than 1/k of the slots. :func:`simulate_routing` draws actual routes, to check
what the planner predicts from shares alone.

Summed counts hide what sets a straggler: each micro-batch routes its own tokens, and its slowest rank waits for
the hottest experts of that micro-batch. So the trainer also keeps per micro-batch counts (:class:`StepLoads`,
``expert_loads_steps.npz``; read by k3.plan.stragglers).
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from k3.convert.atomic import atomic_file

STEP_LOADS = "expert_loads_steps.npz"
# micro-batches the trainer keeps per-step counts of (the most recent ones): 100 x K3's 92 MoE layers x 896
# experts is 16 MiB of uint16 counts before compression
STEP_WINDOW = 100


@dataclass
class StepLoads:
    """Per micro-batch router counts: ``counts`` [N, L, E] (token-slots of expert e in MoE layer ``layers[l]`` in
    micro-batch n, this process's tokens), ``steps`` / ``micro`` [N] the optimizer step and micro-batch index of
    each record, ``top_k`` the experts per token (so micro-batch n routed ``counts[n, l].sum() / top_k`` tokens)."""

    counts: np.ndarray
    steps: np.ndarray
    micro: np.ndarray
    layers: np.ndarray
    top_k: int

    def __post_init__(self) -> None:
        c = self.counts
        if c.ndim != 3 or c.shape[0] != len(self.steps) or c.shape[0] != len(self.micro):
            raise ValueError(f"per-step loads: counts {c.shape} do not match {len(self.steps)} step records")
        if c.shape[1] != len(self.layers) or not self.top_k >= 1:
            raise ValueError(f"per-step loads: counts {c.shape} do not match {len(self.layers)} layers, top-k >= 1")
        if c.shape[0] == 0 or (c < 0).any() or (c.sum(axis=2) <= 0).any():
            raise ValueError("per-step loads: need at least one record, non-negative counts, tokens in every layer")

    @property
    def tokens(self) -> np.ndarray:
        """Tokens each record routed, [N] (the mean over its layers: every layer routes the same tokens)."""
        return self.counts.sum(axis=2).mean(axis=1) / self.top_k


def write_step_loads(path: str | Path, loads: StepLoads) -> None:
    """``loads`` as a compressed .npz, atomically; counts as uint16 when they fit (a micro-batch under 65,536
    tokens: an expert takes each token at most once), else uint32."""
    c = loads.counts
    dtype = np.uint16 if int(c.max(initial=0)) < 2**16 else np.uint32
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(
            f,
            counts=c.astype(dtype),
            steps=np.asarray(loads.steps, dtype=np.int64),
            micro=np.asarray(loads.micro, dtype=np.int64),
            layers=np.asarray(loads.layers, dtype=np.int64),
            top_k=np.int64(loads.top_k),
        )


def read_step_loads(path: str | Path) -> StepLoads | None:
    """The per-step loads of a run directory (its ``expert_loads_steps.npz``) or of a .npz file; None when the run
    has none (it predates them: only summed ``expert_loads.json``). ValueError naming the file if it is not one."""
    p = Path(path)
    if p.is_dir():
        p = p / STEP_LOADS
    if not p.is_file():
        return None
    try:
        with np.load(p) as z:
            out = StepLoads(z["counts"].astype(np.int64), z["steps"], z["micro"], z["layers"], int(z["top_k"]))
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"per-step loads: {p} is not a per-step loads file ({e})") from None
    return out


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
