"""Checkpoint loading against the disk: ``from_pretrained`` (k3.checkpoint.load) beside raw reads of the same files.

    python benchmarks/load_speed.py [--ckpt DIR | --preset small-1b --gb 4 --shard-gb 1] [--workers N]
                                    [--device cpu|cuda] [--repeats 2] [--keep]

Without ``--ckpt`` it writes a random bf16 checkpoint of ``--preset`` with k3's save path (``save_pretrained``), its
routed experts scaled (``moe.num_experts``) to about ``--gb`` GB in ``--shard-gb`` GB shards, in a temporary
directory ($TMPDIR; removed afterwards unless ``--keep``). Then, each "cold" run after
dropping the shards from the page cache (fsync + ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every shard, no root
needed; pages another process maps stay) and each "warm" run right after a full read:

- raw sequential read: every shard in order, plain ``readinto`` a reused 64 MiB buffer, no hashing;
- raw parallel read: the shards ``--workers`` at a time, one buffer per thread;
- SHA-256 alone: hashlib over an in-memory buffer, one thread and ``--workers`` threads (no I/O);
- ``from_pretrained`` with ``workers=1`` (shards one after another) and with the default / ``--workers``.

Each the fastest of ``--repeats`` runs (other processes may share the cores), as GB/s and as a ratio to the raw
sequential read in the same cache state. Results: benchmarks/results/load_speed.{md,json}
(k3.bench.common.write_results; $K3_BENCH_OUT to write elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from k3.bench.common import environment, write_results
from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.checkpoint.load import default_workers, from_pretrained
from k3.model.decoder import K3ForCausalLM

COLUMNS = ["what", "cache", "workers", "seconds", "GB_per_s", "vs_raw_sequential"]
BLOCK = 64 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def scaled_config(preset: str, gb: float):
    """``preset`` with its routed experts scaled so that the bf16 model holds about ``gb`` GB."""
    cfg = get_preset(preset)

    def size(c) -> int:
        with torch.device("meta"):
            return 2 * sum(p.numel() for p in K3ForCausalLM(c).parameters())

    e = cfg.moe.num_experts
    base, more = size(cfg), size(cfg.replace(**{"moe.num_experts": 2 * e}))
    per_expert = (more - base) / e
    experts = max(cfg.moe.num_experts_per_token, round(e + (gb * 1e9 - base) / per_expert))
    return cfg.replace(**{"moe.num_experts": experts})


def build(directory: Path, preset: str, gb: float, shard_gb: float) -> None:
    cfg = scaled_config(preset, gb)
    log(f"building {preset} with {cfg.moe.num_experts} routed experts (~{gb} GB bf16) in {directory}")
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    model.to_empty(device="cpu").cast(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.uniform_(-0.05, 0.05, generator=gen)
    save_pretrained(model, directory, max_shard_bytes=int(shard_gb * 1e9))


def shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def drop_cache(files: list[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (written pages are flushed first, else they stay)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(path: Path, buf: memoryview) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            n += got
    return n


def raw_sequential(files: list[Path]) -> int:
    buf = memoryview(bytearray(BLOCK))
    return sum(read_all(p, buf) for p in files)


def raw_parallel(files: list[Path], workers: int) -> int:
    """The files ``workers`` at a time, each thread reading into its own reused buffer."""
    local = threading.local()

    def one(p: Path) -> int:
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(BLOCK))
        return read_all(p, local.buf)

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(one, files))


def hash_seconds(total: int, threads: int) -> float:
    """Seconds to SHA-256 ``total`` bytes of memory spread over ``threads`` threads (from hashing at most 2 GB a
    thread)."""
    buf = memoryview(os.urandom(BLOCK))
    per = max(1, min(total, 2 * 10**9 * threads) // (threads * BLOCK))

    def one(_) -> None:
        h = hashlib.sha256()
        for _ in range(per):
            h.update(buf)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    return (time.perf_counter() - t0) * total / (per * threads * BLOCK)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, help="an existing checkpoint directory (not written, not removed)")
    ap.add_argument("--preset", default="small-1b")
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest is kept")
    ap.add_argument("--gb", type=float, default=4.0, help="size of the checkpoint to write (GB)")
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--workers", type=int, help="parallel reads / from_pretrained workers (default: its own)")
    ap.add_argument("--device", default="cpu", help="where from_pretrained puts the model (cpu, cuda)")
    ap.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    args = ap.parse_args()

    tmp = None
    if args.ckpt is None:
        tmp = Path(tempfile.mkdtemp(prefix="k3-load-speed-"))
        directory = tmp / "ckpt"
        build(directory, args.preset, args.gb, args.shard_gb)
        gc.collect()
    else:
        directory = args.ckpt
    try:
        files = shards(directory)
        total = sum(p.stat().st_size for p in files)
        workers = args.workers or default_workers(len(files))
        rows: list[dict] = []
        base: dict[str, float] = {}

        def measure(what: str, cache: str, n_workers: int, fn) -> None:
            if cache == "warm":
                raw_sequential(files)  # make sure it is all cached
            seconds = float("inf")
            for _ in range(args.repeats):
                if cache == "cold":
                    drop_cache(files)
                t0 = time.perf_counter()
                fn()
                seconds = min(seconds, time.perf_counter() - t0)
                gc.collect()
            if what == "raw sequential read":
                base[cache] = seconds
            row = {"what": what, "cache": cache, "workers": n_workers, "seconds": round(seconds, 2)}
            row["GB_per_s"] = round(total / seconds / 1e9, 3)
            row["vs_raw_sequential"] = round(base[cache] / seconds, 3) if cache in base else None
            rows.append(row)
            log(f"{what} ({cache}, {n_workers} workers): {seconds:.2f}s, {row['GB_per_s']} GB/s")

        def load(n: int):
            def run() -> None:
                model = from_pretrained(directory, device=args.device, workers=n)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                del model

            return run

        for cache in ("cold", "warm"):
            measure("raw sequential read", cache, 1, lambda: raw_sequential(files))
            measure("raw parallel read", cache, workers, lambda: raw_parallel(files, workers))
            measure("from_pretrained", cache, 1, load(1))
            measure("from_pretrained", cache, workers, load(workers))
        for threads in (1, workers):
            seconds = min(hash_seconds(total, threads) for _ in range(args.repeats))
            rows.append(
                {
                    "what": "SHA-256 alone (memory)",
                    "cache": "-",
                    "workers": threads,
                    "seconds": round(seconds, 2),
                    "GB_per_s": round(total / seconds / 1e9, 3),
                    "vs_raw_sequential": round(base["cold"] / seconds, 3),
                }
            )
            log(f"sha256 on {threads} threads: {total / seconds / 1e9:.3f} GB/s")
        meta = environment() | {
            "checkpoint": str(args.ckpt) if args.ckpt else f"random {args.preset}, {len(files)} shards",
            "bytes": total,
            "shards": len(files),
            "device_target": args.device,
            "cpus": os.cpu_count(),
        }
        notes = (
            f"Fastest of {args.repeats} runs each. cold: after fsync + posix_fadvise(DONTNEED) on every shard; "
            "warm: right after a full sequential read. "
            "vs_raw_sequential: the raw sequential read's time in the same cache state over this row's time "
            "(SHA-256 rows: against the cold read). from_pretrained verifies every shard's SHA-256 and that "
            "floating tensors are finite."
        )
        write_results("load_speed", rows, COLUMNS, meta, notes)
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
