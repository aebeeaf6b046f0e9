"""Per-step stragglers from per micro-batch router counts, beside the floor a uniform router sets.

Under expert parallelism every micro-batch routes its own tokens and each MoE layer's all-to-all waits for the
most-loaded rank of that micro-batch, so the straggler is a per-micro-batch quantity: counts summed over many steps
average away the fluctuation that makes it. For a placement of the experts on R ranks (one copy of each: the
contiguous split, or placed by load from the window's summed counts as the training plan places them,
k3.plan.placement), per micro-batch and MoE layer:

- ``rank_max_over_mean``: the most-loaded rank's token-slots over the mean rank's (the MoE phase's straggler factor);
- ``hottest_over_mean``: the hottest expert's token-slots over the mean expert's;
- ``experts_over_capacity``: the share of experts given more than capacity C = ceil(1.25 T k / E) token-slots;
- ``slots_over_capacity``: the share of token-slots above C (what a capacity-limited dispatch would drop).

Each micro-batch's value is the mean over its MoE layers (every layer routes the same T k slots, so this is the
layers' summed slowest-rank load over their summed mean load). The distribution over micro-batches (p50 / p90 /
max) stands beside the same statistics of a uniform router (every token k distinct experts uniformly at random:
k3.plan.loads.simulate_routing, seeded) with the same tokens per micro-batch, top-k and placement: the floor that
sampling alone gives, which no balancer can go below on average.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from k3.model.router_stats import expert_capacity
from k3.plan.loads import simulate_routing
from k3.train.step_loads import StepLoads
from k3.plan.placement import LayerPlacement, contiguous, min_slots, place

CAPACITY_FACTOR = 1.25
STATS = ("rank_max_over_mean", "hottest_over_mean", "experts_over_capacity", "slots_over_capacity")
QUANTILES = (("p50", 50.0), ("p90", 90.0), ("max", 100.0))
PLACEMENTS = ("contiguous", "placed")
FLOOR_RECORDS = 32  # micro-batches the uniform router is simulated for (each with every MoE layer)


def layer_placements(
    loads: StepLoads, ranks: int, placement: str = "contiguous", gpus_per_node: int = 8
) -> list[LayerPlacement]:
    """One placement per MoE layer of ``loads``: ``contiguous`` (expert j on rank j // ceil(E / R)) or ``placed``
    (by the window's summed counts, one copy of each expert, as k3.plan.plan.plan_training places them)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} must be one of {', '.join(PLACEMENTS)}")
    e = loads.counts.shape[2]
    if not 1 <= ranks <= e:
        raise ValueError(f"{ranks} ranks for {e} experts: want 1..{e}")
    summed = loads.counts.sum(axis=0).astype(np.float64)
    shares = summed / summed.sum(axis=1, keepdims=True)
    if placement == "contiguous":
        return [contiguous(f, ranks) for f in shares]
    return [place(f, ranks, gpus_per_node, min_slots(e, ranks), replicate=False) for f in shares]


def _expert_ranks(placements: list[LayerPlacement], num_experts: int) -> np.ndarray:
    """[L, E]: the rank holding each expert (a placement with replicas is not a training placement)."""
    where = np.full((len(placements), num_experts), -1, dtype=np.int64)
    for i, p in enumerate(placements):
        for g, xs in enumerate(p.gpu_experts):
            where[i, xs] = g
    if (where < 0).any() or any(max(p.replicas) > 1 for p in placements):
        raise ValueError("per-step stragglers need a placement holding each expert exactly once")
    return where


def record_stats(counts: np.ndarray, where: np.ndarray, ranks: int, top_k: int) -> dict[str, np.ndarray]:
    """The statistics of the module docstring for counts [N, L, E] under ``where`` [L, E] (expert -> rank): each
    [N], the mean over layers."""
    n, layers, e = counts.shape
    c = counts.astype(np.float64)
    onehot = np.zeros((layers, e, ranks))
    onehot[np.arange(layers)[:, None], np.arange(e)[None, :], where] = 1.0
    rank_load = np.einsum("nle,ler->nlr", c, onehot)  # [N, L, R]
    slots = c.sum(axis=2)  # [N, L] = T k
    tokens = np.rint(slots / top_k).astype(np.int64)
    cap = np.vectorize(lambda t: expert_capacity(CAPACITY_FACTOR, int(t), top_k, e))(tokens)[..., None]
    per_layer = {
        "rank_max_over_mean": rank_load.max(axis=2) / (slots / ranks),
        "hottest_over_mean": c.max(axis=2) / (slots / e),
        "experts_over_capacity": (c > cap).mean(axis=2),
        "slots_over_capacity": np.clip(c - cap, 0, None).sum(axis=2) / slots,
    }
    return {k: v.mean(axis=1) for k, v in per_layer.items()}


@functools.lru_cache(maxsize=8)
def _uniform_counts(tokens: tuple, layers: int, num_experts: int, top_k: int, seed: int) -> np.ndarray:
    return uniform_counts(np.asarray(tokens), layers, num_experts, top_k, seed)


def uniform_counts(tokens: np.ndarray, layers: int, num_experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """A uniform router's counts [N, layers, E] for ``tokens`` [N] tokens per micro-batch (seeded)."""
    g = torch.Generator().manual_seed(seed)
    zero = torch.zeros(num_experts, dtype=torch.float64)
    out = np.zeros((len(tokens), layers, num_experts), dtype=np.int64)
    for n, t in enumerate(tokens):
        for i in range(layers):
            out[n, i] = simulate_routing(zero, int(t), top_k, g).numpy()
    return out


def distribution(values: np.ndarray) -> dict[str, float]:
    """p50 / p90 / max of per-micro-batch values."""
    return {name: float(np.percentile(values, q)) for name, q in QUANTILES}


def step_stragglers(
    loads: StepLoads,
    ranks: int,
    placement: str = "contiguous",
    gpus_per_node: int = 8,
    seed: int = 0,
    floor_records: int = FLOOR_RECORDS,
) -> dict:
    """Per-step stragglers of ``loads`` on ``ranks`` ranks (see the module docstring): the distribution of each
    statistic over the micro-batches, measured and under a uniform router, and the rank max / mean of the
    window's summed counts (what a summed ``expert_loads.json`` shows) on the same placement."""
    counts = loads.counts
    n, layers, e = counts.shape
    placements = layer_placements(loads, ranks, placement, gpus_per_node)
    where = _expert_ranks(placements, e)
    measured = record_stats(counts, where, ranks, loads.top_k)
    tokens = np.rint(loads.tokens).astype(np.int64)
    pick = np.linspace(0, n - 1, min(n, floor_records)).round().astype(np.int64)  # spread over the window
    uniform = _uniform_counts(tuple(int(t) for t in tokens[pick]), layers, e, loads.top_k, seed)  # per placement
    floor = record_stats(uniform, where, ranks, loads.top_k)
    return {
        "ranks": ranks,
        "placement": placement,
        "records": n,
        "steps": int(len(np.unique(loads.steps))),
        "layers": layers,
        "experts": e,
        "top_k": loads.top_k,
        "tokens_per_record": float(tokens.mean()),
        "floor_records": len(pick),
        "summed_rank_max_over_mean": float(np.mean([p.max_over_mean for p in placements])),
        "measured": {k: distribution(v) for k, v in measured.items()},
        "uniform": {k: distribution(v) for k, v in floor.items()},
    }


def cell(result: dict | None, stat: str = "rank_max_over_mean", pct: bool = False) -> str:
    """A table cell: the measured p50 / p90 / max of ``stat`` and the uniform router's, or, for a run with only
    summed counts, that it has none."""
    if result is None:
        return "summed loads only: no per-step counts"
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.3f}")
    m, u = result["measured"][stat], result["uniform"][stat]
    return " / ".join(f(m[q]) for q, _ in QUANTILES) + " (uniform " + " / ".join(f(u[q]) for q, _ in QUANTILES) + ")"
