"""The expert matmuls of a decode step: torch._grouped_mm (K3_KERNELS=moe_small_groups=grouped_mm) vs the Triton
small-groups kernel (k3.ops.moe.small_groups, the default), both replayed from CUDA graphs, against the bandwidth limit.

    python benchmarks/moe_decode_mm.py

For each MoE shape (the decode benchmark's Kimi-Linear-shaped layer, E=64 k=8 d=1024 I=512; small-1b's latent
experts, E=64 k=6 d=512 I=768; a K3-like layer, E=896 k=16 d=1024 I=512) and batch B = 1 / 16 / 64: the three
matmuls of one layer (w1 and w3 on the dispatched rows, w2 on the GLU output) on a random top-k routing. Limit =
bytes of the experts the routing hits (3 matrices each) + the rows read and written, over the measured copy
bandwidth. A decode step reads other weights in every layer, so each graph runs the matmuls of several layers'
weights (at least 512 MiB in all, ten times the H200's L2 cache) and the time is per layer.
Writes benchmarks/results/moe_decode_mm.{json,md} (or $K3_BENCH_OUT).
"""

from __future__ import annotations

import torch

from k3.bench.common import copy_bandwidth, environment, graph_seconds, write_results
from k3.ops.moe import grouped

SHAPES = [("kimi-linear-1.3b", 64, 8, 1024, 512), ("small-1b latent", 64, 6, 512, 768), ("k3-like", 896, 16, 1024, 512)]


@torch.no_grad()
def main() -> None:
    bw = copy_bandwidth()
    rows = []
    for name, e, k, d, i in SHAPES:
        layers = max(1, -(-(512 << 20) // (3 * e * i * d * 2)))  # weight sets, at least 512 MiB
        weights = [
            [
                torch.randn(e, i, d, device="cuda", dtype=torch.bfloat16) * d**-0.5,
                torch.randn(e, d, i, device="cuda", dtype=torch.bfloat16) * i**-0.5,
                torch.randn(e, i, d, device="cuda", dtype=torch.bfloat16) * d**-0.5,
            ]
            for _ in range(layers)
        ]
        for batch in (1, 16, 64):
            idx = torch.rand(batch, e, device="cuda").topk(k).indices
            route = grouped._route(idx, e)
            xs = torch.randn(route.src_pair.numel(), d, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(route.src_pair.numel(), i, device="cuda", dtype=torch.bfloat16)
            hit = idx.unique().numel()
            # per pair: x read twice, the two GLU inputs written, h read, y written
            limit = (hit * 3 * i * d * 2 + batch * k * (3 * d + 3 * i) * 2) / bw
            times = {}
            for kernel in ("grouped_mm", "triton"):

                def step(kernel=kernel):
                    for w1, w2, w3 in weights:  # noqa: F821
                        grouped._matmul(kernel, xs, w1, route.offs)
                        grouped._matmul(kernel, xs, w3, route.offs)
                        grouped._matmul(kernel, h, w2, route.offs)

                times[kernel] = graph_seconds(step) / layers
            rows.append(
                {
                    "shape": name,
                    "E": e,
                    "k": k,
                    "d": d,
                    "I": i,
                    "batch": batch,
                    "experts_hit": hit,
                    "weight_sets": layers,
                    "grouped_mm_us": times["grouped_mm"] * 1e6,
                    "triton_us": times["triton"] * 1e6,
                    "limit_us": limit * 1e6,
                    "grouped_mm_of_limit": limit / times["grouped_mm"],
                    "triton_of_limit": limit / times["triton"],
                    "triton_speedup": times["grouped_mm"] / times["triton"],
                }
            )
            print(rows[-1], flush=True)
        del weights
    write_results(
        "moe_decode_mm",
        rows,
        [
            "shape",
            "batch",
            "experts_hit",
            "grouped_mm_us",
            "triton_us",
            "limit_us",
            "grouped_mm_of_limit",
            "triton_of_limit",
            "triton_speedup",
        ],
        environment() | {"copy_bandwidth_TBps": bw / 1e12},
    )


if __name__ == "__main__":
    main()
