"""Training runs for the audit's grids and sweeps (k3.audit.ablate, k3.audit.sweeps): one shared tokenizer, one
resumable run with its ``summary.json``, and runs side by side in worker processes.

A run whose ``summary.json`` says it finished with its steps is skipped, one with a checkpoint short of the end is
resumed, one killed before its first checkpoint starts over (:func:`run_one`)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np

from k3.audit.ablate_report import finite
from k3.checkpoint.format import latest_checkpoint
from k3.train.trainer import read_metrics

log = logging.getLogger("k3.ablate")


def ensure_tokenizer(out: Path, data: str | None, vocab_size: int, train_bytes: int) -> Path:
    """Train one byte-level BPE on a sample of the training split (k3.data.corpus.tokenizer_texts) into
    ``OUT/tokenizer.json`` (kept if present)."""
    from k3.data.corpus import load_corpus, tokenizer_texts
    from k3.data.tokenizer import train_bpe

    path = out / "tokenizer.json"
    if path.is_file():
        return path
    t0 = time.perf_counter()
    train_bpe(tokenizer_texts(load_corpus(data, "train"), train_bytes), vocab_size).save(out)
    log.info("shared tokenizer (vocab %d) trained in %.1fs: %s", vocab_size, time.perf_counter() - t0, path)
    return path


def _checkpoint_step(run_dir: Path) -> int | None:
    try:
        ckpt = latest_checkpoint(run_dir)
    except FileNotFoundError:
        return None
    return None if ckpt is None else int(ckpt.name.split("-")[1])


def summarise_history(history: list[dict], tail: int | None = None) -> dict:
    """Final validation numbers and the mean of MaxVio / dead experts over the last ``tail`` good steps."""
    good = [h for h in history if not h.get("skipped")]
    tail = tail or max(1, min(20, len(good) // 5))
    last = good[-tail:]
    evals = [h for h in history if "val_loss" in h]
    init = [h for h in history if "val_loss_init" in h]

    def tail_mean(key: str) -> float | None:
        xs = [h[key] for h in last if finite(h.get(key))]
        return float(np.mean(xs)) if xs else None

    return {
        "steps_done": history[-1]["step"] + 1 if history else 0,
        "tokens": history[-1]["tokens"] if history else 0,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_bpb": evals[-1]["val_bpb"] if evals else None,
        "val_loss_init": init[0]["val_loss_init"] if init else None,
        "train_loss_tail": float(np.mean([h["loss"] for h in last if finite(h.get("loss"))])) if last else None,
        "maxvio": tail_mean("maxvio"),
        "maxvio_micro": tail_mean("maxvio_micro"),
        "maxvio_seq": tail_mean("maxvio_seq"),
        "drop_cf1": tail_mean("drop_cf1"),
        "drop_cf125": tail_mean("drop_cf125"),
        "dead_experts": tail_mean("dead_experts"),
        "skipped_steps": sum(1 for h in history if h.get("skipped")),
        "step_time_total": float(sum(h.get("step_time", 0.0) for h in history)),
        "tail_steps": tail,
    }


def hardware(device: str) -> str:
    """What a run trained on, for its summary: the GPU's name or the CPU thread count, and the ops backend."""
    import torch

    from k3.infer.load import resolve_device
    from k3.ops import backend

    dev = resolve_device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    return f"{name}, backend {backend.get_backend()}"


