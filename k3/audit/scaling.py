"""Scaling efficiency (``k3 scaling``): power-law fits L(C) per architecture and compute multipliers.

Fit. Per architecture, the final validation loss L of runs of >= 2 sizes against their training compute C:

    L(C) = a * C^-b                (least squares on log L = log a - b log C)
    L(C) = E + a * C^-b            (``irreducible``: E on a grid in [0, min L), then Levenberg-Marquardt on
                                    sum (log L - log(E + a C^-b))^2 over (log a, b, E))

C is normalised by its geometric mean inside the fits (so a stays well conditioned) and reported in FLOPs.

Compute. ``compute`` from a run's ``summary.json`` or its last metrics record when present (runs of a sweep or
an ablation grid record 3 x the forward FLOPs per token at their sequence length, attention counted, x tokens),
else the same, counted on the meta device from the run's ``train_config.json`` and tokenizer (older records may
hold C = 6 N D, N the activated parameters).

Compute multiplier of architecture A over a baseline B at loss L: m(L) = C_B(L) / C_A(L) (> 1: A reaches L
with less compute), evaluated only at the losses both reach (the overlap of their observed loss ranges; its
geometric midpoint is the reference loss): where the ranges do not overlap, no multiplier is given, since it
would be an extrapolation of one fit or both. 90% intervals: percentiles 5 / 95 of a seeded bootstrap that
resamples runs with replacement within each architecture and refits both.

Sweeps (:mod:`k3.audit.sweeps`) train the runs these fits are made of.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

log = logging.getLogger("k3.scaling")


# ---------------------------------------------------------------------------------------------------- fits
@dataclass
class PowerLawFit:
    """L(C) = e + a_n * (C / c0)^-b; ``a`` = a_n * c0^b is the coefficient for C in FLOPs."""

    a_n: float
    b: float
    c0: float
    e: float = 0.0
    irreducible: bool = False
    n: int = 0
    rss: float = 0.0  # residual sum of squares of log L

    @property
    def a(self) -> float:
        return self.a_n * self.c0**self.b

    def loss(self, c) -> np.ndarray:
        return self.e + self.a_n * (np.asarray(c, dtype=float) / self.c0) ** -self.b

    def compute(self, loss) -> np.ndarray:
        """The compute at which the fit reaches ``loss`` (nan where it never does)."""
        loss = np.asarray(loss, dtype=float)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = (loss - self.e) / self.a_n
            out = self.c0 * ratio ** (-1.0 / self.b)
        return np.where((ratio > 0) & (self.b != 0), out, np.nan)

    def to_dict(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "e": self.e,
            "c0": self.c0,
            "a_normalised": self.a_n,
            "irreducible": self.irreducible,
            "n": self.n,
            "rss_log": self.rss,
        }


def _check_points(c, loss, need: int) -> tuple[np.ndarray, np.ndarray]:
    c, loss = np.asarray(c, dtype=float).ravel(), np.asarray(loss, dtype=float).ravel()
    if c.shape != loss.shape:
        raise ValueError(f"compute and loss must have the same length, got {c.size} and {loss.size}")
    if not (np.isfinite(c).all() and np.isfinite(loss).all() and (c > 0).all() and (loss > 0).all()):
        raise ValueError("compute and loss must be positive finite numbers")
    if np.unique(c).size < need:
        raise ValueError(f"a power-law fit needs >= {need} distinct compute values, got {np.unique(c).size}")
    return c, loss


def _line_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares y = alpha - b x for each row of y [G, n] (x [n]); returns alpha [G], b [G]."""
    xm = x.mean()
    dx = x - xm
    slope = (y - y.mean(axis=-1, keepdims=True)) @ dx / (dx @ dx)
    return y.mean(axis=-1) - slope * xm, -slope


