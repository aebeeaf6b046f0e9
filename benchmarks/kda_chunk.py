"""Chunked KDA forward: our Triton kernels (k3.ops.kda.triton_chunk) against fla's chunk_kda, same process.

    python benchmarks/kda_chunk.py [--quick]

H = 16 heads, K = V = 128, bf16 q / k / v / beta, K3's gate (g = -5 sigmoid(x)), sequences of 4096 tokens packed
by cu_seqlens to T = 4K / 16K / 64K tokens (--quick: 4K). Forward only, no gradient; the callables are timed in
turn over several rounds (k3.bench.kernels.interleaved_times). Our kernels run with each fp32-matmul precision
("ieee", "tf32x3", "tf32"). Error: relative to the chunked reference in fp64 (k3.ops.kda.reference.chunk_kda, which
equals the fp64 recurrence; tests/ops/test_kda_chunk_triton.py), over all outputs (norm) and the largest element
error over the largest reference element. Writes benchmarks/results/kda-chunk.{json,md} (or $K3_BENCH_OUT).
"""

from __future__ import annotations

import argparse

import torch

from k3.bench.common import environment, write_results
from k3.bench.kernels import interleaved_times
from k3.ops.kda import fla, reference
from k3.ops.kda.triton_chunk import chunk_kda_fwd

H, D, SEQ = 16, 128, 4096
PRECISIONS = ("ieee", "tf32x3", "tf32")


def inputs(t: int, seed: int = 0) -> tuple:
    g0 = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g0)

    q = reference.l2norm(rnd(1, t, H, D)).bfloat16()
    k = reference.l2norm(rnd(1, t, H, D)).bfloat16()
    v = rnd(1, t, H, D).bfloat16()
    g = -5 * torch.sigmoid(rnd(1, t, H, D))
    beta = torch.sigmoid(rnd(1, t, H)).bfloat16()
    cu = torch.arange(0, t + 1, SEQ, device="cuda")
    return q, k, v, g, beta, cu


def errors(o: torch.Tensor, ref: torch.Tensor) -> dict:
    d = o.double() - ref
    return {"rel_err": float(d.norm() / ref.norm()), "max_err": float(d.abs().amax() / ref.abs().amax())}


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4K tokens only")
    args = ap.parse_args()
    rows: list = []
    columns = ["T", "kernel", "fwd_ms", "vs_fla", "rel_err", "max_err"]
    for t in (4096,) if args.quick else (4096, 16384, 65536):
        q, k, v, g, beta, cu = inputs(t)
        ref, _ = reference.chunk_kda(*(x.double() for x in (q, k, v, g, beta)), cu_seqlens=cu)
        fns = {p: (lambda p=p: chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, precision=p)) for p in PRECISIONS}
        if fla.available(q.device):
            fns["fla"] = lambda: fla.chunk_kda(q, k, v, g, beta, cu_seqlens=cu)
        print(f"T={t}: timing {', '.join(fns)} (the first calls compile and autotune)", flush=True)
        med = interleaved_times(fns)
        for name, fn in fns.items():
            row = {"T": t, "kernel": "fla chunk_kda" if name == "fla" else f"ours ({name})", "fwd_ms": med[name] * 1e3}
            if "fla" in med:
                row["vs_fla"] = med["fla"] / med[name]
            rows.append(row | errors(fn()[0], ref))
            print(rows[-1], flush=True)
        write_results("kda-chunk", rows, columns, environment() | {"heads": H, "head_dim": D, "seq": SEQ})


if __name__ == "__main__":
    main()
