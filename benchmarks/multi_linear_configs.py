"""The decode step's input maps (k3.ops.linear.multi_linear): the Triton kernel's launch configurations one by one
vs its launch rule (k3.ops.linear.triton_multi.launch_config), torch's one GEMV per weight and one cuBLAS GEMM over
the concatenated weights, each replayed from a CUDA graph, against the bandwidth limit (weight bytes / copy
bandwidth).

    python benchmarks/multi_linear_configs.py [--batches 1,16,64]

Shapes: the decode benchmark's KDA layer (q, k, v, f_a, b, g_a of a 1024-wide input), its MLA layer (q_proj,
kv_a_proj_with_mqa) and its MoE layer (the shared experts' gate and up). Each graph runs the maps of several weight
sets (at least 256 MiB in all, more than the L2 cache holds), so the weights come from HBM as in a decode step.
Writes $K3_BENCH_OUT/multi_linear_configs.{json,md} when set, else benchmarks/results/.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from k3.bench.common import copy_bandwidth, cuda_time, environment, write_results
from k3.ops.linear import triton_multi
from moe_decode_mm import graphed  # this folder is on sys.path when the script runs

SHAPES = {
    "KDA q,k,v,f_a,b,g_a": [1024, 1024, 1024, 64, 16, 64],
    "MLA q,kv_a": [3072, 576],
    "MoE shared gate,up": [512, 512],
}
K = 1024


def graph_time(fn, reps: int) -> float:
    """Seconds per call of fn (which makes ``reps`` calls), replayed from a CUDA graph."""
    return cuda_time(graphed(fn), warmup=3, iters=10) / reps


def time_forms(forms: dict, reps: int, label: str) -> list[tuple[float, str]]:
    """(seconds per call, name) of each form (a callable making ``reps`` calls) that runs, fastest first; a
    configuration that does not compile (shared memory) is printed and left out."""
    results = []
    for form, fn in forms.items():
        try:
            results.append((graph_time(fn, reps), form))
        except Exception as e:
            print(f"{label} {form}: {type(e).__name__}", flush=True)
    return sorted(results)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64")
    a = p.parse_args()
    bw = copy_bandwidth()
    rows = []
    for name, sizes in SHAPES.items():
        nbytes = sum(sizes) * K * 2
        sets = max(4, (256 << 20) // nbytes)
        weights = [[torch.randn(n, K, device="cuda", dtype=torch.bfloat16) for n in sizes] for _ in range(sets)]
        cat = [torch.cat(ws) for ws in weights]
        for batch in (int(b) for b in a.batches.split(",")):
            x = torch.randn(batch, K, device="cuda", dtype=torch.bfloat16)
            ys = [x.new_empty(batch, n) for n in sizes]
            bm = triton_multi.block_m(batch)
            limit = nbytes / bw
            forms = {
                "launch rule": lambda: [triton_multi.multi_linear(x, ws) for ws in weights],
                "torch per weight": lambda: [[F.linear(x, w) for w in ws] for ws in weights],
                "cuBLAS concatenated": lambda: [F.linear(x, w) for w in cat],
            }
            for bn, bk, st, wp in itertools.product((16, 32, 64), (128, 256), (3, 4), (2, 4, 8)):
                forms[f"BN={bn} BK={bk} stages={st} warps={wp}"] = lambda bn=bn, bk=bk, st=st, wp=wp: [
                    triton_multi._run(x, ws, ys, bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=wp)
                    for ws in weights
                ]
            results = time_forms(forms, sets, f"{name} B={batch}")
            keep = [r for r in results if not r[1].startswith("BN=")]  # and the six fastest configurations:
            keep += [r for r in results if r[1].startswith("BN=")][:6]
            for t, form in sorted(keep):
                rows.append({"maps": name, "batch": batch, "form": form, "us": t * 1e6, "of_limit": limit / t})
                print(rows[-1], flush=True)
            write_results(
                "multi_linear_configs",
                rows,
                ["maps", "batch", "form", "us", "of_limit"],
                environment() | {"copy_bandwidth_TBps": bw / 1e12},
            )


if __name__ == "__main__":
    main()
