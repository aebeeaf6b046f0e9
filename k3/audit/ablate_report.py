"""The report of an ablation grid: tables (report.md, results.json) and plots (validation loss, router frontier,
loss curves, MQAR recall). Written from whatever runs are on disk; see :mod:`k3.audit.ablate`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from k3.plan.stragglers import cell  # noqa: E402
from k3.train.plots import ema  # noqa: E402
from k3.train.trainer import read_metrics  # noqa: E402

# ---------------------------------------------------------------------------------------------------- report


def finite(x) -> bool:
    """A real number (not a bool, NaN or inf): what a metrics record holds when its value can be averaged."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if finite(x)]
    if not xs:
        return None, None
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else None


def aggregate(summaries: list[dict]) -> list[dict]:
    """Per variant (in order of first appearance): mean / std over seeds."""
    order: dict[str, list[dict]] = {}
    for s in summaries:
        order.setdefault(s["variant"], []).append(s)
    rows = []
    for name, runs in order.items():
        row = {
            "variant": name,
            "seeds": [r["seed"] for r in runs],
            "balance": runs[0].get("balance"),
            "model_overrides": runs[0].get("overrides", {}),
            "description": runs[0].get("description", ""),
            "params_total": runs[0].get("params_total"),
            "params_activated": runs[0].get("params_activated"),
            "params_moe_activated": runs[0].get("params_moe_activated"),
            "tokens": runs[0].get("tokens"),
            "diverged": sum(1 for r in runs if r.get("status") == "diverged"),
        }
        for key in ("val_loss", "val_bpb", "maxvio", "dead_experts", "wall_s", "train_loss_tail"):
            row[f"{key}_mean"], row[f"{key}_std"] = _mean_std([r.get(key) for r in runs])
        rows.append(row)
    # paired difference to `full` over the seeds both have (a seed fixes the data order and subset for every
    # variant, so the paired spread is much smaller than the spread of either)
    full = {r["seed"]: r.get("val_loss") for r in order.get("full", [])}
    for row in rows:
        deltas = [
            r["val_loss"] - full[r["seed"]]
            for r in order[row["variant"]]
            if finite(r.get("val_loss")) and finite(full.get(r["seed"]))
        ]
        row["delta_vs_full_mean"], row["delta_vs_full_std"] = _mean_std(deltas) if full else (None, None)
    return rows


def ci_evidence(summaries: list[dict], sweep: list[dict], factors: tuple[str, ...] = ()) -> dict:
    """The grid's interval estimates (k3.audit.stats): each variant's validation-loss difference to ``full``
    (paired t-interval over seeds, n - 1 df, 95%), and with ``factors`` (a full 2^k grid of their removals) the
    main effects and two-factor interactions of the pooled-variance model; ``lr_sweep``: the learning-rate runs
    (variant, lr, seed, val loss)."""
    from k3.audit.stats import factorial_effects, paired_difference

    by: dict[str, dict] = {}
    for s in summaries:
        if s.get("status") == "done" and finite(s.get("val_loss")):
            by.setdefault(s["variant"], {})[s["seed"]] = s["val_loss"]
    diffs = {v: paired_difference(by["full"], seeds) for v, seeds in by.items() if v != "full"} if "full" in by else {}
    effects: dict = {}
    if factors:
        cells = {frozenset(() if v == "full" else v.split("+")): seeds for v, seeds in by.items()}
        try:
            effects = factorial_effects({c: v for c, v in cells.items() if c <= set(factors)}, factors)
        except ValueError as e:  # runs still missing: the report says which
            effects = {"error": str(e)}
    keys = ("variant", "lr", "seed", "val_loss", "status")
    return {
        "difference_vs_full": diffs,
        "factorial": effects,
        "lr_sweep": [{k: s.get(k) for k in keys} for s in sweep],
    }


def _ci(c: dict, digits: int = 3) -> str:
    if c.get("lo") is None:
        return "—"
    return f"[{c['lo']:+.{digits}f}, {c['hi']:+.{digits}f}]"


def _df(c: dict) -> str:
    return "—" if c.get("lo") is None or c.get("df") is None else str(c["df"])


