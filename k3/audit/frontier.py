"""The router frontier from trained routers: what each balancing run's measured expert loads cost at serving and
training scale, next to its validation loss.

Per run (an ablation run that differs from ``full`` only in balancing), from its metrics (the mean of the last
steps, :func:`k3.audit.runs.summarise_history`): validation loss; MaxVio in its three forms (global batch,
micro-batch, per sequence); the share of token-slots over capacity at capacity factor 1.0 and 1.25. From its
router counts (``expert_loads.json``: the token-slots each expert received over the last logged steps, per MoE
layer; shares f_j = count_j / sum), for a step of T tokens with top-k:

- padding: expert j's expected rows T k f_j padded up to a multiple of A (8: the grouped-GEMM alignment; 128: a
  tile), the padded rows' share of all rows;
- expert parallelism over G ranks, experts placed contiguously (expert j on rank j // (E / G)): the rank load
  imbalance max_r F_r / mean_r F_r with F_r the rank's share, which is the straggler factor of the MoE phase (the
  slowest rank sets its time); and the remote ranks a token's dispatch reaches, sum_r 1 - (1 - F_r)^k (its k
  experts taken as independent draws from the shares), times 2 (dispatch and combine) x the latent width x 2
  bytes for the all-to-all bytes per token per layer.

Means over MoE layers. An estimate from measured loads, not a measured all-to-all.

Summed counts average away the per-micro-batch fluctuation that makes a straggler, so beside them, where the run
kept per micro-batch counts (``expert_loads_steps.npz``), each row has the per-step statistics of
k3.plan.stragglers under the same contiguous placement (``step_ep{G}``: p50 / p90 / max over micro-batches, with
a uniform router's floor for the same tokens); ``step_ep{G}`` is None for a run with summed counts only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from k3.train.step_loads import read_step_loads
from k3.plan.placement import contiguous
from k3.plan.stragglers import step_stragglers

EP_RANKS = (8, 64)
ALIGNS = (8, 128)


def read_shares(run_dir: str | Path) -> list[np.ndarray]:
    """Per MoE layer the experts' shares of token-slots from ``RUN/expert_loads.json`` ([] when absent)."""
    path = Path(run_dir) / "expert_loads.json"
    if not path.is_file():
        return []
    layers = json.loads(path.read_text()).get("layers", {})
    out = []
    for counts in layers.values():
        c = np.asarray(counts, dtype=np.float64)
        if c.size and c.sum() > 0:
            out.append(c / c.sum())
    return out


def padding_share(shares: np.ndarray, tokens: int, k: int, align: int) -> float:
    """Padded rows' share of all rows when expert j's T k f_j rows are padded to a multiple of ``align``."""
    rows = tokens * k * shares
    padded = np.ceil(rows / align) * align
    return float((padded - rows).sum() / padded.sum())


def rank_shares(shares: np.ndarray, ranks: int) -> np.ndarray:
    """Each rank's share of the layer's token-slots with the experts placed contiguously (E / ranks a rank)."""
    return np.asarray(contiguous(shares, ranks).gpu_load)


def layer_costs(shares: np.ndarray, tokens: int, k: int, latent: int, act_bytes: int = 2) -> dict:
    """The costs of one layer's shares (see the module docstring)."""
    out = {f"padding_{a}": padding_share(shares, tokens, k, a) for a in ALIGNS}
    for g in EP_RANKS:
        if len(shares) < g:
            continue
        f = rank_shares(shares, g)
        out[f"imbalance_ep{g}"] = float(f.max() / f.mean())
        hit = float((1 - (1 - f) ** k).sum())
        out[f"a2a_bytes_ep{g}"] = 2 * hit * (g - 1) / g * latent * act_bytes
    return out


def trained_frontier(summaries: list[dict], tokens: int, k: int, latent: int) -> list[dict]:
    """One row per run whose directory holds router counts, with its metrics and the layer-mean costs."""
    rows = []
    for s in summaries:
        shares = read_shares(s.get("run_dir", ""))
        if not shares:
            continue
        costs = [layer_costs(f, tokens, k, latent) for f in shares]
        row = {
            key: s.get(key)
            for key in ("variant", "seed", "val_loss", "maxvio", "maxvio_micro", "maxvio_seq", "drop_cf1", "drop_cf125")
        }
        row["layers"] = len(shares)
        for key in costs[0]:
            row[key] = float(np.mean([c[key] for c in costs]))
        steps = read_step_loads(s["run_dir"])
        for g in EP_RANKS:
            if len(shares[0]) >= g:
                row[f"step_ep{g}"] = None if steps is None else step_stragglers(steps, g)
        rows.append(row)
    return rows