def fit_power_law(c, loss, irreducible: bool = False, grid: int = 96, iters: int = 60) -> PowerLawFit:
    """Fit L = a C^-b (or E + a C^-b) in log space; see the module docstring."""
    c, loss = _check_points(c, loss, 3 if irreducible else 2)
    c0 = float(np.exp(np.log(c).mean()))
    x, y = np.log(c / c0), np.log(loss)
    if not irreducible:
        alpha, b = _line_fit(x, y[None])
        alpha, b = float(alpha[0]), float(b[0])
        rss = float(((y - (alpha - b * x)) ** 2).sum())
        return PowerLawFit(math.exp(alpha), b, c0, 0.0, False, c.size, rss)
    lmin = float(loss.min())
    e_grid = lmin * (1.0 - np.geomspace(1.0, 1e-4, grid))  # dense towards min L, where the optimum often is
    alpha, b = _line_fit(x, np.log(loss[None] - e_grid[:, None]))
    pred = np.log(e_grid[:, None] + np.exp(alpha[:, None] - b[:, None] * x[None]))
    rss = ((y[None] - pred) ** 2).sum(axis=1)
    j = int(np.nanargmin(rss))
    theta = np.array([alpha[j], b[j], e_grid[j]])
    best = float(rss[j])
    lam = 1e-3
    e_max = lmin * (1 - 1e-9)
    for _ in range(iters):  # Levenberg-Marquardt on (log a, b, E)
        p = np.exp(theta[0] - theta[1] * x)
        s = theta[2] + p
        r = y - np.log(s)
        jac = np.stack([p / s, -x * p / s, 1.0 / s], axis=1)
        h = jac.T @ jac
        g = jac.T @ r
        improved = False
        for _ in range(10):
            step = np.linalg.solve(h + lam * np.diag(np.diag(h) + 1e-12), g)
            cand = theta + step
            cand[2] = min(max(cand[2], 0.0), e_max)
            pc = np.exp(cand[0] - cand[1] * x)
            rc = float(((y - np.log(cand[2] + pc)) ** 2).sum())
            if np.isfinite(rc) and rc < best:
                theta, best, lam, improved = cand, rc, lam * 0.3, True
                break
            lam *= 10
        if not improved or best < 1e-30:
            break
    return PowerLawFit(math.exp(theta[0]), float(theta[1]), c0, float(theta[2]), True, c.size, best)


def compute_multiplier(candidate: PowerLawFit, baseline: PowerLawFit, loss) -> np.ndarray:
    """C_baseline(L) / C_candidate(L): how many times less compute the candidate needs to reach L."""
    return baseline.compute(loss) / candidate.compute(loss)


def loss_overlap(loss_a, loss_b) -> tuple[float, float, bool]:
    """(low, high, overlapping): the loss range both families reach; without overlap, the gap between them."""
    lo = max(float(np.min(loss_a)), float(np.min(loss_b)))
    hi = min(float(np.max(loss_a)), float(np.max(loss_b)))
    return (lo, hi, True) if lo <= hi else (hi, lo, False)


def bootstrap_multiplier(
    c_a,
    loss_a,
    c_b,
    loss_b,
    at_loss: float,
    irreducible: bool = False,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.90,
) -> dict:
    """Seeded bootstrap of m(at_loss) = C_b / C_a, resampling runs within each family; percentile interval."""
    c_a, loss_a = np.asarray(c_a, float), np.asarray(loss_a, float)
    c_b, loss_b = np.asarray(c_b, float), np.asarray(loss_b, float)
    need = 3 if irreducible else 2
    rng = np.random.default_rng(seed)
    values, fits_a, fits_b, failed = [], [], [], 0
    for _ in range(n_boot):
        ia = rng.integers(0, c_a.size, c_a.size)
        ib = rng.integers(0, c_b.size, c_b.size)
        if np.unique(c_a[ia]).size < need or np.unique(c_b[ib]).size < need:
            failed += 1
            continue
        fa = fit_power_law(c_a[ia], loss_a[ia], irreducible)
        fb = fit_power_law(c_b[ib], loss_b[ib], irreducible)
        m = float(compute_multiplier(fa, fb, at_loss))
        if not np.isfinite(m):
            failed += 1
            continue
        values.append(m)
        fits_a.append((fa.a, fa.b))
        fits_b.append((fb.a, fb.b))
    q = (100 * (1 - level) / 2, 100 * (1 + level) / 2)
    out = {"n_boot": n_boot, "n_valid": len(values), "n_failed": failed, "level": level, "seed": seed}
    if values:
        lo, hi = np.percentile(values, q)
        out.update(low=float(lo), high=float(hi), median=float(np.median(values)))
        for name, fits in (("candidate_b", fits_a), ("baseline_b", fits_b)):
            lo, hi = np.percentile([f[1] for f in fits], q)
            out[name] = [float(lo), float(hi)]
    return out