def _evidence_lines(ev: dict) -> list[str]:
    lines: list[str] = []
    diffs = ev.get("difference_vs_full") or {}
    if diffs:
        from k3.audit.stats import t_quantile

        level = next((c["level"] for c in diffs.values() if c.get("level")), "95%")
        p = 0.5 + float(level.rstrip("%")) / 200
        ts = ", ".join(
            f"t = {t_quantile(p, df):.2f} with {df + 1} seeds"
            for df in sorted({c["df"] for c in diffs.values() if c.get("lo") is not None})
        )
        lines += [
            f"## Differences to `full` ({level} paired t-intervals over seeds)",
            "",
            "Validation loss of the variant minus `full`'s, seed by seed; the interval is the mean of the n paired "
            f"differences +/- t(n - 1 df) x their standard error, at {level}" + (f" ({ts})" if ts else "") + ": "
            "few seeds make wide intervals. An interval that excludes 0 is a difference at this scale and budget.",
            "",
            f"| variant | Δ val loss | {level} interval (paired t) | n | df |",
            "|---|---|---|---|---|",
        ]
        for v, c in diffs.items():
            d = "—" if c["mean"] is None else f"{c['mean']:+.3f}"
            lines.append(f"| `{v}` | {d} | {_ci(c)} | {c['n']} | {_df(c)} |")
        lines.append("")
    fx = ev.get("factorial") or {}
    if fx:
        lines += ["## Factorial effects (16 variants)", ""]
        if "error" in fx:
            lines += [f"Not computed yet: {fx['error']}.", ""]
        else:
            first = next(iter(fx.values()))
            level, df = first["level"], first["df"]
            lines += [
                "Main effect of a removal: mean validation loss of the 8 variants with it minus the 8 without; "
                "interaction of two: mean of the variants with both or neither minus the mean with exactly one "
                "(half the gap between removing both and the sum of removing each). All from one least-squares "
                "model of every run (+/-1 coding: main effects, two-factor interactions and a block per seed; "
                "the three- and four-factor interactions stay in the residual), whose residual variance is pooled "
                f"over the grid: {first['method']}; {level} t-intervals.",
                "",
                f"| effect | estimate | SE | {level} interval (t, {df} df) |",
                "|---|---|---|---|",
            ]
            for name, c in fx.items():
                lines.append(f"| {name} | {c['mean']:+.3f} | {c['se']:.4f} | {_ci(c)} |")
            lines.append("")
    sweep = ev.get("lr_sweep") or []
    if sweep:
        lrs = sorted({r["lr"] for r in sweep})
        table: dict[str, dict] = {}
        for r in sweep:
            table.setdefault(r["variant"], {})[r["lr"]] = r
        lines += [
            "## Learning rates",
            "",
            f"Every variant at each rate with seed {sweep[0]['seed']}; the lowest final validation loss (bold) is "
            "the rate its other seeds ran at.",
            "",
            "| variant | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
            "|---|" + "---|" * len(lrs),
        ]
        edge = []
        for v, row in table.items():
            done = {lr: r["val_loss"] for lr, r in row.items() if r.get("status") == "done" and finite(r["val_loss"])}
            best = min(done, key=done.get) if done else None
            if best is not None and len(lrs) > 1 and best in (lrs[0], lrs[-1]):
                edge.append(f"`{v}` ({best:g})")
            cells = []
            for lr in lrs:
                r = row.get(lr)
                text = "—" if r is None else (_fmt(r["val_loss"]) if finite(r.get("val_loss")) else str(r["status"]))
                cells.append(f"**{text}**" if lr == best else text)
            lines.append(f"| `{v}` | " + " | ".join(cells) + " |")
        lines.append("")
        if edge:  # the best rate may lie outside the grid for these
            lines += [f"Best at the edge of the swept rates (the optimum may lie beyond it): {', '.join(edge)}.", ""]
    return lines


