"""Distributed training on N GPUs against one GPU, same data, same global batch.

    python benchmarks/multi_gpu.py --gpus 2 [--preset small-1b] [--steps 50] [--rows 4] [--seq-len 2048]

1. one shared tokenizer (trained once into OUT/tokenizer.json);
2. the 1-GPU run: ``k3 train`` with a global batch of gpus x rows rows (it fills Triton's caches first);
3. the N-GPU run: ``torchrun --nproc-per-node N -m k3 train --dp N --ep N`` with rows per rank (FSDP2 for the
   dense part, the routed experts split over the N ranks, latent all-to-all);
4. the N-GPU run's DCP checkpoint loaded into a plain single-process model (``load_into_single``) and evaluated
   on the same validation rows as the runs' own final evaluation;
5. rows of benchmarks/results/multi_gpu.{json,md} (or $K3_BENCH_OUT): per-step loss agreement, tokens/s per GPU
   (median over the steps after ``--warmup``), scaling efficiency (per-GPU tokens/s on N / on 1), the slowest
   rank's share of the step spent in all-to-alls, latent rows per rank (mean over steps) and their max/mean,
   MaxVio, and the DCP-on-1 evaluation.

Tolerance of the loss comparison: both runs are bf16 autocast; the N-GPU step sums the same per-token terms in
another order (per rank, then over ranks, and gradients through an all-to-all), which moves each bf16 result by
up to ~2^-8 relative; over 50 optimiser steps these differences compound through the updates, so we accept a
per-step relative loss difference up to 2e-2 and report the largest. (In fp32 on CPU one step agrees to 1e-6:
tests/distributed/test_train.py.) Multicast NVLink stays off (NCCL_NVLS_ENABLE=0 and friends) in every process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from k3.distributed.mesh import NO_MULTICAST_ENV as NO_MULTICAST  # set for torchrun and its workers too

LOSS_TOL = 2e-2


def train_args(a, out: Path, rows: int, tok: Path) -> list[str]:
    return [
        "-m",
        "k3",
        "train",
        "--preset",
        a.preset,
        "--steps",
        str(a.steps),
        "--batch-size",
        str(rows),
        "--seq-len",
        str(a.seq_len),
        "--tokenizer",
        str(tok),
        "--out",
        str(out),
        "--samples",
        "0",
        "--eval-every",
        str(a.steps),
        "--eval-rows",
        str(a.eval_rows),
        "--save-every",
        "0",
        "--seed",
        "0",
        "--lr",
        str(a.lr),
        "--no-progress",
    ] + sum((["--set", s] for s in a.set), [])


def run(cmd: list[str], log: Path, env: dict) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        sys.exit(f"{' '.join(cmd)} failed with exit code {rc}; see {log}:\n" + log.read_text()[-3000:])
    return time.perf_counter() - t0


def steps_of(history: list[dict]) -> list[dict]:
    return [h for h in history if "loss" in h and "step_time" in h and not h.get("skipped")]


def final_val(history: list[dict]) -> float | None:
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    return vals[-1] if vals else None


def dcp_on_one(a, run_dir: Path, tok: Path, rows: int) -> dict:
    """Load the newest DCP checkpoint of ``run_dir`` into one process and evaluate it as the trainer does."""
    from k3.cli.train import _override
    from k3.checkpoint.dcp import load_into_single
    from k3.checkpoint.format import latest_checkpoint
    from k3.train.trainer import TrainConfig, Trainer

    ckpt = latest_checkpoint(run_dir)
    cfg = TrainConfig(
        preset=a.preset,
        steps=a.steps,
        batch_size=rows,
        seq_len=a.seq_len,
        tokenizer=str(tok),
        out=str(run_dir.parent / "dcp-eval"),
        samples=0,
        eval_rows=a.eval_rows,
        seed=0,
        device=a.device,
        overrides=dict(_override(s) for s in a.set),
    )
    trainer = Trainer(cfg, progress=False)  # builds the model and the same validation rows
    extra = load_into_single(ckpt, trainer.model)
    val = trainer.evaluate()["val_loss"]  # bf16 autocast on GPUs, as in the runs
    return {"checkpoint": str(ckpt), "step": extra.get("step"), "val_loss": val}


def summarise(label: str, history: list[dict], gpus: int, warmup: int) -> dict:
    steps = steps_of(history)
    timed = [h for h in steps if h["step"] >= warmup] or steps
    per_gpu = [h.get("tokens_per_s_per_gpu", h["tokens_per_s"] / gpus) for h in timed]
    row = {
        "run": label,
        "gpus": gpus,
        "steps": len(steps),
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "val_loss": final_val(history),
        "step_s_median": statistics.median(h["step_time"] for h in timed),
        "tokens_per_s_per_gpu": statistics.median(per_gpu),
        "maxvio_last10": statistics.mean(h["maxvio"] for h in steps[-10:] if h.get("maxvio") is not None),
    }
    if "a2a_share" in timed[0]:
        rows = [h["ep_rows_per_rank"] for h in timed]
        row.update(
            a2a_share_median=statistics.median(h["a2a_share"] for h in timed),
            a2a_s_median=statistics.median(max(h["a2a_s_per_rank"]) for h in timed),
            ep_rows_per_rank_mean=[round(statistics.mean(r[i] for r in rows)) for i in range(len(rows[0]))],
            ep_rows_imbalance_median=statistics.median(h["ep_rows_imbalance"] for h in timed),
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--preset", default="small-1b")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rows", type=int, default=4, help="rows per GPU (the 1-GPU run takes gpus x rows)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-rows", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=8192, help="the shared BPE's vocabulary")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput medians")
    p.add_argument("--set", action="append", default=[], help="config override FIELD=VALUE (repeatable)")
    p.add_argument("--out", default="runs/multi-gpu")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a gloo rehearsal)")
    a = p.parse_args()

    from k3.audit.runs import ensure_tokenizer
    from k3.train.trainer import read_metrics
    from k3.bench.common import environment, write_results

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    if a.device == "cpu":
        env["K3_DIST_DEVICE"] = "cpu"
    logs = Path(os.environ.get("K3_BENCH_OUT", out))
    logs.mkdir(parents=True, exist_ok=True)
    tok = ensure_tokenizer(out, None, a.vocab_size, 4_000_000)
    one, many = out / "gpu1", out / f"gpu{a.gpus}"
    wall = {}
    if len(steps_of(read_metrics(one))) < a.steps:
        shutil.rmtree(one, ignore_errors=True)  # a run cut short (say, by a time limit) starts over
        wall["gpu1"] = run(
            [sys.executable] + train_args(a, one, a.rows * a.gpus, tok) + ["--device", a.device], logs / "gpu1.log", env
        )
    if len(steps_of(read_metrics(many))) < a.steps:
        shutil.rmtree(many, ignore_errors=True)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.gpus}"]
        wall[f"gpu{a.gpus}"] = run(
            launcher
            + train_args(a, many, a.rows, tok)  # torchrun -m k3 train ...
            + ["--dp", str(a.gpus), "--ep", str(a.gpus)],
            logs / f"gpu{a.gpus}.log",
            env,
        )
    h1, hn = read_metrics(one), read_metrics(many)
    s1, sn = steps_of(h1), steps_of(hn)
    if len(s1) != len(sn):
        sys.exit(f"step counts differ: 1 GPU {len(s1)}, {a.gpus} GPUs {len(sn)}")
    diffs = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(s1, sn)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    r1 = summarise("1 GPU", h1, 1, a.warmup)
    rn = summarise(f"{a.gpus} GPUs, dp={a.gpus} ep={a.gpus} (FSDP2 + expert parallel)", hn, a.gpus, a.warmup)
    rn["scaling_efficiency"] = rn["tokens_per_s_per_gpu"] / r1["tokens_per_s_per_gpu"]
    rn["loss_max_rel_diff"] = diffs[worst]
    rn["loss_max_rel_diff_step"] = s1[worst]["step"]
    rn["loss_within_tol"] = diffs[worst] <= LOSS_TOL
    dcp = dcp_on_one(a, many, tok, a.rows * a.gpus)
    rn["dcp_on_1_val_loss"] = dcp["val_loss"]
    rn["dcp_on_1_rel_diff"] = abs(dcp["val_loss"] - rn["val_loss"]) / rn["val_loss"]
    curves = {
        "step": [h["step"] for h in s1],
        "loss_1gpu": [h["loss"] for h in s1],
        f"loss_{a.gpus}gpu": [h["loss"] for h in sn],
    }
    meta = environment() | {
        "preset": a.preset,
        "steps": a.steps,
        "global_batch": f"{a.rows * a.gpus} x {a.seq_len}",
        "overrides": a.set,
        "lr": a.lr,
        "warmup_steps_excluded": a.warmup,
        "wall_s": wall,
        "loss_tolerance_rel": LOSS_TOL,
        "curves": curves,
        "dcp": dcp,
        "env": {k: env[k] for k in NO_MULTICAST},
    }
    precision = "bf16 autocast" if a.device == "cuda" else "fp32 (CPU, gloo rehearsal)"
    notes = (
        f"{a.preset}, {a.steps} steps of {a.rows * a.gpus} x {a.seq_len} tokens (same data and order), "
        f"{precision}, seed 0. Loss curves: largest per-step relative difference {diffs[worst]:.2e} at step "
        f"{s1[worst]['step']} (tolerance {LOSS_TOL}). tokens/s per GPU: median over steps >= {a.warmup}. "
        "a2a share: the slowest rank's seconds in EP all-to-alls (CUDA events, forward + backward) over the "
        "step time. ep rows: latent (token, expert) rows each rank's experts received per step (forward). "
        "MaxVio: global batch (loads all-reduced over ranks)."
    )
    write_results(
        "multi_gpu",
        [r1, rn],
        [
            "run",
            "gpus",
            "steps",
            "loss_last",
            "val_loss",
            "step_s_median",
            "tokens_per_s_per_gpu",
            "scaling_efficiency",
            "a2a_share_median",
            "ep_rows_per_rank_mean",
            "ep_rows_imbalance_median",
            "maxvio_last10",
            "loss_max_rel_diff",
            "dcp_on_1_val_loss",
        ],
        meta,
        notes,
    )


if __name__ == "__main__":
    main()
