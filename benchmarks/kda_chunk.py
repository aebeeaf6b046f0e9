"""Chunked KDA, forward and forward + backward: our Triton kernels (k3.ops.kda.triton_chunk, triton_chunk_bwd)
against fla's chunk_kda, same process.

    python benchmarks/kda_chunk.py [--quick]

H = 16 heads, K = V = 128, bf16 q / k / v / beta, K3's gate (g = -5 sigmoid(x)), sequences of 4096 tokens packed
by cu_seqlens to T = 4K / 16K / 64K tokens (--quick: 4K). The callables are timed in turn over several rounds
(k3.bench.kernels.interleaved_times): the forward without gradient, and the forward + backward (the gradients of
q, k, v, g and beta for a random dO, by torch.autograd.grad). Our kernels run with each fp32-matmul precision
("tf32x3", "tf32"). Errors are relative to fp64: the output's
against the chunked reference (k3.ops.kda.reference.chunk_kda, which equals the fp64 recurrence) over all
outputs (norm) and the largest element error over the largest reference element; the gradients' (the largest of
the five norm errors) against autograd through that reference on the first sequence (the sequences are
independent). Writes benchmarks/results/kda-chunk.{json,md} (or $K3_BENCH_OUT).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from k3.bench.common import environment, write_results
from k3.bench.kernels import interleaved_times
from k3.ops.kda import fla, reference
from k3.ops.kda.triton_chunk import chunk_kda_fwd
from k3.ops.kda.triton_chunk_bwd import chunk_kda as chunk_kda_grad

H, D, SEQ = 16, 128, 4096
PRECISIONS = ("tf32x3", "tf32")  # not "ieee": CUDA-core fp32 spills these tiles badly (the forward's docstring)


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
    do = rnd(1, t, H, D).bfloat16()  # the output gradient of the forward + backward timings
    return q, k, v, g, beta, cu, do


def errors(o: torch.Tensor, ref: torch.Tensor) -> dict:
    d = o.double() - ref
    return {"rel_err": float(d.norm() / ref.norm()), "max_err": float(d.abs().amax() / ref.abs().amax())}


def grad_fn(fn, q, k, v, g, beta, cu, do):
    """A callable returning fn's gradients of q, k, v, g, beta for the output gradient do."""
    ins = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]

    def run():
        o, _ = fn(*ins, cu_seqlens=cu)
        return torch.autograd.grad(o, ins, do)

    return run


def grad_error(grads, q, k, v, g, beta, do) -> float:
    """The largest relative error of the first sequence's five gradients against autograd in fp64."""
    ins = [t[:, :SEQ].double().requires_grad_() for t in (q, k, v, g, beta)]
    o, _ = reference.chunk_kda(*ins)
    want = torch.autograd.grad(o, ins, do[:, :SEQ].double())
    return max(float((a[:, :SEQ].double() - b).norm() / b.norm()) for a, b in zip(grads, want))


def timed(t: int, step: str, fns: dict, error) -> list[dict]:
    """Time ``fns`` in turn -> one row each: milliseconds, fla's time over it, and ``error(fn)``'s columns."""
    med = interleaved_times(fns)
    rows = []
    for name, fn in fns.items():
        row = {"T": t, "kernel": "fla" if name == "fla" else f"ours ({name})", "pass": step, "ms": med[name] * 1e3}
        if "fla" in med:
            row["vs_fla"] = med["fla"] / med[name]
        rows.append(row | error(fn))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4K tokens only")
    args = ap.parse_args()
    rows: list = []
    columns = ["T", "kernel", "pass", "ms", "vs_fla", "rel_err", "max_err", "grad_err"]
    for t in (4096,) if args.quick else (4096, 16384, 65536):
        q, k, v, g, beta, cu, do = inputs(t)
        fns = {p: (lambda p=p: chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, precision=p)) for p in PRECISIONS}
        bwd = {p: grad_fn(partial(chunk_kda_grad, precision=p), q, k, v, g, beta, cu, do) for p in PRECISIONS}
        if fla.available(q.device):
            fns["fla"] = lambda: fla.chunk_kda(q, k, v, g, beta, cu_seqlens=cu)
            bwd["fla"] = grad_fn(fla.chunk_kda, q, k, v, g, beta, cu, do)
        print(f"T={t}: timing {', '.join(fns)} (the first calls compile and autotune)", flush=True)
        with torch.no_grad():
            ref, _ = reference.chunk_kda(*(x.double() for x in (q, k, v, g, beta)), cu_seqlens=cu)
            rows += timed(t, "fwd", fns, lambda fn: errors(fn()[0], ref))
        ref = None  # the fp64 output: freed before the backward pass
        rows += timed(t, "fwd+bwd", bwd, lambda fn: {"grad_err": grad_error(fn(), q, k, v, g, beta, do)})
        write_results("kda-chunk", rows, columns, environment() | {"heads": H, "head_dim": D, "seq": SEQ})


if __name__ == "__main__":
    main()
