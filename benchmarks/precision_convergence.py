"""Convergence of the routed experts' low-precision training forms against bf16: the same preset, data, seeds and
steps per arm, several seeds, runs side by side.

    python benchmarks/precision_convergence.py [--arms bf16,fp8,qat] [--seeds 0,1,2] [--steps 2000] [--jobs 6]
                                               [--preset small] [--batch-size 16] [--seq-len 512] [--data SPEC]
                                               [--out DIR]

The default data (k3.data.corpus.PACKAGES_MIXTURE, ~50M tokens) is large enough that a run of 2000 steps of 16 x 512
(16.4M tokens) reads no token twice; each run tokenises only the rows it trains on. Arms: ``bf16`` (bf16 autocast,
the default training), ``fp8`` (``--fp8-experts``: the expert matmuls in FP8, k3.quant.fp8), ``qat`` (``--qat
mxfp4``: MXFP4 weights + MXFP8 activations fake-quantised, k3.quant.qat). Every run trains into OUT/runs/ARM-sSEED
(resumable; a finished run is skipped) with one shared tokenizer. Writes benchmarks/results/precision_convergence.
{json,md} (or $K3_BENCH_OUT): per arm the final validation loss over seeds and its paired difference to bf16 with a
95% paired t-interval over seeds (n - 1 df, k3.audit.stats), one row per run, and precision_convergence.png:
training and validation loss against step, mean over seeds with the seeds' range.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from pathlib import Path

import numpy as np

from k3.audit.runs import check_jobs, ensure_tokenizer, run_job, run_jobs
from k3.audit.stats import paired_difference
from k3.bench.common import environment, write_results
from k3.data.corpus import PACKAGES_MIXTURE, describe_corpus, pin_corpus
from k3.data.packing import stream_tokens
from k3.train.state import read_metrics
from k3.train.trainer import TrainConfig

ARMS = {"bf16": {}, "fp8": {"fp8_experts": True}, "qat": {"qat": "mxfp4"}}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_configs(a: argparse.Namespace, out: Path, tokenizer: Path) -> list[tuple]:
    """(TrainConfig, meta, plots) of every (arm, seed), validated before any training."""
    jobs = []
    for arm in a.arms:
        for seed in a.seeds:
            cfg = TrainConfig(
                preset=a.preset,
                steps=a.steps,
                batch_size=a.batch_size,
                seq_len=a.seq_len,
                tokenizer=str(tokenizer),
                data=a.data,
                max_tokens=stream_tokens(a.steps, a.batch_size, a.seq_len),  # the rows the run trains on
                eval_every=max(1, a.steps // 10),
                eval_rows=256,
                save_every=max(1, a.steps // 4),
                keep_checkpoints=1,
                samples=0,
                seed=seed,
                device=a.device,
                out=str(out / "runs" / f"{arm}-s{seed}"),
                **ARMS[arm],
            )
            cfg.validate()
            jobs.append((cfg, {"arm": arm, "seed": seed}, False))
    return jobs


def curves(run_dirs: list[str], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) over runs of ``key`` at the steps every run logged it (train loss: EMA 0.9)."""
    per = []
    for d in run_dirs:
        hist = [h for h in read_metrics(d) if key in h and not h.get("skipped")]
        xs, ys, ema = [], [], None
        for h in hist:
            ema = h[key] if key != "loss" or ema is None else 0.9 * ema + 0.1 * h[key]
            xs.append(h["step"])
            ys.append(ema)
        per.append(dict(zip(xs, ys)))
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    if not steps:
        return np.array([]), np.array([]), np.array([]), np.array([])
    m = np.array([[p[s] for s in steps] for p in per])
    return np.array(steps), m.mean(0), m.min(0), m.max(0)


