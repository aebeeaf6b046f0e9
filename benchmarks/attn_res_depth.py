"""AttnRes at a config's own depth on a GPU: none / snapshot / block_sum / full in the narrow model that
``k3.audit.measure.depth_config`` builds (the depth, mixer schedule and AttnRes blocks kept; d = 256), one
forward + backward of [1, tokens] under bf16 autocast per mode: activation bytes saved for backward, the pass's
peak memory, the analytic mix FLOPs, and the time (modes interleaved).

    python benchmarks/attn_res_depth.py [--preset k3] [--tokens 4096] [--repeats 5]

Writes benchmarks/results/attn_res_depth.{json,md} (or $K3_BENCH_OUT), which ``k3 audit`` reads (section 7).
"""

from __future__ import annotations

import argparse

import torch

from k3.audit.measure import attn_res_depth
from k3.bench.common import environment, write_results
from k3.config import get_preset

COLUMNS = [
    "mode",
    "saved_bytes_per_token",
    "saved_vs_none",
    "peak_bytes",
    "peak_vs_none",
    "mix_flops_share",
    "ms",
    "ms_median",
    "ms_vs_none",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attn_res_depth.py measures on a GPU; `k3 audit --measure` gives the CPU form")
    d = attn_res_depth(get_preset(a.preset), tokens=a.tokens, repeats=a.repeats, hidden=a.hidden, device="cuda")
    meta = {**environment(), **{k: v for k, v in d.items() if k != "rows"}, "preset": a.preset}
    notes = (
        f"`{d['config']}`: {d['layers']} layers, d = {d['hidden_size']}, AttnRes blocks of {d['block_size']} layers; "
        f"one forward + backward of [1, {d['tokens']}] tokens under bf16 autocast per mode, min and median of "
        f"{d['repeats']} after a warm-up pass, modes interleaved. saved: bytes autograd keeps for backward (each "
        "storage once, parameters excluded); peak: the most the pass allocated above what was allocated before it; "
        "mix_flops_share: the depth mixes' FLOPs (analytic) over the model's forward FLOPs."
    )
    write_results("attn_res_depth", d["rows"], COLUMNS, meta, notes)


if __name__ == "__main__":
    main()
