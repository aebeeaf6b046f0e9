"""The plan under the expert loads of many training runs: one row per run, the straggler's time and its share of
the step.

A training run writes its router counts to ``expert_loads.json``; a grid of runs (``k3 ablate``) differs in how it
balances its experts. Each run's loads (its layers repeated over the model's MoE layers, k3.plan.loads) go through
the same plan: the straggler term is the extra expert time of the most-loaded GPU after placement by load (serving:
with replicas; training: one copy of each expert, k3.plan.plan). So a balancing method's measured imbalance reads
as time on the planned cluster, which the imbalance factor alone (docs/architecture.md#accounting) does not give.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from k3.plan.loads import read_loads

LOADS = "expert_loads.json"


def is_runs_dir(root: str | Path) -> bool:
    """Whether ``root`` is a directory of runs (a grid) rather than one run or a JSON file of counts."""
    p = Path(root)
    return p.is_dir() and not (p / LOADS).is_file()


def loads_runs(root: str | Path) -> list[Path]:
    """Run directories under the directory of runs ``root`` that hold router counts, in path order."""
    return sorted(q.parent for q in Path(root).rglob(LOADS))


def plan_runs(root: str | Path, layers: int, experts: int, plan_one: Callable[[np.ndarray], dict]) -> list[dict]:
    """One row per run under ``root``: the run's name, variant, seed and validation loss (its summary.json, where
    present), and from ``plan_one(shares [layers, experts])`` the placed max / mean GPU load and the step's
    straggler and total seconds. ValueError when a run's loads do not match the model or the plan does not fit."""
    runs = loads_runs(root)
    if not runs:
        raise ValueError(f"expert loads: no run under {root} holds {LOADS}")
    rows = []
    for run in runs:
        try:
            plan = plan_one(read_loads(run, layers, experts).numpy())
            meta = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        except ValueError as e:  # also a summary.json that is not JSON
            raise ValueError(f"{run}: {e}") from None
        if not plan["fits"]:
            mem = plan["memory_gib"]
            why = plan.get("why") or f"{mem['total']:.1f} GiB per GPU needed, {mem['hbm']:.1f} GiB held"
            raise ValueError(f"the model does not fit this cluster: {why}")
        step = plan.get("decode") or plan["step"]
        name = str(run.relative_to(root))
        layout = plan["layout"]
        rows.append(
            {
                "run": name,
                # runs of one variant differ by seed: the variant (its summary's, else the name without "-sN")
                "variant": meta.get("variant", re.sub(r"-s\d+$", "", run.name)),
                "seed": meta.get("seed"),
                "val_loss": meta.get("val_loss"),
                "tensor_parallel": layout.get("tensor_parallel", 1),
                "replica_slots_per_gpu": layout.get("replica_slots_per_gpu", 0),
                "max_over_mean_placed": plan["load"]["max_over_mean_after"]["mean"],
                "straggler_s": step["straggler_s"],
                "step_s": step["step_s"],
                "straggler_share": step["straggler_s"] / step["step_s"],
            }
        )
    return rows


def by_variant(rows: list[dict]) -> list[dict]:
    """Per variant (first-seen order): runs, and the mean, min and max over its runs of the straggler's share."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["variant"], []).append(r)
    out = []
    for variant, rs in groups.items():
        share = [r["straggler_share"] for r in rs]
        out.append(
            {
                "variant": variant,
                "runs": len(rs),
                "straggler_ms": 1e3 * float(np.mean([r["straggler_s"] for r in rs])),
                "share_mean": float(np.mean(share)),
                "share_min": min(share),
                "share_max": max(share),
            }
        )
    return out


def runs_markdown(rows: list[dict], title: str, command: str, settings: str) -> str:
    """The per-variant and per-run tables under ``title``, the ``command`` that made them and the workload's
    ``settings``."""
    pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
    lines = [
        f"# {title}",
        "",
        f"`{command}`: {settings}",
        "",
        "Straggler: the most-loaded GPU's extra expert time in a step after experts are placed by load (serving: with "
        "replicas; training: one copy of each expert), each run's measured router counts (`expert_loads.json`) "
        "repeated over the model's MoE layers (`k3/plan/runs.py`).",
        "",
        "| variant | runs | straggler ms / step | share of the step: mean (min .. max) |",
    ]
    lines.append("|---|---|---|---|")
    for v in by_variant(rows):
        lines.append(
            f"| `{v['variant']}` | {v['runs']} | {v['straggler_ms']:,.2f} | {pct(v['share_mean'])} "
            f"({pct(v['share_min'])} .. {pct(v['share_max'])}) |"
        )
    lines += [
        "",
        "| run | val loss | TP, replica slots | placed max / mean GPU load | straggler ms | step ms | share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        loss = "—" if r["val_loss"] is None else f"{r['val_loss']:.3f}"
        lines.append(
            f"| {r['run']} | {loss} | {r['tensor_parallel']}, {r['replica_slots_per_gpu']} | "
            f"{r['max_over_mean_placed']:.3f} | {1e3 * r['straggler_s']:,.2f} | {1e3 * r['step_s']:,.1f} | "
            f"{pct(r['straggler_share'])} |"
        )
    return "\n".join(lines) + "\n"
