"""Scaling efficiency (``k3 scaling``): power-law fits L(C) per architecture and compute multipliers.

Fits and their intervals are :mod:`k3.audit.powerlaw`'s: L(C) = a C^-b (or E + a C^-b with ``irreducible``)
on the final validation loss of runs of >= 2 sizes, 90% intervals from a bootstrap over runs where an
architecture has >= 20 of them, else t-intervals from the fits' linearised covariance.

Compute. ``compute`` from a run's ``summary.json`` or its last metrics record when present (runs of a sweep or
an ablation grid record 3 x the forward FLOPs per token at their sequence length, attention counted, x tokens),
else the same, counted on the meta device from the run's ``train_config.json`` and tokenizer (older records may
hold C = 6 N D, N the activated parameters).

Compute multiplier of architecture A over a baseline B at loss L: m(L) = C_B(L) / C_A(L) (> 1: A reaches L
with less compute), evaluated only at the losses both reach (the overlap of their observed loss ranges; its
geometric midpoint is the reference loss): where the ranges do not overlap, no multiplier is given, since it
would be an extrapolation of one fit or both.

Sweeps (:mod:`k3.audit.sweeps`) train the runs these fits are made of.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from k3.audit.powerlaw import (  # noqa: E402, F401 (bootstrap_fit, fit_power_law: part of this module's interface)
    PowerLawFit,
    bootstrap_fit,
    bootstrap_multiplier,
    compute_multiplier,
    delta_multiplier,
    delta_multiplier_band,
    fit_interval,
    fit_power_law,
    loss_overlap,
)
from k3.audit.stats import MIN_BOOTSTRAP_UNITS  # noqa: E402

log = logging.getLogger("k3.scaling")


# ---------------------------------------------------------------------------------------------------- runs on disk
def _lookup(d: dict, dotted: str):
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _counted(train_config: dict, run_dir: Path) -> tuple[float, float]:
    """(activated parameters, forward FLOPs per token at the run's sequence length, attention counted) of a run's
    model, built on the meta device from its ``train_config.json`` and tokenizer."""
    from k3.audit import accounting
    from k3.config import get_preset
    from k3.data.tokenizer import Tokenizer

    tok = Tokenizer.load(run_dir)
    config = get_preset(train_config["preset"]).replace(
        vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id, **train_config.get("overrides", {})
    )
    r = accounting.report(config, context=train_config.get("seq_len", 4096))
    return float(r["params_activated"]), float(r["flops_per_token_forward"])


def load_run(run_dir: Path, group_by: str | None = None, metric: str = "val_loss") -> dict | None:
    """One run's label, compute, tokens and final ``metric`` (None if it has no evaluation yet)."""
    run_dir = Path(run_dir)
    tc = json.loads((run_dir / "train_config.json").read_text())
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in records if metric in r and isinstance(r[metric], (int, float))]
    if not evals:
        return None
    if group_by:
        label = _lookup(summary, group_by)
        label = _lookup(tc, group_by) if label is None else label
        if label is None:
            raise ValueError(f"{run_dir}: --group-by {group_by!r} is in neither summary.json nor train_config.json")
    else:
        label = (
            summary.get("label")
            or tc.get("label")
            or tc.get("overrides", {}).get("label")
            or tc.get("overrides", {}).get("name")
            or tc.get("preset")
        )
    tokens = records[-1].get("tokens") or summary.get("tokens")
    if summary.get("compute") and summary.get("tokens") == tokens:
        compute = float(summary["compute"])
        params = summary.get("params_activated")
    elif isinstance(records[-1].get("compute"), (int, float)):
        compute, params = float(records[-1]["compute"]), None
    else:  # forward + backward = 3 x the forward FLOPs, as sweep and grid runs record it
        params, flops = _counted(tc, run_dir)
        compute = 3.0 * flops * tokens
    return {
        "run_dir": str(run_dir),
        "label": str(label),
        "compute": compute,
        "loss": float(evals[-1][metric]),
        "tokens": tokens,
        "params_activated": params,
        "seed": tc.get("seed"),
        "step": evals[-1]["step"],
        "data": tc.get("data"),
        # a sweep's design: the size, learning rate and tokens per parameter of the run (k3.audit.scaling_design)
        "width": summary.get("width", tc.get("overrides", {}).get("hidden_size")),
        "layers": summary.get("layers", tc.get("overrides", {}).get("num_hidden_layers")),
        "lr": tc.get("lr"),
        "tokens_per_param": summary.get("tokens_per_param"),
        "wall_s": summary.get("wall_s"),
    }


