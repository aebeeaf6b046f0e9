"""Design choices of a scaling sweep (``k3 scaling`` on runs at several learning rates or tokens per parameter,
the ``lrs`` / ``ratios`` of :mod:`k3.audit.sweeps`): how much of a compute multiplier is the sweep's design.

Cells: one arm at one size (width, layers) and one tokens-per-parameter ratio; its final validation loss at each
learning rate (the mean over its seeds, with a 95% t-interval on n - 1 df where it has >= 2, else none) and its
best rate, the one with the lowest mean (flagged when it is the lowest or highest rate tried: the optimum may lie
beyond the grid).

Choices, per ratio: every run at the shared rate; and, where cells ran at several rates, each arm and size at its
own best rate (what tuning each arm separately gives). Each choice's runs are fitted as :mod:`k3.audit.scaling`
fits any sweep: L = a C^-b per arm, the multiplier at the geometric middle of the losses both arms reach, with its
90% delta-method t-interval where the fits have residual df (one run per arm and size leaves none: the fit
passes through its points and the report says "no interval").

Multiplier at a size: the same two fits read at a loss reached at that size that neither fit has to extrapolate
to: the candidate's loss there if it lies within the losses both arms reach, else the baseline's, else none. With
one run per arm and size it is exact interpolation: at the size where the candidate is lower, the compute the
baseline needs for the candidate's loss (log-log between its runs) over the candidate's compute there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from k3.audit.scaling import _data_names, _fit_from, analyse, compute_loss_axes, compute_multiplier  # noqa: E402
from k3.audit.stats import t_interval  # noqa: E402

KEYS = ("width", "layers", "lr")


def _size(r: dict) -> tuple[int, int]:
    return int(r["width"]), int(r["layers"])


def is_design(runs: list[dict]) -> bool:
    """Whether some arm at some size ran at more than one (learning rate, tokens per parameter): such runs are
    not one scaling curve per arm, and need :func:`analyse_design`."""
    seen: dict = {}
    for r in runs:
        if all(r.get(k) is not None for k in KEYS):
            seen.setdefault((r["label"], _size(r)), set()).add((r["lr"], r.get("tokens_per_param")))
    return any(len(v) > 1 for v in seen.values())


def _ratio_key(ratio) -> tuple:
    """Ratios in increasing order, an unrecorded one (None) last."""
    return (ratio is None, ratio or 0.0)


def _cells(runs: list[dict]) -> list[dict]:
    groups: dict = {}
    for r in runs:
        groups.setdefault((r.get("tokens_per_param"), r["label"], _size(r)), {}).setdefault(r["lr"], []).append(r)
    cells = []
    for (ratio, label, (width, layers)), by_lr in groups.items():
        lrs = {}
        for lr, rs in sorted(by_lr.items()):
            losses = [r["loss"] for r in rs]
            iv = t_interval(losses) if len(losses) >= 2 else None
            lrs[lr] = {
                "losses": losses,
                "mean": float(np.mean(losses)),
                "seeds": [r.get("seed") for r in rs],
                "interval": None if iv is None else [iv["lo"], iv["hi"]],
                "interval_method": "one seed: no interval" if iv is None else f"{iv['level']} {iv['method']}",
                "steps": rs[0].get("step", -1) + 1,
            }
        best = min(lrs, key=lambda lr: lrs[lr]["mean"])
        cells.append(
            {
                "tokens_per_param": ratio,
                "label": label,
                "width": width,
                "layers": layers,
                "lrs": lrs,
                "best_lr": best,
                "best_at_edge": len(lrs) > 1 and best in (min(lrs), max(lrs)),
            }
        )
    return sorted(cells, key=lambda c: (_ratio_key(c["tokens_per_param"]), c["label"] != "k3", c["label"], c["width"]))


def _size_multipliers(result: dict, runs: list[dict], label: str, baseline: str) -> list[dict]:
    m = result["multipliers"].get(label)
    if m is None or not m["overlap"]:
        return []
    lo, hi = m["loss_range"]
    fa, fb = _fit_from(result["fits"][label]), _fit_from(result["fits"][baseline])
    mean = {}
    for r in runs:
        mean.setdefault((r["label"], _size(r)), []).append(r["loss"])
    out = []
    for size in sorted({_size(r) for r in runs}):
        if (label, size) not in mean or (baseline, size) not in mean:
            continue
        la, lb = float(np.mean(mean[label, size])), float(np.mean(mean[baseline, size]))
        inside = lambda x: lo * (1 - 1e-12) <= x <= hi * (1 + 1e-12)  # noqa: E731
        at, whose = (la, label) if inside(la) else (lb, baseline) if inside(lb) else (None, None)
        value = None if at is None else float(compute_multiplier(fa, fb, at))
        out.append({"width": size[0], "layers": size[1], "at_loss": at, "loss_of": whose, "multiplier": value})
    return out


def analyse_design(runs: list[dict], shared_lr: float, baseline: str = "baseline") -> dict:
    """Cells, choices (shared rate; each arm at its best rate) per ratio, their fits, multipliers and multipliers
    by size. Runs need ``width``, ``layers`` and ``lr`` (a sweep's runs record them)."""
    missing = [Path(r["run_dir"]).name for r in runs if any(r.get(k) is None for k in KEYS)]
    if missing:
        raise ValueError(f"runs without width, layers or lr (not a sweep's runs?): {', '.join(missing[:5])}")
    if not math.isfinite(shared_lr) or shared_lr <= 0:
        raise ValueError(f"--shared-lr={shared_lr!r} must be a positive learning rate")
    cells = _cells(runs)
    best = {(c["tokens_per_param"], c["label"], c["width"], c["layers"]): c["best_lr"] for c in cells}
    choices, skipped = [], []
    for ratio in sorted({c["tokens_per_param"] for c in cells}, key=_ratio_key):
        at_ratio = [r for r in runs if r.get("tokens_per_param") == ratio]
        picks = [("shared", f"every run at lr {shared_lr:g}", [r for r in at_ratio if r["lr"] == shared_lr])]
        if any(len(c["lrs"]) > 1 for c in cells if c["tokens_per_param"] == ratio):
            tuned = [r for r in at_ratio if r["lr"] == best[(ratio, r["label"]) + _size(r)]]
            picks.append(("best", "each arm and size at its best lr", tuned))
        for kind, name, rs in picks:
            if baseline not in {r["label"] for r in rs}:
                skipped.append(f"{_ratio(ratio)} tokens/param, {name}: no `{baseline}` runs, no multiplier")
                continue
            result = analyse(rs, baseline)
            per_size = {
                label: _size_multipliers(result, rs, label, result["baseline"])
                for label in result["multipliers"]
                if result["baseline"] is not None
            }
            lrs = {f"{r['label']} w{r['width']}": r["lr"] for r in rs}
            choices.append(
                {
                    "tokens_per_param": ratio,
                    "kind": kind,
                    "name": name,
                    "lrs": lrs,
                    "result": result,
                    "by_size": per_size,
                }
            )
    return {
        "shared_lr": shared_lr,
        "baseline": baseline,
        "cells": cells,
        "choices": choices,
        "skipped": skipped,
        "runs": runs,
    }


def _g(x, fmt: str = ".3f") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _how(how: dict) -> str:
    """An interval's level and method, or the method alone where it says there is none."""
    method = how.get("method", "no interval")
    return method if method.startswith("no interval") else f"{how.get('level', '')} {method}"


def _ratio(x) -> str:
    return "as the sweep" if x is None else f"{x:g}"


def write_design_outputs(result: dict, out: str | Path) -> Path:
    """``design.json`` (everything, the runs' compact records included), ``design.md`` and ``design.png``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "design.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(out / "design.json")
    plot_design(result, out / "design.png")
    cells = result["cells"]
    lrs = sorted({lr for c in cells for lr in c["lrs"]})
    lines = [
        "# Design choices of the scaling sweep: learning rate and tokens per parameter",
        "",
        f"L = final validation loss (nats/token) on the validation split of {_data_names(result['runs'])}; "
        "C = training compute (3 x the forward FLOPs per token, attention "
        "counted, x tokens). A cell is one arm at one size and tokens-per-parameter ratio; its loss at a rate is the "
        "mean over its seeds (95% t-interval on n - 1 df with >= 2 seeds; one seed: no interval). **Bold**: the "
        "cell's best rate; `edge`: the best is the lowest or highest rate tried, so the optimum may lie beyond.",
        "",
        "| arm | width | layers | tokens/param | steps | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |",
        "|---|---|---|---|---|" + "---|" * len(lrs) + "---|",
    ]
    for c in cells:
        row = []
        for lr in lrs:
            v = c["lrs"].get(lr)
            if v is None:
                row.append("—")
                continue
            s = f"{v['mean']:.4f}" + (f" [{v['interval'][0]:.3f}, {v['interval'][1]:.3f}]" if v["interval"] else "")
            row.append(f"**{s}**" if lr == c["best_lr"] and len(c["lrs"]) > 1 else s)
        steps = next(iter(c["lrs"].values()))["steps"]
        best = f"{c['best_lr']:g}" + (" (edge)" if c["best_at_edge"] else "")
        lines.append(
            f"| `{c['label']}` | {c['width']} | {c['layers']} | {_ratio(c['tokens_per_param'])} | {steps} | "
            + " | ".join(row)
            + f" | {best} |"
        )
    lines += [
        "",
        f"Compute multiplier over `{result['baseline']}` (C_baseline(L) / C_arch(L); > 1: the architecture reaches "
        "the loss with less compute) for each choice of runs, fitted as `k3 scaling` fits a sweep (L = a C^-b per "
        "arm): at the geometric middle of the losses both arms reach, with the fits' interval; and read at each "
        "size, at the loss one arm reaches there (its arm named) that neither fit has to extrapolate to (no "
        "interval).",
        "",
        "| tokens/param | runs | arm | at loss | multiplier | 90% interval | interval | by size |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ch in result["choices"]:
        for label, m in ch["result"]["multipliers"].items():
            if not m["overlap"]:
                lines.append(
                    f"| {_ratio(ch['tokens_per_param'])} | {ch['name']} | `{label}` | — | none: the losses do not "
                    "overlap | — | — | — |"
                )
                continue
            iv, how = m["interval"], m["interval_detail"]
            iv_s = f"[{iv[0]:.3f}, {iv[1]:.3f}]" if iv[0] is not None else "—"
            by = "; ".join(
                f"w{s['width']}: "
                + ("none (no loss both fits reach)" if s["multiplier"] is None else f"{s['multiplier']:.3f}")
                + ("" if s["at_loss"] is None else f" at {s['at_loss']:.3f} (`{s['loss_of']}`)")
                for s in ch["by_size"].get(label, [])
            )
            lines.append(
                f"| {_ratio(ch['tokens_per_param'])} | {ch['name']} | `{label}` | {m['at_loss']:.3f} | "
                f"{m['multiplier']:.3f} | {iv_s} | {_how(how)} | {by} |"
            )
    lines += [f"- {why}" for why in result["skipped"]]
    lines += [
        "",
        "![design](design.png)",
        "",
        "Runs:",
        "",
        "| run | arm | lr | tokens/param | compute | loss | tokens | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["runs"], key=lambda r: Path(r["run_dir"]).name):
        lines.append(
            f"| {Path(r['run_dir']).name} | `{r['label']}` | {r['lr']:g} | {_ratio(r.get('tokens_per_param'))} | "
            f"{r['compute']:.3g} | {r['loss']:.4f} | {r['tokens']:,} | {_g(r.get('wall_s'), '.0f')} |"
        )
    path = out / "design.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_design(result: dict, path: Path) -> None:
    """Loss against learning rate, one line per arm, size and ratio (the best rate circled), where cells ran at
    several rates; loss against compute, one line per arm and ratio (the runs at the shared rate), where the runs
    span several ratios."""
    cells = result["cells"]
    labels = list(dict.fromkeys(c["label"] for c in cells))
    by_lr = any(len(c["lrs"]) > 1 for c in cells)
    ratios = sorted({c["tokens_per_param"] for c in cells}, key=_ratio_key)
    panels = int(by_lr) + int(len(ratios) > 1) or 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    styles = ["-", "--", ":", "-."]
    ax = axes[0][0]
    if by_lr or len(ratios) == 1:
        sizes = sorted({(c["width"], c["layers"], str(c["tokens_per_param"])) for c in cells})
        for c in cells:
            xs = sorted(c["lrs"])
            color = f"C{labels.index(c['label']) % 10}"
            ls = styles[sizes.index((c["width"], c["layers"], str(c["tokens_per_param"]))) % len(styles)]
            ratio = "" if c["tokens_per_param"] is None else f", {c['tokens_per_param']:g} tok/param"
            name = f"{c['label']} w{c['width']} l{c['layers']}{ratio}"
            ax.plot(xs, [c["lrs"][x]["mean"] for x in xs], color=color, ls=ls, marker=".", label=name)
            ax.scatter([c["best_lr"]], [c["lrs"][c["best_lr"]]["mean"]], s=80, facecolors="none", edgecolors=color)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("final validation loss (nats/token)")
        ax.set_title("loss at each learning rate (mean over seeds; circled: best)\nno interval drawn", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        ax = axes[0][-1]
    if len(ratios) > 1:
        for ch in result["choices"]:
            if ch["kind"] != "shared":
                continue
            ls = styles[ratios.index(ch["tokens_per_param"]) % len(styles)]
            for label in labels:
                rs = sorted((r for r in ch["result"]["runs"] if r["label"] == label), key=lambda r: r["compute"])
                ax.plot(
                    [r["compute"] for r in rs],
                    [r["loss"] for r in rs],
                    color=f"C{labels.index(label) % 10}",
                    ls=ls,
                    marker="o",
                    label=f"{label}, {_ratio(ch['tokens_per_param'])} tok/param",
                )
        compute_loss_axes(ax, "final validation loss (nats/token)")
        ax.set_title(f"runs at lr {result['shared_lr']:g}, by tokens per parameter\nno interval drawn", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
