"""AttnRes at a config's own depth on a GPU: none / snapshot / block_sum / full in the narrow model that
``k3.audit.measure.depth_config`` builds (the depth, mixer schedule and AttnRes blocks kept; d = 256), one
forward + backward of [1, tokens] under bf16 autocast per mode: activation bytes saved for backward, the pass's
peak memory, the analytic mix FLOPs, the first pass's time (TorchInductor compiles included) and the time.

    python benchmarks/attn_res_depth.py [--preset k3] [--tokens 4096] [--repeats 5] [--modes none snapshot ...]

At 93 layers the first pass compiles the AttnRes ops once per distinct number of sources, minutes in all, so each
mode runs in its own process: they compile side by side, then wait for each other and take turns on the GPU
(modes interleaved, one pass at a time). Progress goes to stderr. Writes benchmarks/results/attn_res_depth.{json,md}
(or $K3_BENCH_OUT), which ``k3 audit`` reads (section 7).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.multiprocessing as mp

from k3.audit.measure import attn_res_depth_rows, depth_config, depth_model, depth_tokens, saved_tensor_bytes
from k3.bench.common import environment, write_results
from k3.config import get_preset

COLUMNS = [
    "mode",
    "saved_bytes_per_token",
    "saved_vs_none",
    "peak_bytes",
    "peak_vs_none",
    "mix_flops_share",
    "first_pass_s",
    "ms",
    "ms_median",
    "ms_vs_none",
]
MODES = ("none", "snapshot", "block_sum", "full")


def _worker(rank: int, a: argparse.Namespace, barrier, queue) -> None:
    """Mode a.modes[rank]: build, run the first (compiling) pass, then on each repeat wait for its turn."""
    mode, t0 = a.modes[rank], time.perf_counter()
    base = depth_config(get_preset(a.preset), a.hidden)
    x = depth_tokens(base, a.tokens, "cuda")
    model = depth_model(base, mode).cuda()
    saved, first, _ = saved_tensor_bytes(model, x, autocast=True)
    print(
        f"{mode}: first pass {first:.1f} s (built and compiled after {time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    barrier.wait()
    times, peak = [], 0
    for _ in range(a.repeats):
        for turn in range(len(a.modes)):
            if turn == rank:
                _, seconds, peak = saved_tensor_bytes(model, x, autocast=True)
                times.append(seconds)
            barrier.wait()
    print(f"{mode}: {1e3 * min(times):.1f} ms (min of {a.repeats})", file=sys.stderr, flush=True)
    queue.put((mode, {"saved": saved, "first": first, "times": times, "peak": peak}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attn_res_depth.py measures on a GPU; `k3 audit --measure` gives the CPU form")
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(len(a.modes)), ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(i, a, barrier, queue)) for i in range(len(a.modes))]
    for proc in procs:
        proc.start()
    got = {}
    while len(got) < len(a.modes):
        if not queue.empty():
            mode, m = queue.get()
            got[mode] = m
        elif any(proc.exitcode not in (None, 0) for proc in procs):  # the others would wait at the barrier
            for proc in procs:
                proc.kill()
            raise SystemExit("a mode's process failed (its error is above)")
        else:
            time.sleep(0.5)
    for proc in procs:
        proc.join()
    base = depth_config(get_preset(a.preset), a.hidden)
    d = attn_res_depth_rows(base, a.tokens, {m: got[m] for m in a.modes}, 1, torch.cuda.get_device_name())
    meta = {**environment(), **{k: v for k, v in d.items() if k != "rows"}, "preset": a.preset}
    notes = (
        f"`{d['config']}`: {d['layers']} layers, d = {d['hidden_size']}, AttnRes blocks of {d['block_size']} layers; "
        f"one forward + backward of [1, {d['tokens']}] tokens under bf16 autocast per mode, min and median of "
        f"{d['repeats']} after a first pass, modes interleaved (one process per mode, one pass on the GPU at a time). "
        "saved: bytes autograd keeps for backward (each storage once, parameters excluded); peak: the most the pass "
        "allocated above what was allocated before it; mix_flops_share: the depth mixes' FLOPs (analytic) over the "
        "model's forward FLOPs; first_pass_s: the first forward + backward, TorchInductor's compiles of the fused "
        "ops included (the modes compile side by side, sharing the CPU)."
    )
    write_results("attn_res_depth", d["rows"], COLUMNS, meta, notes)


if __name__ == "__main__":
    main()