def run_one(cfg, meta: dict, progress: bool = False, plots: bool = True) -> dict:
    """Train (or skip / resume) one run and write ``summary.json`` next to its metrics; returns the summary.

    ``meta`` (variant, seed, label, parameter counts, ...) is stored in the summary as is.
    """
    from k3.train.trainer import Trainer, TrainingDiverged

    run_dir = Path(cfg.out)
    summary_path = run_dir / "summary.json"
    step = _checkpoint_step(run_dir) if run_dir.exists() else None
    status, wall = "done", None
    summary = finished_summary(cfg)
    if summary is not None:
        # a finished run is skipped even if its checkpoints were deleted (e.g. only summaries and metrics were
        # kept from a GPU machine); a diverged one only while its checkpoint is where it stopped
        if summary["status"] == "done":
            skip = step is None or step >= cfg.steps
        else:
            skip = step is not None and step == summary.get("checkpoint_step")
        if skip:
            summary["skipped"] = True
            return summary
    if step is None or step < cfg.steps:
        resume = step is not None
        if not resume and run_dir.exists():
            shutil.rmtree(run_dir)  # killed before its first checkpoint: start over
        before = sum(h.get("step_time", 0.0) for h in read_metrics(run_dir)[: step or 0]) if resume else 0.0
        log.info("%s %s (%d steps)", "resuming" if resume else "running", run_dir, cfg.steps)
        t0 = time.perf_counter()
        trainer = Trainer(cfg, resume=resume, progress=progress)
        trainer.figures = plots  # expert_loads.json is written either way (the router frontier reads it)
        try:
            trainer.run()
        except TrainingDiverged as e:
            log.warning("%s: %s", run_dir, e)
            status = "diverged"
        wall = before + time.perf_counter() - t0
    history = read_metrics(run_dir)
    summary = {
        **meta,
        **summarise_history(history),
        "steps": cfg.steps,
        "status": status,
        "checkpoint_step": _checkpoint_step(run_dir),
        "wall_s": wall if wall is not None else float(sum(h.get("step_time", 0.0) for h in history)),
        "run_dir": str(run_dir),
    }
    if wall is not None:
        summary["hardware"] = hardware(cfg.device)
    if "flops_per_token" in meta and summary["tokens"]:  # forward + backward: 3x the forward, attention counted
        summary["compute"] = 3.0 * meta["flops_per_token"] * summary["tokens"]
    elif "params_activated" in meta and summary["tokens"]:
        summary["compute"] = 6.0 * meta["params_activated"] * summary["tokens"]
    summary_path.write_text(json.dumps(summary, indent=2))
    summary["skipped"] = False
    return summary


def run_job(job: tuple, progress: bool = False) -> dict:
    """``run_one(cfg, meta, plots=plots)`` for a ``(cfg, meta, plots)`` job (module level: a pool worker)."""
    cfg, meta, plots = job
    return run_one(cfg, meta, progress=progress, plots=plots)


def _worker_init(threads: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s [worker] %(message)s", datefmt="%H:%M:%S")
    import torch

    torch.set_num_threads(threads)


def check_jobs(jobs) -> None:
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs={jobs!r} must be a positive integer")


def run_jobs(
    fn: Callable,
    jobs: list,
    workers: int = 1,
    done: Callable | None = None,
    warm_first: bool = True,
    labels: list[str] | None = None,
) -> list:
    """``[fn(job) for job in jobs]``, in order; ``done(i, result)`` is called as each one finishes.

    ``workers > 1``: the first job runs alone in this process (it fills the Triton compile and autotune caches
    that the others then read; ``warm_first=False`` when they are warm already), the rest in a pool of
    ``workers`` spawned processes sharing the machine and its GPU (small models leave a GPU mostly idle, so runs
    side by side finish sooner; each keeps its own seed and results). ``fn`` must be a module-level function (it
    is pickled; a ``functools.partial`` of one too). A failing job is logged when it fails; the others finish;
    then one RuntimeError names them all (by ``labels``, else by number).
    """
    check_jobs(workers)
    labels = labels or [f"job {i + 1}" for i in range(len(jobs))]
    results: list = [None] * len(jobs)
    serial = len(jobs) if workers == 1 else min(int(warm_first), len(jobs))
    for i in range(serial):
        results[i] = fn(jobs[i])
        if done:
            done(i, results[i])
    if serial == len(jobs):
        return results
    import concurrent.futures as cf
    import multiprocessing
    import os

    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    workers = min(workers, len(jobs) - serial)
    threads = max(1, (os.cpu_count() or 1) // workers)
    log.info("running %d jobs in %d worker processes (%d CPU threads each)", len(jobs) - serial, workers, threads)
    with cf.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init, initargs=(threads,)
    ) as pool:
        futures = {pool.submit(fn, jobs[i]): i for i in range(serial, len(jobs))}
        failed = []
        for fut in cf.as_completed(futures):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except Exception as e:  # the others go on; this one is reported now and again at the end
                log.error("%s failed: %s", labels[i], e, exc_info=e)
                failed.append((i, e))
                continue
            if done:
                done(i, results[i])
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(jobs)} jobs failed (the others finished and are kept): "
            + "; ".join(f"{labels[i]}: {type(e).__name__}: {e}" for i, e in sorted(failed, key=lambda f: f[0]))
        )
    return results


def finished_summary(cfg) -> dict | None:
    """The ``summary.json`` of a run of ``cfg`` that finished (done, or diverged) with ``cfg.steps``, else None."""
    path = Path(cfg.out) / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    if s.get("steps") != cfg.steps or s.get("status") not in ("done", "diverged"):
        return None
    return s | {"run_dir": str(Path(cfg.out))}  # where it is now: a grid's runs can be unpacked elsewhere
