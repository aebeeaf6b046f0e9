"""One K3 MoE layer's expert matmuls at decode on packed MXFP4 weights: the CUDA kernel (k3.ops.moe.cuda_mxfp4,
kernel ``moe_mxfp4_rows``, the default) against Triton's ``tl.dot_scaled`` kernel (k3.ops.moe.triton_mxfp4,
``K3_KERNELS=moe_mxfp4_rows=triton``) and against bf16 experts (the small-groups kernel on the dequantised
weights), each replayed from a CUDA graph, against the read-bandwidth limit.

    python benchmarks/mxfp4_decode_mm.py

K3's expert bank (E=896, top-16, latent width 3584, expert width 3072) with random codes and scales, batch
B = 1 / 8 / 64 / 128 on a random routing: w1 and w3 on the gathered token rows, w2 on the GLU-sized rows. Limit =
the packed bytes (codes and scales, 4.25 bits a weight) of the experts the routing hits, three matrices, over the
measured read bandwidth; the bf16 column reads four times as many bytes. The bank is 15.7 GB packed and 59 GB in
bf16, beyond the L2 cache many times over. Writes benchmarks/results/mxfp4_decode_mm.{json,md} (or
$K3_BENCH_OUT).
"""

from __future__ import annotations

import torch

from k3.bench.common import environment, graph_seconds, read_bandwidth, write_results
from k3.ops import backend
from k3.ops.moe import grouped
from k3.ops.moe.triton_mxfp4 import ROUTE_ALIGN, mxfp4_groups_mm
from k3.ops.mx import unpack_weight

E, K, D, I = 896, 16, 3584, 3072


@torch.no_grad()
def main() -> None:
    bw = read_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"w1": (I, D), "w2": (D, I), "w3": (I, D)}
    packed = {
        w: torch.randint(0, 256, (E, n, k // 2), device="cuda", generator=g, dtype=torch.uint8)
        for w, (n, k) in shapes.items()
    }
    scale = {
        w: torch.randint(118, 126, (E, n, k // 32), device="cuda", generator=g, dtype=torch.uint8)
        for w, (n, k) in shapes.items()
    }
    bf16 = {
        w: torch.cat(
            [unpack_weight(packed[w][j : j + 64], scale[w][j : j + 64], torch.bfloat16) for j in range(0, E, 64)]
        )
        for w in shapes
    }
    rows = []
    for batch in (1, 8, 64, 128):
        idx = torch.rand(batch, E, device="cuda", generator=g).topk(K).indices
        hit = idx.unique().numel()
        route = grouped._route(idx, E, ROUTE_ALIGN)
        x = torch.randn(batch, D, device="cuda", generator=g, dtype=torch.bfloat16)
        h = torch.randn(route.src_pair.numel(), I, device="cuda", generator=g, dtype=torch.bfloat16)
        limit = hit * 3 * I * D * (0.5 + 1 / 32) / bw
        times = {}
        for kernel in ("cuda", "triton"):
            backend.set_kernels({"moe_mxfp4_rows": kernel})

            def step():
                mxfp4_groups_mm(x, route.src_pair, K, packed["w1"], scale["w1"], route.offs, min(E, batch * K))
                mxfp4_groups_mm(x, route.src_pair, K, packed["w3"], scale["w3"], route.offs, min(E, batch * K))
                mxfp4_groups_mm(h, None, 1, packed["w2"], scale["w2"], route.offs, min(E, batch * K))

            times[kernel] = graph_seconds(step)
        backend.set_kernels(None)
        aligned = grouped._route(idx, E)  # the bf16 kernels' routing (groups padded to grouped_mm's alignment)
        xs = x[aligned.src_pair.clamp(min=0) // K]
        ha = torch.randn(aligned.src_pair.numel(), I, device="cuda", generator=g, dtype=torch.bfloat16)

        def step_bf16():
            grouped._matmul("triton", xs, bf16["w1"], aligned.offs)
            grouped._matmul("triton", xs, bf16["w3"], aligned.offs)
            grouped._matmul("triton", ha, bf16["w2"], aligned.offs)

        times["bf16"] = graph_seconds(step_bf16)
        rows.append(
            {
                "batch": batch,
                "experts_hit": hit,
                "cuda_us": times["cuda"] * 1e6,
                "triton_us": times["triton"] * 1e6,
                "bf16_us": times["bf16"] * 1e6,
                "limit_us": limit * 1e6,
                "cuda_of_limit": limit / times["cuda"],
                "triton_of_limit": limit / times["triton"],
                "cuda_vs_triton": times["triton"] / times["cuda"],
                "cuda_vs_bf16": times["bf16"] / times["cuda"],
            }
        )
        print(rows[-1], flush=True)
    write_results(
        "mxfp4_decode_mm",
        rows,
        list(rows[0]),
        environment() | {"read_bandwidth_TBps": bw / 1e12, "E": E, "k": K, "d_latent": D, "I": I},
        "- one K3 MoE layer's w1, w3 and w2 on packed MXFP4 experts (random codes, scales 2^-9..2^-2); limit = the "
        "hit experts' packed bytes over the read bandwidth; bf16: the small-groups kernel on the dequantised weights.",
    )


if __name__ == "__main__":
    main()
