"""The plan under the expert loads of many training runs: one row per run, the straggler's time and its share of
the step.

A training run writes its router counts to ``expert_loads.json``; a grid of runs (``k3 ablate``) differs in how it
balances its experts. Each run's loads (its layers repeated over the model's MoE layers, k3.plan.loads) go through
the same plan: the straggler term is the extra expert time of the most-loaded GPU after placement by load (serving:
with replicas; training: one copy of each expert, k3.plan.plan). So a balancing method's measured imbalance reads
as time on the planned cluster, which the imbalance factor alone (docs/architecture.md#accounting) does not give.

The all-to-all term is not calibrated (k3.plan.plan.ALL_TO_ALL_CALIBRATED), so the straggler's share is of the step
without it, and the straggler without its all-to-all part. The plan's straggler rests on summed counts and a
Poisson model of one step's fluctuation; where a run kept per micro-batch counts (``expert_loads_steps.npz``), the
training table also gives the measured per-step max / mean GPU load under the plan's placement and the share of
the step it makes (p50 / p90 / max over micro-batches, beside a uniform router's at the same tokens:
k3.plan.stragglers). Those micro-batches hold the run's tokens, not K3's, so their sampling noise is the run's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from k3.plan.loads import read_loads
from k3.train.step_loads import StepLoads, read_step_loads
from k3.plan.plan import without_all_to_all
from k3.plan.stragglers import QUANTILES

LOADS = "expert_loads.json"


def is_runs_dir(root: str | Path) -> bool:
    """Whether ``root`` is a directory of runs (a grid) rather than one run or a JSON file of counts."""
    p = Path(root)
    return p.is_dir() and not (p / LOADS).is_file()


def loads_runs(root: str | Path) -> list[Path]:
    """Run directories under the directory of runs ``root`` that hold router counts, in path order."""
    return sorted(q.parent for q in Path(root).rglob(LOADS))


def step_shares(plan_step: dict, per_step: dict) -> dict:
    """The straggler's share of a training step (all-to-all left out) at each measured and uniform per-step
    max / mean GPU load of ``per_step`` (k3.plan.stragglers.step_stragglers): the expert GEMMs of the busiest GPU
    take max / mean times the balanced time."""
    _, rest = without_all_to_all(plan_step)
    balanced = rest - plan_step["straggler_s"]
    out = {}
    for kind in ("measured", "uniform"):
        ratio = per_step[kind]["rank_max_over_mean"]
        extra = {q: plan_step["expert_flops_s"] * (ratio[q] - 1) for q, _ in QUANTILES}
        out[kind] = {q: x / (balanced + x) for q, x in extra.items()}
    return out


def plan_runs(
    root: str | Path,
    layers: int,
    experts: int,
    plan_one: Callable[[np.ndarray], dict],
    per_step: Callable[[StepLoads], dict] | None = None,
) -> list[dict]:
    """One row per run under ``root``: the run's name, variant, seed and validation loss (its summary.json, where
    present), and from ``plan_one(shares [layers, experts])`` the placed max / mean GPU load and the step's
    straggler and total seconds, both without the all-to-all. With ``per_step`` (training), a run's per micro-batch
    counts give ``per_step(loads)`` and the straggler shares they make (:func:`step_shares`); None for a run with
    summed counts only. ValueError when a run's loads do not match the model or the plan does not fit."""
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
        straggler, rest = without_all_to_all(step)
        extra = {}
        if per_step is not None:
            try:
                loads = read_step_loads(run)
                if loads is not None and loads.counts.shape[2] != experts:
                    raise ValueError(f"per-step loads have {loads.counts.shape[2]} experts, the model has {experts}")
            except ValueError as e:
                raise ValueError(f"{run}: {e}") from None
            stats = None if loads is None else per_step(loads)
            extra = {"per_step": stats, "per_step_share": None if stats is None else step_shares(step, stats)}
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
                "straggler_s": straggler,
                "step_s": rest,
                "all_to_all_s": step["all_to_all_s"],
                "straggler_share": straggler / rest,
                **extra,
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
        "replicas; training: one copy of each expert), each run's measured router counts summed over its last "
        "logged steps (`expert_loads.json`) repeated over the model's MoE layers, one step's fluctuation from a "
        "Poisson model (`k3/plan/runs.py`). The all-to-all model is not calibrated (docs/plan.md), so the step "
        "and the straggler here leave it out; its uncalibrated time is in the run table.",
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
        "| run | val loss | TP, replica slots | placed max / mean GPU load | straggler ms | step ms | share | "
        "all-to-all ms (uncalibrated) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        loss = "—" if r["val_loss"] is None else f"{r['val_loss']:.3f}"
        lines.append(
            f"| {r['run']} | {loss} | {r['tensor_parallel']}, {r['replica_slots_per_gpu']} | "
            f"{r['max_over_mean_placed']:.3f} | {1e3 * r['straggler_s']:,.2f} | {1e3 * r['step_s']:,.1f} | "
            f"{pct(r['straggler_share'])} | {1e3 * r['all_to_all_s']:,.1f} |"
        )
    if any("per_step" in r for r in rows):
        lines += ["", *per_step_lines(rows)]
    return "\n".join(lines) + "\n"


def per_step_lines(rows: list[dict]) -> list[str]:
    """The per-step table: per run, the measured per micro-batch max / mean GPU load under the plan's placement and
    the straggler share of the step it makes, p50 / p90 / max, each beside a uniform router's; or that the run
    has summed counts only."""
    three = lambda d, f: " / ".join(f(d[q]) for q, _ in QUANTILES)  # noqa: E731
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    num = lambda x: f"{x:.3f}"  # noqa: E731
    with_steps = [r for r in rows if r.get("per_step")]
    lines = [
        "## Per step",
        "",
        "A straggler is set per micro-batch: each routes its own tokens and each MoE layer's all-to-all waits for "
        "its most-loaded GPU, so summed counts (above) average away what makes it. From each run's per "
        "micro-batch counts (`expert_loads_steps.npz`: its last micro-batches) on the plan's placement (by the "
        "summed counts, one copy of each expert): the busiest GPU's token-slots over the mean (mean over MoE "
        "layers) and the straggler's share of the step (all-to-all left out) it makes; p50 / p90 / max over "
        "micro-batches, beside a uniform router's at the same tokens and top-k (simulated: the floor sampling "
        "alone sets; `k3/plan/stragglers.py`).",
        "",
    ]
    if with_steps:
        s = with_steps[0]["per_step"]
        lines += [
            f"Micro-batches of {s['tokens_per_record']:,.0f} tokens (the runs', not K3's: at K3's tokens per "
            f"all-to-all the sampling floor is lower), {s['ranks']} GPUs, top-{s['top_k']} of {s['experts']}.",
            "",
        ]
    lines += [
        "| run | micro-batches | max / mean GPU load p50 / p90 / max | uniform router | straggler share | "
        "uniform router |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        st, sh = r.get("per_step"), r.get("per_step_share")
        if st is None:
            lines.append(f"| {r['run']} | summed loads only: no per-step counts | — | — | — | — |")
            continue
        lines.append(
            f"| {r['run']} | {st['records']} | {three(st['measured']['rank_max_over_mean'], num)} | "
            f"{three(st['uniform']['rank_max_over_mean'], num)} | {three(sh['measured'], pct)} | "
            f"{three(sh['uniform'], pct)} |"
        )
    return lines