def bootstrap_fit(c, loss, irreducible: bool = False, n_boot: int = 1000, seed: int = 0, level: float = 0.90) -> dict:
    """Percentile intervals of b (and E) from a seeded bootstrap over runs, and the band of the fitted loss:
    ``band`` = {compute, lo, hi} on a grid from C_min / 1.5 to C_max * 1.5 (what the figure draws)."""
    c, loss = np.asarray(c, float), np.asarray(loss, float)
    need = 3 if irreducible else 2
    rng = np.random.default_rng(seed)
    grid = np.geomspace(c.min() / 1.5, c.max() * 1.5, 40)
    bs, es, curves = [], [], []
    for _ in range(n_boot):
        i = rng.integers(0, c.size, c.size)
        if np.unique(c[i]).size < need:
            continue
        f = fit_power_law(c[i], loss[i], irreducible)
        bs.append(f.b)
        es.append(f.e)
        curves.append(f.loss(grid))
    q = (100 * (1 - level) / 2, 100 * (1 + level) / 2)
    if not bs:
        return {"n_valid": 0}
    lo, hi = np.percentile(np.array(curves), q, axis=0)
    out = {
        "n_valid": len(bs),
        "b": [float(v) for v in np.percentile(bs, q)],
        "band": {"compute": grid.tolist(), "lo": lo.tolist(), "hi": hi.tolist()},
    }
    if irreducible:
        out["e"] = [float(v) for v in np.percentile(es, q)]
    return out


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
            "bootstrap": bootstrap_fit(c, loss, irreducible, n_boot, seed),
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
                    "interval90": [None, None],
                    "bootstrap": {},
                    "curve": {"loss": [], "multiplier": []},
                }
                continue
            ref = math.sqrt(lo * hi)
            grid = np.geomspace(lo, hi, 9) if hi > lo else np.array([lo])
            mult = compute_multiplier(fa, fb, grid)
            boot = bootstrap_multiplier(
                [r["compute"] for r in ra],
                [r["loss"] for r in ra],
                [r["compute"] for r in rb],
                [r["loss"] for r in rb],
                ref,
                irreducible,
                n_boot,
                seed,
            )
            multipliers[label] = {
                "baseline": baseline,
                "at_loss": ref,
                "multiplier": float(compute_multiplier(fa, fb, ref)),
                "loss_range": [lo, hi],
                "overlap": overlap,
                "interval90": [boot.get("low"), boot.get("high")],
                "bootstrap": boot,
                "curve": {"loss": grid.tolist(), "multiplier": mult.tolist()},
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
    from k3.data.text import describe_corpus

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
        f"on the validation split of {_data_names(result['runs'])}. 90% intervals from a seeded bootstrap over runs.",
        "",
        "| architecture | runs | sizes | a | b (90% CI) | E | rss(log L) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, f in result["fits"].items():
        ci = f["bootstrap"].get("b")
        ci_s = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        lines.append(
            f"| `{label}` | {f['runs']} | {f['sizes']} | {_sci(f['a'])} | {f['b']:.4f}{ci_s} | "
            f"{f['e']:.3f} | {f['rss_log']:.2e} |"
        )
    for label, why in result["skipped"].items():
        lines.append(f"| `{label}` | — | — | — | not fitted: {why} | — | — |")
    if result["multipliers"]:
        lines += [
            "",
            f"Compute multiplier over `{result['baseline']}` (C_baseline(L) / C_arch(L); > 1: the "
            "architecture reaches the loss with less compute), at the geometric middle of the losses "
            "both reach:",
            "",
            "| architecture | at loss | multiplier | 90% interval | over the loss range | losses overlap |",
            "|---|---|---|---|---|---|",
        ]
        for label, m in result["multipliers"].items():
            if not m["overlap"]:
                lo, hi = m["loss_range"]
                lines.append(
                    f"| `{label}` | — | none: the losses do not overlap (gap {lo:.3f} .. {hi:.3f}) | — | — | no |"
                )
                continue
            iv = m["interval90"]
            iv_s = f"[{iv[0]:.3f}, {iv[1]:.3f}]" if iv[0] is not None else "—"
            curve = [v for v in m["curve"]["multiplier"] if v is not None and np.isfinite(v)]
            rng = f"{min(curve):.3f} .. {max(curve):.3f}" if curve else "—"
            lines.append(f"| `{label}` | {m['at_loss']:.3f} | {m['multiplier']:.3f} | {iv_s} | {rng} | yes |")
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


def _log_y(ax) -> None:
    """Log y axis with plain-number tick labels (loss ranges are often well inside one decade)."""
    from matplotlib.ticker import FormatStrFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax.tick_params(axis="y", which="minor", labelsize=7)


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
            band = result["fits"][label].get("bootstrap", {}).get("band")
            if band:
                ax.fill_between(band["compute"], band["lo"], band["hi"], color=color, alpha=0.15, lw=0)
        else:
            ax.plot([], [], color=color, label=f"{label} (not fitted)")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    _log_y(ax)
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("L(C) per architecture: 90% bootstrap band; dashed beyond an arm's runs", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if has_mult:
        ax = axes[1]
        for i, (label, m) in enumerate(result["multipliers"].items()):
            if not m["overlap"]:
                continue
            color = f"C{labels.index(label) % 10}"
            ax.plot(m["curve"]["loss"], m["curve"]["multiplier"], color=color, lw=1.3, label=label)
            iv = m["interval90"]
            if iv[0] is not None:
                yerr = [[m["multiplier"] - iv[0]], [iv[1] - m["multiplier"]]]
                ax.errorbar([m["at_loss"]], [m["multiplier"]], yerr=yerr, fmt="o", color=color, capsize=4)
        ax.axhline(1.0, color="k", ls=":", lw=1)
        _log_y(ax)
        ax.set_xlabel("validation loss (nats/token)")
        ax.set_ylabel(f"compute multiplier over {result['baseline']}")
        ax.set_title("C_baseline(L) / C_arch(L) with the 90% bootstrap interval", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