def plot(summaries: list[dict], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, title in ((axes[0], "loss", "training loss (EMA 0.9)"), (axes[1], "val_loss", "validation loss")):
        for i, arm in enumerate(arms):
            dirs = [s["run_dir"] for s in summaries if s["arm"] == arm]
            x, mean, lo, hi = curves(dirs, key)
            if not len(x):
                continue
            ax.plot(
                x,
                mean,
                color=f"C{i}",
                lw=1.3,
                marker="o" if key == "val_loss" else None,
                ms=3,
                label=f"{arm} ({len(dirs)} seeds)",
            )
            ax.fill_between(x, lo, hi, color=f"C{i}", alpha=0.2, lw=0)
        ax.set_xlabel("step")
        ax.set_ylabel("nats/token")
        ax.set_title(f"{title}: mean over seeds, band = the seeds' range", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lows = [s["val_loss"] for s in summaries if s.get("val_loss") is not None]
    if lows:  # the late part of the run, where the arms differ if they do
        axes[1].set_ylim(min(lows) - 0.1, min(lows) + 0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="bf16,fp8", help=f"comma-separated, from {', '.join(ARMS)}; bf16 first")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument(
        "--data",
        default=PACKAGES_MIXTURE,
        help=f"training data as for k3 train (default: {PACKAGES_MIXTURE}, enough that no run repeats its data)",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs side by side")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="runs/precision-convergence")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    a.arms, a.seeds = [x.strip() for x in a.arms.split(",") if x.strip()], _ints(a.seeds)
    if not a.arms or a.arms[0] != "bf16" or any(x not in ARMS for x in a.arms) or len(set(a.arms)) != len(a.arms):
        raise SystemExit(f"--arms={','.join(a.arms)}: distinct names from {', '.join(ARMS)}, bf16 first")
    if not a.seeds:
        raise SystemExit("--seeds: at least one")
    check_jobs(a.jobs)
    a.data = pin_corpus(a.data)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = ensure_tokenizer(out, a.data, 8192, 4_000_000)
    jobs = run_configs(a, out, tokenizer)
    labels = [f"run {Path(cfg.out).name}" for cfg, _, _ in jobs]
    summaries = run_jobs(functools.partial(run_job, progress=False), jobs, a.jobs, None, True, labels)

    by = {arm: {s["seed"]: s["val_loss"] for s in summaries if s["arm"] == arm} for arm in a.arms}
    rows = []
    for arm in a.arms:
        finals = list(by[arm].values())
        d = paired_difference(by["bf16"], by[arm]) if arm != "bf16" else None
        rows.append(
            {
                "arm": arm,
                "seeds": len(finals),
                "val_loss_mean": float(np.mean(finals)),
                "val_loss_std": float(np.std(finals, ddof=1)) if len(finals) > 1 else None,
                "delta_vs_bf16": None if d is None else d["mean"],
                "ci95_lo": None if d is None else d["lo"],
                "ci95_hi": None if d is None else d["hi"],
                "ci95_df": None if d is None or d["lo"] is None else d["df"],
                "wall_s_mean": float(np.mean([s["wall_s"] for s in summaries if s["arm"] == arm])),
            }
        )
    runs = [
        {k: s.get(k) for k in ("arm", "seed", "steps_done", "tokens", "val_loss", "val_loss_init", "train_loss_tail")}
        for s in summaries
    ]
    results_dir = Path(os.environ.get("K3_BENCH_OUT", "benchmarks/results"))
    results_dir.mkdir(parents=True, exist_ok=True)
    plot(summaries, a.arms, results_dir / "precision_convergence.png")
    first = summaries[0]
    notes = (
        f"Preset {a.preset}, {a.steps} steps of {a.batch_size} x {a.seq_len} tokens ({first['tokens']:,} tokens a "
        f"run) of {describe_corpus(a.data)}, seeds {', '.join(map(str, a.seeds))} (a seed fixes the initial weights "
        "and the data order, so arms pair by seed); delta_vs_bf16 = the arm's final validation loss minus bf16's, "
        "mean over seeds, with its 95% paired t-interval over seeds (n - 1 df: ci95_df; k3.audit.stats). "
        "wall_s_mean: runs shared the machine when --jobs > 1. Curves: precision_convergence.png. Per run: "
        + "; ".join(f"{r['arm']} s{r['seed']} {r['val_loss']:.4f}" for r in runs)
    )
    meta = {**environment(), "arms": a.arms, "steps": a.steps, "preset": a.preset, "data": a.data, "runs": runs}
    columns = ["arm", "seeds", "val_loss_mean", "val_loss_std", "delta_vs_bf16", "ci95_lo", "ci95_hi", "ci95_df"]
    columns.append("wall_s_mean")
    write_results("precision_convergence", rows, columns, meta, notes)


if __name__ == "__main__":
    main()
