"""Launch choices of the absorbed-MLA decode kernel (k3/ops/mla/triton_decode.py) on the decode benchmark's shapes.

For each (batch, context) and each (block_n, num_stages, num_warps, programs_per_sm): time of one whole
``mla_decode`` call (kernel + split merge; CUDA events, median of 20) and its fraction of the bytes-moved limit
(the latent rows B * L * (r + dr) * 2 bytes at the measured copy bandwidth). Every output is checked against the
default launch's (relative error <= 1e-2, bf16). Prints the table sorted per shape, writes JSON + markdown.
Usage: python benchmarks/tune_mla_decode.py [--heads 16] [--shapes 64x32768,...] [--out DIR]; with --heads other
than 16 the files are tune_mla_decode-h<heads>.*.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch

from k3.bench.common import copy_bandwidth, cuda_time
from k3.ops.mla.triton_decode import mla_decode

SHAPES = [(64, 32768), (16, 32768), (64, 4096), (1, 4096), (1, 131072)]
CHOICES = list(itertools.product((32, 64), (2, 3, 4), (4, 8), (2, 4, 8, 16), (None,)))
# more than 32 heads: also groups of 64 (Hopper's wgmma takes 64-row tiles; 8 warps, one program an SM)
WIDE = list(itertools.product((16, 32), (2, 3), (8,), (1, 2, 4, 8), (64,)))
DEFAULTS = (None,) * 5  # mla_decode's own choices for these heads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES), help="batch x context, ...")
    ap.add_argument("--out", default=os.environ.get("K3_BENCH_OUT", "benchmarks/results"))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    name = "tune_mla_decode" if args.heads == 16 else f"tune_mla_decode-h{args.heads}"
    r, dr, h = 512, 64, args.heads
    bw = copy_bandwidth()
    rows = []
    for b, length in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        kv = torch.randn(b, length, r + dr, device="cuda", generator=g).to(torch.bfloat16)
        q = torch.randn(b, h, r + dr, device="cuda", generator=g).to(torch.bfloat16)
        slots = torch.arange(b, device="cuda")
        lengths = torch.full((b,), length, device="cuda")
        want = mla_decode(q, kv, slots, lengths, 0.07, r, length).float()
        limit = b * length * (r + dr) * 2 / bw
        for block_n, stages, warps, per_sm, block_h in [DEFAULTS] + CHOICES + (WIDE if h > 32 else []):
            kw = dict(block_n=block_n, num_stages=stages, num_warps=warps, programs_per_sm=per_sm, block_h=block_h)
            try:
                got = mla_decode(q, kv, slots, lengths, 0.07, r, length, **kw).float()
                err = ((got - want).norm() / want.norm()).item()
                t = cuda_time(lambda: mla_decode(q, kv, slots, lengths, 0.07, r, length, **kw), 3, 20)  # noqa: F821
                rows.append({"batch": b, "context": length, **kw, "us": t * 1e6, "of_limit": limit / t, "rel_err": err})
            except Exception as e:  # noqa: BLE001 (a launch that does not fit shared memory is a result too)
                rows.append({"batch": b, "context": length, **kw, "error": f"{type(e).__name__}: {e}"[:80]})
        del kv
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"bandwidth_GBps": bw / 1e9, "rows": rows}, indent=1))
    lines = [
        "| batch | context | block_h | block_n | stages | warps | programs/SM | us | of limit | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, length in shapes:
        ok = sorted(
            (x for x in rows if x["batch"] == b and x["context"] == length and "us" in x), key=lambda x: x["us"]
        )
        for x in ok[:4] + [x for x in ok[4:] if x["block_n"] is None]:  # the fastest, and the defaults
            cells = [x[c] or "default" for c in ("block_h", "block_n", "num_stages", "num_warps", "programs_per_sm")]
            lines.append(
                f"| {b} | {length} | {' | '.join(map(str, cells))} | {x['us']:.1f} | {x['of_limit']:.1%} | "
                f"{x['rel_err']:.1e} |"
            )
    text = "\n".join(lines)
    (out / f"{name}.md").write_text(
        f"# MLA decode kernel launch choices, {args.heads} heads (fastest 4 + the defaults per shape)\n\n" + text + "\n"
    )
    print(text)
    assert all(x.get("rel_err", 0) <= 1e-2 for x in rows), "a launch choice changed the result"


if __name__ == "__main__":
    main()
