"""The decode step's expert matmuls (k3.ops.moe.small_groups): each launch configuration of the up-projection + GLU
kernel and of the down-projection kernel one by one, against the configuration Triton's autotuner picks in the
same process, each replayed from a CUDA graph, against the bandwidth limit (the hit experts' weight bytes / copy
bandwidth).

    python benchmarks/small_groups_configs.py [--batches 64,16,1] [--shape kimi-linear-1.3b]

Why: both kernels are autotuned on the key (N, K, BLOCK_M[, SITU]), and BLOCK_M is 16 at every decode batch of the
decode benchmark's model (B=1: 520 buffer rows over 64 experts; B=64: 1024), so the configuration tuned at the first
batch a process runs (B=1 in `k3 bench decode --cases targets`) serves all of them; and the autotuner times each
kernel alone, where the input maps' kernel (k3.ops.linear.triton_multi) measured 2x slower in the step with its
choice than with a fixed rule (multi_linear_configs.md). The batches run in the order given, so the autotuner's
row at each later batch shows what the first batch's choice costs there. Each graph runs the matmuls of several
layers' weights (at least 512 MiB in all), so the weights come from HBM as in a decode step.
Writes $K3_BENCH_OUT/small_groups_configs.{json,md} when set, else benchmarks/results/.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from k3.bench.common import copy_bandwidth, environment, write_results
from k3.ops.moe import grouped, small_groups
from moe_decode_mm import SHAPES  # this folder is on sys.path when the script runs
from multi_linear_configs import time_forms

GLU_SPACE = dict(BLOCK_N=(16, 32, 64, 128), BLOCK_K=(64, 128), num_warps=(4, 8), num_stages=(3,))
MM_SPACE = dict(BLOCK_N=(16, 32, 64, 128), BLOCK_K=(64, 128, 256), num_warps=(4, 8), num_stages=(3, 4))


def configs(space: dict) -> list[dict]:
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def glu_launch(x, src_pair, k, w1, w3, offs, h, bm, cfg):
    """small_groups_glu's kernel with one configuration (SwiGLU), bypassing the autotuner."""
    e, n, kk = w1.shape
    grid = (e, triton.cdiv(n, cfg["BLOCK_N"]))
    small_groups._small_groups_glu_kernel.fn[grid](
        x,
        src_pair,
        w1,
        w3,
        offs,
        h,
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        h.stride(0),
        k,
        1.0,
        1.0,
        N=n,
        K=kk,
        SITU=False,
        BLOCK_M=bm,
        **cfg,
    )


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="64,16,1")
    p.add_argument("--shape", default="kimi-linear-1.3b", choices=[s[0] for s in SHAPES])
    a = p.parse_args()
    name, e, k, d, i = next(s for s in SHAPES if s[0] == a.shape)
    bw = copy_bandwidth()
    sets = max(1, -(-(512 << 20) // (3 * e * i * d * 2)))
    weights = [
        (
            torch.randn(e, i, d, device="cuda", dtype=torch.bfloat16) * d**-0.5,
            torch.randn(e, d, i, device="cuda", dtype=torch.bfloat16) * i**-0.5,
            torch.randn(e, i, d, device="cuda", dtype=torch.bfloat16) * d**-0.5,
        )
        for _ in range(sets)
    ]
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        idx = torch.rand(batch, e, device="cuda").topk(k).indices
        route = grouped._route(idx, e)
        offs = route.offs.to(torch.int32)
        x = torch.randn(batch, d, device="cuda", dtype=torch.bfloat16)
        r = route.src_pair.numel()
        h = torch.randn(r, i, device="cuda", dtype=torch.bfloat16)
        out_h, out_y = h.new_empty(r, i), h.new_empty(r, d)
        bm = small_groups.block_m(r, e)
        hit = idx.unique().numel()
        limits = {"up + GLU": hit * 2 * i * d * 2 / bw, "down": hit * i * d * 2 / bw}
        forms = {
            "up + GLU": {
                "autotuned": lambda: [
                    small_groups.small_groups_glu(x, route.src_pair, k, w1, w3, offs, "silu", 1.0, 1.0)
                    for w1, _, w3 in weights
                ]
            },
            "down": {"autotuned": lambda: [small_groups.small_groups_mm(h, w2, offs) for _, w2, _ in weights]},
        }
        for cfg in configs(GLU_SPACE):
            forms["up + GLU"][" ".join(f"{key}={v}" for key, v in cfg.items())] = lambda cfg=cfg: [
                glu_launch(x, route.src_pair, k, w1, w3, offs, out_h, bm, cfg) for w1, _, w3 in weights
            ]
        for cfg in configs(MM_SPACE):
            forms["down"][" ".join(f"{key}={v}" for key, v in cfg.items())] = lambda cfg=cfg: [
                small_groups._run(small_groups._small_groups_kernel.fn, h, w2, offs, out_y, bm, **cfg)
                for _, w2, _ in weights
            ]
        for kernel, table in forms.items():
            tuner = small_groups._small_groups_glu_kernel if kernel == "up + GLU" else small_groups._small_groups_kernel
            results = [
                (t, f"autotuned ({tuner.best_config})" if form == "autotuned" else form)
                for t, form in time_forms(table, sets, f"{kernel} B={batch}")
            ]
            keep = [r for r in results if r[1].startswith("autotuned")] + [
                r for r in results if not r[1].startswith("autotuned")
            ][:6]
            for t, form in sorted(keep):
                rows.append(
                    {
                        "shape": name,
                        "kernel": kernel,
                        "batch": batch,
                        "experts_hit": hit,
                        "form": form,
                        "us": t * 1e6,
                        "of_limit": limits[kernel] / t,
                    }
                )
                print(rows[-1], flush=True)
            write_results(
                "small_groups_configs",
                rows,
                ["shape", "kernel", "batch", "experts_hit", "form", "us", "of_limit"],
                environment() | {"copy_bandwidth_TBps": bw / 1e12},
            )


if __name__ == "__main__":
    main()