def load_runs(runs_dir: str | Path, group_by: str | None = None, metric: str = "val_loss") -> list[dict]:
    """Every run directory (train_config.json + metrics.jsonl) under ``runs_dir``, recursively."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {runs_dir}")
    runs = []
    for m in sorted(runs_dir.rglob("metrics.jsonl")):
        if (m.parent / "train_config.json").is_file():
            r = load_run(m.parent, group_by, metric)
            if r is not None:
                runs.append(r)
    if not runs:
        raise ValueError(f"{runs_dir}: no runs with train_config.json, metrics.jsonl and a {metric}")
    return runs


# ---------------------------------------------------------------------------------------------------- analysis
def analyse(
    runs: list[dict], baseline: str | None = None, irreducible: bool = False, n_boot: int = 1000, seed: int = 0
) -> dict:
    """Fit every architecture and the compute multiplier of each over the baseline."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], []).append(r)
    fits, skipped = {}, {}
    need = 3 if irreducible else 2
    for label, rs in groups.items():
        c = np.array([r["compute"] for r in rs])
        if np.unique(c).size < need:
            skipped[label] = f"{np.unique(c).size} distinct compute value(s); a fit needs {need}"
            continue
        loss = np.array([r["loss"] for r in rs])
        f = fit_power_law(c, loss, irreducible)
        fits[label] = {
            **f.to_dict(),
            "interval": fit_interval(c, loss, f, irreducible, n_boot, seed),
            "runs": len(rs),
            "sizes": int(np.unique(c).size),
        }
    if baseline is None:
        baseline = "baseline" if "baseline" in fits else (sorted(fits)[0] if fits else None)
    if baseline is not None and baseline not in groups:
        raise ValueError(f"--baseline {baseline!r} is not one of the architectures: {', '.join(sorted(groups))}")
    multipliers = {}
    if baseline in fits:
        fb = _fit_from(fits[baseline])
        rb = groups[baseline]
        for label in fits:
            if label == baseline:
                continue
            fa = _fit_from(fits[label])
            ra = groups[label]
            lo, hi, overlap = loss_overlap([r["loss"] for r in ra], [r["loss"] for r in rb])
            if not overlap:  # no loss both reach: a multiplier would extrapolate
                multipliers[label] = {
                    "baseline": baseline,
                    "at_loss": None,
                    "multiplier": None,
                    "loss_range": [lo, hi],
                    "overlap": False,
                    "interval": [None, None],
                    "interval_detail": {},
                    "curve": {"loss": [], "multiplier": []},
                }
                continue
            ref = math.sqrt(lo * hi)
            grid = np.geomspace(lo, hi, 9) if hi > lo else np.array([lo])
            mult = compute_multiplier(fa, fb, grid)
            data_a = ([r["compute"] for r in ra], [r["loss"] for r in ra])
            data_b = ([r["compute"] for r in rb], [r["loss"] for r in rb])
            if min(len(ra), len(rb)) >= MIN_BOOTSTRAP_UNITS:
                boot = bootstrap_multiplier(*data_a, *data_b, ref, irreducible, n_boot, seed, band_losses=grid)
                band = boot.pop("band", None)
            else:
                boot = delta_multiplier(fa, data_a, fb, data_b, ref)
                band = delta_multiplier_band(fa, data_a, fb, data_b, grid)
            multipliers[label] = {
                "baseline": baseline,
                "at_loss": ref,
                "multiplier": float(compute_multiplier(fa, fb, ref)),
                "loss_range": [lo, hi],
                "overlap": overlap,
                "interval": [boot.get("low"), boot.get("high")],
                "interval_detail": boot,
                "curve": {"loss": grid.tolist(), "multiplier": mult.tolist()},
                "band": band,
            }
    return {
        "fits": fits,
        "skipped": skipped,
        "baseline": baseline,
        "multipliers": multipliers,
        "irreducible": irreducible,
        "runs": runs,
    }


