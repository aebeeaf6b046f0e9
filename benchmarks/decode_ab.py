"""A/B of decode-step variants in one process: the decode benchmark's compiled step (``k3.bench.decode.ours``, greedy
argmax between steps) timed for each variant, the variants in alternating order over several rounds, against the
bandwidth limit of the same bytes (``k3.bench.decode.step_bytes`` / the copy bandwidth measured once here).

    python benchmarks/decode_ab.py [--cases 64x32768,1x4096] [--rounds 2] [VARIANT ...]

A VARIANT is a kernel choice in K3_KERNELS's form (``pdl=off``, ``moe_up_glu=torch,moe_route=torch``; see
k3.ops.backend); ``''`` is the default plan (the default, alone). Each variant's step is compiled again (dynamo
reset) with its kernel plan in place. To compare two trees, run the script once in each, one process after the other
on the same
machine (a process's copy bandwidth, and with it the limit, moves by up to ~1.5% between processes on an
H200). Prints one line per timing and a summary (every time, the fastest, its share of
the limit).
"""

from __future__ import annotations

import argparse
import time

import torch

from k3.bench.common import copy_bandwidth
from k3.bench.decode import ours, step_bytes
from k3.config.presets import kimi_linear_1p3b
from k3.model.decoder import K3ForCausalLM
from k3.ops import backend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", default=[""])
    p.add_argument("--cases", default="64x32768", help="BATCHxCONTEXT[,...]")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in a.cases.split(",")]
    variants = list(a.variants)
    backend.set_backend("fast")
    bw = copy_bandwidth()
    torch.manual_seed(0)
    model = K3ForCausalLM(kimi_linear_1p3b()).cuda().to(torch.bfloat16).eval()
    times: dict[tuple[str, int, int], list[float]] = {}
    for r in range(a.rounds):
        for v in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            backend.set_kernels(v or None)
            torch._dynamo.reset()
            for b, c in cases:
                t0 = time.time()
                t = ours(model, b, c, mode="compiled")
                times.setdefault((v, b, c), []).append(t)
                print(
                    f"round {r} [{v or 'tree'}] B={b} context={c}: {t * 1e3:.3f} ms/step, "
                    f"{step_bytes(model, b, c) / bw / t:.1%} of the limit ({time.time() - t0:.0f} s)",
                    flush=True,
                )
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    for (v, b, c), ts in times.items():
        print(
            f"[{v or 'tree'}] B={b} context={c}: "
            + " ".join(f"{t * 1e3:.3f}" for t in ts)
            + f" ms; fastest {min(ts) * 1e3:.3f} ms, {step_bytes(model, b, c) / bw / min(ts):.1%} of the limit"
        )


if __name__ == "__main__":
    main()
