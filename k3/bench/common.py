"""Shared benchmark helpers: CUDA-event timing, measured ceilings, result files."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from k3.tables import markdown_table


def cuda_time(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
    """Mean seconds per call of ``fn`` (CUDA events, after warm-up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def graph_seconds(fn, iters: int = 20) -> float:
    """Seconds per call of ``fn`` (no host syncs inside) replayed from a CUDA graph, after two runs on a side stream
    (compilation, autotuning)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t = cuda_time(graph.replay, warmup=2, iters=iters)
    del graph
    return t


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), 4 GiB buffers."""
    a = torch.empty(2**30, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    t = cuda_time(lambda: b.copy_(a), warmup=2, iters=5)  # noqa: F821
    del a, b
    return 2 * 4 * 2**30 / t


def read_bandwidth() -> float:
    """Device read bandwidth in bytes/s: an fp32 sum over a 4 GiB buffer (reads only). It comes out a few percent
    above the copy figure, so a limit taken from the copy is not tight; nor is this one, which the MLA decode kernel
    exceeds (docs/decisions.md, "Bandwidth limits: the copy and the read rate")."""
    a = torch.ones(2**30, dtype=torch.float32, device="cuda")
    t = cuda_time(lambda: a.sum(), warmup=2, iters=5)  # noqa: F821
    del a
    return 4 * 2**30 / t


def matmul_flops() -> float:
    """bf16 8192^3 matrix-product rate in FLOP/s on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b, warmup=3, iters=10)
    return 2 * 8192**3 / t


def device_activity(events, memcpy: bool = True) -> list:
    """The device's own work among torch.profiler ``events``: CUDA kernels, memsets and (``memcpy``) memory copies.
    Left out are the GPU-side ranges of user annotations (``record_function`` ranges, ``Optimizer.step#...``,
    inductor's graph calls): each spans kernels counted already and the idle gaps between them, so summing them
    with the kernels counts time twice."""
    return [
        e
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.is_user_annotation
        and (memcpy or "memcpy" not in e.name.lower())
    ]


def busy_seconds(events, start: float = float("-inf"), end: float = float("inf")) -> float:
    """Seconds the device works among ``events`` (from :func:`device_activity`) that start in [start, end) us of the
    profiler's clock: the union of their intervals, so work on two streams at once counts once."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if start <= e.time_range.start < end)
    busy, reach = 0.0, float("-inf")
    for s, e in spans:
        busy += max(0.0, e - max(s, reach))
        reach = max(reach, e)
    return busy / 1e6


def device_time(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
    """Mean seconds per call of the device's own work in ``fn`` (torch.profiler: :func:`busy_seconds` of its kernels,
    memsets and copies), leaving out the gaps where the device waits for the host: a call the host cannot keep fed
    reads shorter here than by :func:`cuda_time`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return busy_seconds(device_activity(prof.events())) / iters


def environment() -> dict:
    p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {
        "torch": torch.__version__,
        "device": p.name if p else "cpu",
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_results(
    name: str, rows: list[dict], columns: list[str], meta: dict, notes: str = "", out_dir: str | None = None
) -> Path:
    """benchmarks/results/NAME.json and NAME.md (or $K3_BENCH_OUT / out_dir)."""
    out = Path(out_dir or os.environ.get("K3_BENCH_OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "notes": notes}, indent=1))
    md = f"# {name}\n\n{markdown_table(rows, columns)}\n\n{notes}\n\n`{json.dumps(meta)}`\n"
    (out / f"{name}.md").write_text(md)
    print(md, flush=True)
    return out


def write_profile(name: str, text: str, echo: bool = True) -> None:
    """A profile script's report: printed (unless ``echo`` is off), and $K3_BENCH_OUT/NAME.txt when that is set."""
    if echo:
        print(text, flush=True)
    if os.environ.get("K3_BENCH_OUT"):
        out = Path(os.environ["K3_BENCH_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.txt").write_text(text.lstrip("\n") + "\n")