def _fit_from(d: dict) -> PowerLawFit:
    return PowerLawFit(d["a_normalised"], d["b"], d["c0"], d["e"], d["irreducible"], d["n"], d["rss_log"])


def _sci(x) -> str:
    return "—" if x is None or not np.isfinite(x) else f"{x:.3g}"


def _data_names(runs: list[dict]) -> str:
    """The runs' data sources, named for the report."""
    from k3.data.corpus import describe_corpus

    found = sorted({r.get("data") for r in runs}, key=str)
    return "; ".join(describe_corpus(d) for d in found) or "the runs' data"


def write_outputs(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=2))
    plot_scaling(result, out / "scaling.png")
    form = "L = E + a C^-b" if result["irreducible"] else "L = a C^-b"
    lines = [
        f"# Scaling: {form}",
        "",
        "C = training compute in FLOPs (3 x the forward FLOPs per token, attention counted, x tokens); "
        "L = final validation loss (nats/token) "
        f"on the validation split of {_data_names(result['runs'])}. 90% intervals: a percentile bootstrap over "
        f"runs where an architecture has >= {MIN_BOOTSTRAP_UNITS} runs; with fewer, t-intervals from the fit's "
        "linearised covariance (n - p df; the multiplier by the delta method), as each row's interval column says.",
        "",
        "| architecture | runs | sizes | a | b (90% interval) | E (90% interval) | rss(log L) | interval |",
        "|---|---|---|---|---|---|---|---|",
    ]
    span = lambda v: f" [{v[0]:.3f}, {v[1]:.3f}]" if v else ""  # noqa: E731
    for label, f in result["fits"].items():
        iv = f["interval"]
        lines.append(
            f"| `{label}` | {f['runs']} | {f['sizes']} | {_sci(f['a'])} | {f['b']:.4f}{span(iv.get('b'))} | "
            f"{f['e']:.3f}{span(iv.get('e'))} | {f['rss_log']:.2e} | {iv['level']} {iv['method']} |"
        )
    for label, why in result["skipped"].items():
        lines.append(f"| `{label}` | — | — | — | not fitted: {why} | — | — | — |")
    if result["multipliers"]:
        lines += [
            "",
            f"Compute multiplier over `{result['baseline']}` (C_baseline(L) / C_arch(L); > 1: the "
            "architecture reaches the loss with less compute), at the geometric middle of the losses "
            "both reach:",
            "",
            "| architecture | at loss | multiplier | 90% interval | over the loss range | losses overlap | interval |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, m in result["multipliers"].items():
            if not m["overlap"]:
                lo, hi = m["loss_range"]
                lines.append(
                    f"| `{label}` | — | none: the losses do not overlap (gap {lo:.3f} .. {hi:.3f}) | — | — | no | — |"
                )
                continue
            iv, how = m["interval"], m["interval_detail"]
            iv_s = f"[{iv[0]:.3f}, {iv[1]:.3f}]" if iv[0] is not None else "—"
            curve = [v for v in m["curve"]["multiplier"] if v is not None and np.isfinite(v)]
            rng = f"{min(curve):.3f} .. {max(curve):.3f}" if curve else "—"
            lines.append(
                f"| `{label}` | {m['at_loss']:.3f} | {m['multiplier']:.3f} | {iv_s} | {rng} | yes | "
                f"{how['level']} {how['method']} |"
            )
    lines += [
        "",
        "![scaling](scaling.png)",
        "",
        "Runs:",
        "",
        "| run | architecture | compute | loss | tokens |",
        "|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {Path(r['run_dir']).name} | `{r['label']}` | {r['compute']:.3g} | {r['loss']:.4f} | {r['tokens']:,} |"
        )
    path = out / "scaling.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _methods(result: dict, multipliers: bool = False) -> str:
    """The interval method of each fit (or multiplier) in short, with its df, for a figure title."""
    if multipliers:
        found = {k: m["interval_detail"] for k, m in result["multipliers"].items() if m["overlap"]}
    else:
        found = {k: f["interval"] for k, f in result["fits"].items()}

    return "; ".join(f"{k}: {_short_method(d, multipliers)}" for k, d in found.items()) or "none"


def _short_method(d: dict, multiplier: bool = False) -> str:
    """An interval's method in a few words, with its df."""
    if "bootstrap" in d.get("method", ""):
        return "percentile bootstrap"
    if d.get("df") is None or "no interval" in d.get("method", ""):
        return "none"
    return ("delta method, " if multiplier else "") + f"t on {d['df']:.3g} df"


def _log_y(ax) -> None:
    """Log y axis with plain-number tick labels (loss ranges are often well inside one decade)."""
    from matplotlib.ticker import FormatStrFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax.tick_params(axis="y", which="minor", labelsize=7)


def compute_loss_axes(ax, ylabel: str = "validation loss (nats/token)") -> None:
    """Axes of loss against training compute: both logarithmic, plain-number loss ticks."""
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    _log_y(ax)
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel(ylabel)


def plot_scaling(result: dict, path: Path) -> None:
    has_mult = any(m["overlap"] for m in result["multipliers"].values())
    fig, axes = plt.subplots(1, 2 if has_mult else 1, figsize=(12 if has_mult else 6.5, 4.5))
    ax = axes[0] if has_mult else axes
    labels = list(dict.fromkeys(r["label"] for r in result["runs"]))
    for i, label in enumerate(labels):
        color = f"C{i % 10}"
        rs = [r for r in result["runs"] if r["label"] == label]
        c = np.array([r["compute"] for r in rs])
        ax.scatter(c, [r["loss"] for r in rs], color=color, s=20, alpha=0.8)
        if label in result["fits"]:
            f = _fit_from(result["fits"][label])
            inside = np.geomspace(c.min(), c.max(), 60)
            ax.plot(
                inside,
                f.loss(inside),
                color=color,
                lw=1.3,
                label=f"{label}: b={f.b:.3f}" + (f", E={f.e:.2f}" if f.irreducible else ""),
            )
            for end in ((c.min() / 1.5, c.min()), (c.max(), c.max() * 1.5)):  # beyond this arm's runs: dashed
                cs = np.geomspace(*end, 10)
                ax.plot(cs, f.loss(cs), color=color, lw=1.0, ls="--")
            band = result["fits"][label]["interval"].get("band")
            if band:
                ax.fill_between(band["compute"], band["lo"], band["hi"], color=color, alpha=0.15, lw=0)
        else:
            ax.plot([], [], color=color, label=f"{label} (not fitted)")
    compute_loss_axes(ax)
    ax.set_title(f"L(C) per architecture; dashed beyond an arm's runs\n90% band: {_methods(result)}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if has_mult:
        ax = axes[1]
        for i, (label, m) in enumerate(result["multipliers"].items()):
            if not m["overlap"]:
                continue
            color = f"C{labels.index(label) % 10}"
            ax.plot(m["curve"]["loss"], m["curve"]["multiplier"], color=color, lw=1.3, label=label)
            how = m["interval_detail"]
            level = how.get("level", "90%")
            pointwise = "percentile bootstrap" if "bootstrap" in how.get("method", "") else "delta method, df per point"
            band = m.get("band")
            if band and any(v is not None for v in band["lo"]):
                ok = [i for i, (lo, hi) in enumerate(zip(band["lo"], band["hi"])) if lo is not None and hi is not None]
                ax.fill_between(
                    [band["loss"][i] for i in ok],
                    [band["lo"][i] for i in ok],
                    [band["hi"][i] for i in ok],
                    color=color,
                    alpha=0.18,
                    lw=0,
                    label=f"{label}: {level} pointwise interval ({pointwise})",
                )
            iv = m["interval"]
            if iv[0] is not None:
                yerr = [[m["multiplier"] - iv[0]], [iv[1] - m["multiplier"]]]
                ax.errorbar(
                    [m["at_loss"]],
                    [m["multiplier"]],
                    yerr=yerr,
                    fmt="o",
                    color=color,
                    capsize=4,
                    label=f"{label} at loss {m['at_loss']:.2f}: {m['multiplier']:.2f}x [{iv[0]:.2f}, {iv[1]:.2f}] "
                    f"({level}, {_short_method(how, True)})",
                )
        ax.axhline(1.0, color="k", ls=":", lw=1)
        _log_y(ax)
        ax.set_xlabel("validation loss (nats/token)")
        ax.set_ylabel(f"compute multiplier over {result['baseline']}")
        ax.set_title(f"C_baseline(L) / C_arch(L)\n90% interval: {_methods(result, True)}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
