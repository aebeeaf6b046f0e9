"""The decode step's input maps (k3.ops.linear.multi_linear): the Triton kernel's launch configurations one by one
vs its launch rule (k3.ops.linear.triton_multi.launch_config), torch's one GEMV per weight and one cuBLAS GEMM over
the concatenated weights, each replayed from a CUDA graph, against the bandwidth limit (weight bytes / copy
bandwidth).

    python benchmarks/multi_linear_configs.py [--batches 1,16,64] [--widths decode|k3]

Shapes (``--widths decode``): the decode benchmark's KDA layer (q, k, v, f_a, b, g_a of a 1024-wide input), its MLA
layer (q_proj, kv_a_proj_with_mqa) and its MoE layer (the shared experts' gate and up). ``--widths k3``: the calls
of a k3-slice decode step at K3's widths (d 7168): a KDA layer's six maps and its o_proj, a MoE layer's four (the
latent down-projection, the shared experts' gate and up, the fp32 router last, fp32 out) and the shared experts'
down-projection, an MLA layer's three (q_a, kv_a, g). Each graph runs the maps of several weight sets (at least
256 MiB in all, more than the L2 cache holds), so the weights come from HBM as in a decode step.
Writes multi_linear_configs{,-k3}.{json,md} to $K3_BENCH_OUT when set, else benchmarks/results/.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from k3.bench.common import copy_bandwidth, environment, graph_seconds, write_results
from k3.ops.linear import triton_multi

# name: (input width K, output widths N_i, how many of the last ones are fp32 weights with fp32 outputs)
WIDTHS = {
    "decode": {
        "KDA q,k,v,f_a,b,g_a": (1024, [1024, 1024, 1024, 64, 16, 64], 0),
        "MLA q,kv_a": (1024, [3072, 576], 0),
        "MoE shared gate,up": (1024, [512, 512], 0),
    },
    "k3": {
        "K3 KDA q,k,v,f_a,b,g": (7168, [12288, 12288, 12288, 128, 96, 12288], 0),
        "K3 KDA o_proj": (12288, [7168], 0),
        "K3 MoE latent,shared gate,up,router": (7168, [3584, 6144, 6144, 896], 1),
        "K3 MoE shared down": (6144, [7168], 0),
        "K3 MLA q_a,kv_a,g": (7168, [1536, 576, 12288], 0),
    },
}
GRIDS = {  # (BLOCK_N, BLOCK_K, num_stages, num_warps) tried beside the launch rule
    "decode": list(itertools.product((16, 32, 64), (128, 256), (3, 4), (2, 4, 8))),
    "k3": list(itertools.product((16, 32, 64), (128, 256), (3, 5), (4,))) + [(32, 128, 4, 8), (64, 256, 4, 8)],
}


def graph_time(fn, reps: int) -> float:
    """Seconds per call of fn (which makes ``reps`` calls), replayed from a CUDA graph."""
    return graph_seconds(fn, iters=10) / reps


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
    p.add_argument("--widths", default="decode", choices=sorted(WIDTHS))
    a = p.parse_args()
    bw = copy_bandwidth()
    rows = []
    name_of = "multi_linear_configs" + ("" if a.widths == "decode" else f"-{a.widths}")
    for name, (K, sizes, fp32) in WIDTHS[a.widths].items():
        dtypes = [torch.bfloat16] * (len(sizes) - fp32) + [torch.float32] * fp32
        nbytes = sum(n * K * dt.itemsize for n, dt in zip(sizes, dtypes))
        sets = max(4 if a.widths == "decode" else 1, (256 << 20) // nbytes)
        weights = [[torch.randn(n, K, device="cuda", dtype=dt) for n, dt in zip(sizes, dtypes)] for _ in range(sets)]
        cat = [torch.cat([w.bfloat16() for w in ws]) for ws in weights]
        for batch in (int(b) for b in a.batches.split(",")):
            x = torch.randn(batch, K, device="cuda", dtype=torch.bfloat16)
            ys = [x.new_empty(batch, n, dtype=x.dtype if dt == torch.bfloat16 else dt) for n, dt in zip(sizes, dtypes)]
            bm = triton_multi.block_m(batch)
            limit = nbytes / bw
            forms = {
                "launch rule": lambda: [triton_multi.multi_linear(x, ws, fp32) for ws in weights],
                "torch per weight": lambda: [[F.linear(x.to(w.dtype), w) for w in ws] for ws in weights],
                "cuBLAS concatenated (bf16)": lambda: [F.linear(x, w) for w in cat],
            }
            for bn, bk, st, wp in GRIDS[a.widths]:
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
                name_of,
                rows,
                ["maps", "batch", "form", "us", "of_limit"],
                environment() | {"copy_bandwidth_TBps": bw / 1e12},
            )


if __name__ == "__main__":
    main()