def _trained_frontier_lines(rows: list[dict]) -> list[str]:
    """The table of k3.audit.frontier.trained_frontier: each balancing run's loss next to what its loads cost."""
    if not rows:
        return []
    pct = lambda x: "—" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    ep = [g for g in (8, 64) if any(f"imbalance_ep{g}" in r for r in rows)]
    head = ["run", "val loss", "MaxVio batch / micro / seq", "over cap 1.0 / 1.25", "padding 8 / 128"]
    head += [f"EP {g}: imbalance, all-to-all KiB" for g in ep]
    step_ep = [g for g in ep if any(f"step_ep{g}" in r for r in rows)]
    head += [f"EP {g} per step: max / mean rank p50 / p90 / max" for g in step_ep]
    if step_ep:
        head += ["per step: hottest / mean expert", "per step: experts over cap 1.25"]
    lines = [
        "### Router frontier from the trained routers",
        "",
        "Per balancing run: its validation loss, MaxVio in three forms and the token-slots over capacity (means "
        "of the last steps), and from its router counts (`expert_loads.json`) the padding share of a step's "
        "expert rows, the rank imbalance (max / mean: the MoE phase's straggler factor) and the all-to-all bytes "
        "per token per MoE layer under expert parallelism with contiguous placement (`k3/audit/frontier.py`; "
        "estimates from measured loads).",
        "",
    ]
    if step_ep:
        lines += [
            "Summed counts average away the per-micro-batch fluctuation that makes a straggler; the per-step "
            "columns are from each run's per micro-batch counts (`expert_loads_steps.npz`, the last micro-batches "
            "of the run): p50 / p90 / max over micro-batches, the mean over MoE layers, same contiguous placement, "
            "beside a uniform router's (same tokens per micro-batch and top-k, simulated: the sampling floor) "
            "(`k3/plan/stragglers.py`).",
            "",
        ]
    lines += [
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
    ]
    for r in rows:
        cells = [
            f"`{r['variant']}` s{r['seed']}",
            _fmt(r.get("val_loss")),
            " / ".join(_fmt(r.get(key), 2) for key in ("maxvio", "maxvio_micro", "maxvio_seq")),
            f"{pct(r.get('drop_cf1'))} / {pct(r.get('drop_cf125'))}",
            f"{pct(r.get('padding_8'))} / {pct(r.get('padding_128'))}",
        ]
        for g in ep:
            imb, a2a = r.get(f"imbalance_ep{g}"), r.get(f"a2a_bytes_ep{g}")
            cells.append("—" if imb is None else f"{imb:.2f}, {a2a / 1024:.1f}")
        for g in step_ep:
            cells.append(cell(r.get(f"step_ep{g}")))
        if step_ep:
            first = r.get(f"step_ep{step_ep[0]}")
            cells += [cell(first, "hottest_over_mean"), cell(first, "experts_over_capacity", pct=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _fmt(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _pm(mean, std, digits: int = 3) -> str:
    if mean is None:
        return "—"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{mean:.{digits}f}"


def _count(n) -> str:
    if n is None:
        return "—"
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _mqar_rows(mqar_results: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in mqar_results:
        groups.setdefault((r["variant"], r["task"]["num_pairs"]), []).append(r)
    rows = []
    for (variant, pairs), rs in groups.items():
        acc, acc_std = _mean_std([r["accuracy"] for r in rs])
        rows.append(
            {
                "variant": variant,
                "num_pairs": pairs,
                "accuracy_mean": acc,
                "accuracy_std": acc_std,
                "seeds": len(rs),
                "chance": rs[0]["chance"],
                "steps": rs[0]["steps"],
                "params": rs[0]["params"],
                "layers": rs[0]["layers"],
                "task": rs[0]["task"],
                "train_s": float(np.mean([r["train_s"] for r in rs])),
            }
        )
    return rows


def write_report(
    out: Path,
    grid,
    summaries: list[dict],
    rows: list[dict],
    mqar_results: list[dict],
    data: str | None = None,
    missing: list[str] | None = None,
    evidence: dict | None = None,
    frontier_rows: list[dict] | None = None,
) -> Path:
    """Write the report of ``grid`` (a k3.audit.grids.Grid) under ``out``; returns report.md's path."""
    out = Path(out)
    plot_val_loss(rows, out / "val_loss.png", (evidence or {}).get("difference_vs_full"))
    frontier = [r for r in rows if not r["model_overrides"]]
    if frontier:
        plot_router_frontier(summaries, frontier, out / "router_frontier.png")
    if any((Path(s["run_dir"]) / "metrics.jsonl").is_file() for s in summaries):  # else keep the curves drawn
        plot_loss_curves(summaries, out / "loss_curves.png")
    mrows = _mqar_rows(mqar_results)
    if mrows:
        plot_mqar(mrows, out / "mqar.png")
    t = grid.train
    tokens = rows[0]["tokens"] if rows else 0
    lines = [
        f"# Ablation grid `{grid.name}`",
        "",
        f"{grid.description}. Base model: preset `{grid.preset}`"
        + (f" with {json.dumps(grid.overrides)}" if grid.overrides else "")
        + f"; data: {data or 'the Python standard library sources'}; one shared BPE tokenizer "
        f"(vocab {t.get('vocab_size')}). Every run: {t.get('steps')} steps of {t.get('batch_size')} x "
        f"{t.get('seq_len')} tokens ({tokens:,} tokens), "
        + (f"lr per variant from {', '.join(f'{x:g}' for x in grid.lrs)}" if grid.lrs else f"lr {t.get('lr', 3e-3)}")
        + f", seeds {', '.join(map(str, grid.seeds))}"
        + (
            "; steps scaled per variant so every variant trains on full's FLOPs (attention counted)"
            if grid.match == "flops"
            else ""
        )
        + ".",
        "",
        "Validation loss (nats/token) and bits/byte are the final evaluation; MaxVio is the global-batch MaxVio "
        "(max load / mean load - 1, mean over MoE layers) averaged over the last steps; dead = experts with no "
        "token in a step, summed over layers, same average; wall = seconds per run (runs started with `--jobs` share "
        "the machine, so wall is not a speed comparison); params are counted on the "
        "meta device (activated: per token, input embedding excluded). ± is the standard deviation over seeds; "
        "Δ vs full is paired by seed (a seed fixes the data order for every variant).",
        "",
    ]
    hw = sorted({s["hardware"] for s in summaries if s.get("hardware")})
    if hw:
        lines += [f"Trained on: {'; '.join(hw)}.", ""]
    if missing:
        lines += [
            f"**Not finished yet ({len(missing)}; left out of every table):** "
            + ", ".join(f"`{m}`" for m in missing)
            + ".",
            "",
        ]
    lines += [
        "| variant | balance | val loss | Δ vs full | bits/byte | MaxVio | dead | total params | activated | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flag = f" ({r['diverged']} diverged)" if r["diverged"] else ""
        delta = r.get("delta_vs_full_mean")
        delta_s = (
            "—"
            if delta is None
            else (f"{delta:+.3f}" + (f" ± {r['delta_vs_full_std']:.3f}" if r["delta_vs_full_std"] is not None else ""))
        )
        lines.append(
            f"| `{r['variant']}`{flag} | {r['balance']} | {_pm(r['val_loss_mean'], r['val_loss_std'])} | "
            f"{delta_s} | {_pm(r['val_bpb_mean'], r['val_bpb_std'])} | "
            f"{_pm(r['maxvio_mean'], r['maxvio_std'], 2)} | {_fmt(r['dead_experts_mean'], 1)} | "
            f"{_count(r['params_total'])} | {_count(r['params_activated'])} | {_fmt(r['wall_s_mean'], 0)} |"
        )
    lines += [
        "",
        "Variants (`no_latent` keeps the experts, the top-k and the shared experts and picks the plain routed "
        "expert width that matches the activated parameters of the routed path; see `k3/audit/ablate.py`):",
        "",
    ]
    for r in rows:
        ov = json.dumps(r["model_overrides"]) if r["model_overrides"] else "no model change"
        lines.append(
            f"- `{r['variant']}`: {r['description']} ({ov}; balance {r['balance']}; MoE-block activated "
            f"params {_count(r['params_moe_activated'])} over all MoE layers)"
        )
    lines += ["", "![validation loss](val_loss.png)", ""]
    lines += _evidence_lines(evidence or {})
    if frontier:
        lines += [
            "## Router frontier",
            "",
            "Validation loss against global-batch MaxVio for the variants that differ from `full` only in "
            "load balancing (points: seeds; crosses: mean ± std).",
            "",
            "![router frontier](router_frontier.png)",
            "",
        ]
    lines += _trained_frontier_lines(frontier_rows or [])
    lines += ["## Loss curves", "", "![loss curves](loss_curves.png)", ""]
    if mrows:
        m = grid.mqar
        lines += [
            "## Multi-query associative recall (MQAR)",
            "",
            f"{m.layers}-layer models of the base width with dense FFNs, trained {m.steps} steps of {m.batch_size} "
            f"sequences (AdamW, lr {m.lr}); {m.num_keys} keys, {m.num_values} values, every key of the context "
            f"queried; accuracy over {m.eval_size} held-out sequences.",
            "",
            "| variant | layers | kv pairs | seq len | accuracy | chance | params | train s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in mrows:
            lines.append(
                f"| `{r['variant']}` | {'/'.join(r['layers'])} | {r['num_pairs']} | {4 * r['num_pairs']} | "
                f"{_pm(r['accuracy_mean'], r['accuracy_std'])} | {r['chance']:.3f} | {_count(r['params'])} | "
                f"{r['train_s']:.0f} |"
            )
        lines += ["", "![MQAR accuracy](mqar.png)", ""]
    lines += [
        "## Runs",
        "",
        "| run | val loss | bits/byte | MaxVio | steps | status | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {Path(s['run_dir']).name} | {_fmt(s.get('val_loss'))} | {_fmt(s.get('val_bpb'))} | "
            f"{_fmt(s.get('maxvio'), 2)} | {s.get('steps_done')} | {s.get('status')} | "
            f"{_fmt(s.get('wall_s'), 0)} |"
        )
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------- plots
def plot_val_loss(rows: list[dict], path: Path, diffs: dict | None = None) -> None:
    """Left: validation loss, mean ± std over seeds; right (when runs pair with ``full``): the paired difference
    to ``full`` with its t-interval from ``diffs`` (:func:`ci_evidence`'s ``difference_vs_full``; no bar where a
    variant has one seed). A report without intervals (``diffs`` empty: its results predate them) gets ± the
    standard deviation of the paired differences, as its table gives, and the axis says which bar is which."""
    rows = [r for r in rows if r["val_loss_mean"] is not None]
    if not rows:
        return
    diffs = diffs or {}
    paired = any(r.get("delta_vs_full_mean") is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if paired else 1, figsize=(12 if paired else 7, 1.2 + 0.4 * len(rows)), squeeze=False)
    y = np.arange(len(rows))
    colors = ["C3" if r["variant"] == "full" else ("C1" if not r["model_overrides"] else "C0") for r in rows]

    def bars(key: str) -> tuple[np.ndarray, np.ndarray]:
        """(means, [below, above] error lengths) of each row."""
        means = np.array([r.get(key) if r.get(key) is not None else np.nan for r in rows], dtype=float)
        if key == "val_loss_mean":
            sd = np.array([r.get("val_loss_std") or 0.0 for r in rows], dtype=float)
            return means, np.stack([sd, sd])
        err = np.zeros((2, len(rows)))
        for i, r in enumerate(rows):
            c = diffs.get(r["variant"]) or {}
            if c.get("lo") is not None and np.isfinite(means[i]):
                err[:, i] = means[i] - c["lo"], c["hi"] - means[i]
            elif not diffs and r.get("delta_vs_full_std") and np.isfinite(means[i]):
                err[:, i] = r["delta_vs_full_std"]
        return means, err

    panels = [("val_loss_mean", "validation loss (nats/token)\nmean ± std over seeds")]
    if paired:
        first = next((c for c in diffs.values() if c.get("lo") is not None), None)
        dfs = sorted({c["df"] for c in diffs.values() if c.get("lo") is not None})
        if first:
            what = f"mean, paired t {first['level']} CI, {'/'.join(map(str, dfs))} df (none: one seed)"
        elif not diffs and any(r.get("delta_vs_full_std") for r in rows):
            what = "mean ± std of the paired differences\n(no interval computed)"
        else:
            what = "mean, no interval"
        panels.append(("delta_vs_full_mean", f"Δ vs full (nats/token)\n{what}"))
    for ax, (key, xlabel) in zip(axes[0], panels):
        means, err = bars(key)
        ax.barh(y, np.nan_to_num(means), xerr=err, color=colors, alpha=0.8, capsize=3)
        ok = np.isfinite(means)
        lo, hi = float(np.min((means - err[0])[ok])), float(np.max((means + err[1])[ok]))
        delta = key.startswith("delta")
        if delta:
            lo, hi = min(lo, 0.0), max(hi, 0.0)
        pad = max(0.05 * (hi - lo), 0.005)
        ax.set_xlim(lo - 4 * pad, hi + 4 * pad)
        ref = 0.0 if delta else next((r["val_loss_mean"] for r in rows if r["variant"] == "full"), None)
        if ref is not None:
            ax.axvline(ref, color="C3", ls="--", lw=1)
        for yi, m, above in zip(y, means, err[1]):
            if np.isfinite(m):
                ax.annotate(
                    f"{m:+.3f}" if delta else f"{m:.3f}",
                    (max(m + above, m), yi),
                    textcoords="offset points",
                    xytext=(6, -3),
                    fontsize=7,
                )
        ax.set_yticks(y, [r["variant"] for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel(xlabel, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_title("ablations (red: full K3; orange: balancing only; blue: model changes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_router_frontier(summaries: list[dict], rows: list[dict], path: Path) -> None:
    """Validation loss against MaxVio per run and per variant (mean ± sd over seeds). The loss axis is zoomed on
    the runs, so its span is written on the plot beside the seed-to-seed standard deviation: a gap between
    variants reads against both, not against the height of the plot."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, r in enumerate(rows):
        runs = [
            s
            for s in summaries
            if s["variant"] == r["variant"] and finite(s.get("maxvio")) and finite(s.get("val_loss"))
        ]
        if not runs:
            continue
        color = f"C{i % 10}"
        ax.scatter([s["maxvio"] for s in runs], [s["val_loss"] for s in runs], color=color, alpha=0.4, s=18)
        ax.errorbar(
            r["maxvio_mean"],
            r["val_loss_mean"],
            xerr=r["maxvio_std"] or 0,
            yerr=r["val_loss_std"] or 0,
            fmt="x",
            color=color,
            capsize=3,
            ms=8,
            label=f"{r['variant']} ({r['balance']})",
        )
    ax.set_xlabel("global-batch MaxVio (mean of the last steps)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("router frontier: quality vs balance (lower-left is better)", fontsize=9)
    ax.grid(alpha=0.3)
    lo, hi = ax.get_ylim()
    sds = [r["val_loss_std"] for r in rows if finite(r.get("val_loss_std"))]
    note = f"the loss axis spans only {hi - lo:.3f} nats/token"
    if sds:
        note += f"\nseed-to-seed sd: {float(np.mean(sds)):.3f} (mean over variants)"
    ax.text(0.02, 0.98, note, transform=ax.transAxes, va="top", fontsize=8, bbox={"fc": "w", "ec": "0.6"})
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss_curves(summaries: list[dict], path: Path) -> None:
    by_variant: dict[str, list[list[dict]]] = {}
    for s in summaries:
        by_variant.setdefault(s["variant"], []).append(read_metrics(Path(s["run_dir"])))
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, histories) in enumerate(by_variant.items()):
        color = plt.get_cmap("tab10" if len(by_variant) <= 10 else "tab20")(i % 20)
        curves = []
        for h in histories:
            losses = [x["loss"] for x in h if finite(x.get("loss"))]
            if losses:
                curves.append(ema(losses))
        if curves:
            n = min(len(c) for c in curves)
            ax_t.plot(range(n), np.mean([c[:n] for c in curves], axis=0), color=color, lw=1.2, label=name)
        vals: dict[int, list[float]] = {}
        for h in histories:
            for x in h:
                if "val_loss_init" in x:
                    vals.setdefault(0, []).append(x["val_loss_init"])
                if "val_loss" in x:
                    vals.setdefault(x["step"] + 1, []).append(x["val_loss"])
        if vals:
            steps = sorted(vals)
            ax_v.plot(steps, [np.mean(vals[s]) for s in steps], "o-", color=color, ms=3, lw=1.2, label=name)
    ax_t.set_title("training loss (EMA 0.9, mean over seeds)", fontsize=9)
    ax_v.set_title("validation loss (mean over seeds)", fontsize=9)
    for ax in (ax_t, ax_v):
        ax.set_xlabel("step")
        ax.set_ylabel("nats/token")
        ax.grid(alpha=0.3)
    # zoom on the second half of training where the variants separate
    finals = [line.get_ydata()[-1] for line in ax_v.get_lines()]
    if finals:
        starts = [line.get_ydata()[min(1, len(line.get_ydata()) - 1)] for line in ax_v.get_lines()]
        ax_v.set_ylim(min(finals) - 0.1, max(starts) + 0.1)
    ax_v.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_mqar(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    pairs = sorted({r["num_pairs"] for r in rows})
    width = 0.8 / max(len(variants), 1)
    x = np.arange(len(pairs))
    for i, v in enumerate(variants):
        acc = [
            next((r["accuracy_mean"] for r in rows if r["variant"] == v and r["num_pairs"] == p), np.nan) for p in pairs
        ]
        err = [
            next((r["accuracy_std"] or 0.0 for r in rows if r["variant"] == v and r["num_pairs"] == p), 0.0)
            for p in pairs
        ]
        ax.bar(x + (i - (len(variants) - 1) / 2) * width, acc, width, yerr=err, capsize=3, label=v)
    ax.axhline(rows[0]["chance"], color="k", ls=":", lw=1, label="chance")
    ax.set_xticks(x, [f"{p} pairs" for p in pairs])
    ax.set_ylim(0, 1)
    ax.set_ylabel("query accuracy")
    ax.set_title("multi-query associative recall", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
