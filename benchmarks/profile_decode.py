"""Where a decode step's time goes: the model of ``k3 bench decode`` (Kimi-Linear-shaped, random bf16 weights, a cache
filled with random latents and states), timed replayed from a CUDA graph and profiled eagerly.

    python benchmarks/profile_decode.py [--cases 1x4096,64x32768] [--steps 3] [--compiled [--top N] [--combo]
        [--sequence] [--inductor assert_indirect_indexing=True]
        [--kernels kda_decode_core=torch,conv_step=torch ...]]   (perf_gpu.sh's $OFF: every decode kernel off)
    python benchmarks/profile_decode.py --preset small-1b --attn-res snapshot --cases 16x4096 --compiled

The default model is the benchmark's; ``--preset`` takes a k3 preset instead (bf16, random weights) and
``--attn-res`` sets its AttnRes mode (the ``attn_res_compiled`` case of ``k3 bench model`` is small-1b at 16 x 4K).

For each (batch, context): the graph's time per step and the limit (bytes / copy bandwidth, as in the benchmark);
then, over eager steps under torch.profiler, the kernels per step and the device time of each part of the model (KDA
/ MLA mixers, MoE, dense FFN, lm_head, the residual stream: AttnRes mixes and pre-norms, the rest) and of the top
kernels. A graph replays the same kernels back to back, so the eager device time per step is what a graph cannot go
below: if it is far above the limit the kernels are slow or too many, if close to it the step is launch-bound only
eagerly. A part's time counts the kernels its CPU range launched through the runtime API; Triton kernels (fla's KDA
step, the MLA decode kernel) are launched through the driver API and land in "the rest" (they are named in the
kernel list).
``--compiled`` also profiles the torch.compile'd step replayed from its CUDA graph (GraphedDecoder(compile=True)):
the kernels one replay runs, by name (inductor names its fused kernels after the ops inside), with their count
(the ``--top`` most expensive); ``--combo`` then compiles it again with inductor's ``combo_kernels`` off, each
``--inductor`` with those inductor options in place of GraphedDecoder's, and each ``--kernels`` with that kernel
choice (K3_KERNELS's form, e.g. the decode kernels off), all in one process.
Writes $K3_BENCH_OUT/profile_decode.txt when set.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from unittest.mock import patch

import torch
from torch.profiler import ProfilerActivity, profile

from k3.bench.common import busy_seconds, copy_bandwidth, cuda_time, device_activity, write_profile
from k3.bench.decode import fill_cache, step_bytes
from k3.config.presets import kimi_linear_1p3b
from k3.config import get_preset
from k3.infer.graphs import COMPILE_OPTIONS, GraphedDecoder
from k3.model.attn_res import ResidualStream
from k3.model.decoder import K3ForCausalLM
from k3.ops import backend
from profile_train_step import phase  # this folder is on sys.path when the script runs


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x4096,64x32768")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--preset", default=None, help="a k3 preset instead of the decode benchmark's model")
    p.add_argument("--attn-res", default=None, help="AttnRes mode of --preset's model")
    p.add_argument("--compiled", action="store_true", help="also profile the compiled step's CUDA graph")
    p.add_argument("--top", type=int, default=40, help="kernels listed for the compiled step")
    p.add_argument(
        "--sequence",
        action="store_true",
        help="with --compiled: also list one replay's kernels in "
        "launch order with their device time (which layer launches what)",
    )
    p.add_argument(
        "--combo",
        action="store_true",
        help="with --compiled: the compiled step again with inductor's "
        "combo_kernels off (GraphedDecoder turns them on), an A/B in one process",
    )
    p.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="OPTION=VALUE[,OPTION=VALUE]",
        help="with --compiled: the compiled step again with these inductor options (Python literals) "
        "over GraphedDecoder's, an A/B in one process; repeatable",
    )
    p.add_argument(
        "--kernels",
        action="append",
        default=[],
        metavar="KERNEL=VALUE[,KERNEL=VALUE]",
        help="with --compiled: the compiled step again with this kernel choice (K3_KERNELS's form, e.g. "
        "kda_decode_core=torch,conv_step=torch: two decode kernels off), an A/B in one process; "
        "repeatable",
    )
    a = p.parse_args()
    backend.set_backend("fast")
    bw = copy_bandwidth()
    config = kimi_linear_1p3b() if a.preset is None else get_preset(a.preset)
    if a.attn_res is not None:
        config = config.replace(**{"attn_res.mode": a.attn_res})
    model = K3ForCausalLM(config).cuda().to(torch.bfloat16).eval()
    print(f"model {config.name}, AttnRes {config.attn_res.mode}", flush=True)
    cases = [tuple(int(x) for x in case.split("x")) for case in a.cases.split(",")]
    graphed, lines = {}, []
    for batch, context in cases:  # graph times first: the profiler ranges below stay out of the captures
        blocks = 1 + a.compiled * (1 + a.combo + len(a.inductor) + len(a.env))  # each advances the cache ~21 rows:
        cache = fill_cache(model, batch, context, 64 + 32 * blocks)  # room for all, or a block recaptures mid-timing
        ids = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")
        graph = GraphedDecoder(model, cache)
        graphed[batch, context] = cuda_time(lambda: graph(ids, list(range(batch))), warmup=2, iters=16)  # noqa: F821
        del graph
        if a.compiled:
            limit = step_bytes(model, batch, context) / bw
            lines += compiled_block(model, cache, ids, batch, context, limit, top=a.top, sequence=a.sequence)
            if a.combo:
                torch._dynamo.reset()
                with patch.dict(COMPILE_OPTIONS, combo_kernels=False):
                    lines += compiled_block(
                        model, cache, ids, batch, context, limit, top=a.top, label=" (inductor combo_kernels off)"
                    )
                torch._dynamo.reset()
            for setting in a.inductor:
                torch._dynamo.reset()
                options = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in setting.split(","))}
                with patch.dict(COMPILE_OPTIONS, options):
                    lines += compiled_block(
                        model, cache, ids, batch, context, limit, top=a.top, label=f" (inductor {setting})"
                    )
                torch._dynamo.reset()
            for setting in a.kernels:
                torch._dynamo.reset()
                backend.set_kernels(setting)
                lines += compiled_block(model, cache, ids, batch, context, limit, top=a.top, label=f" ({setting})")
                backend.set_kernels(None)
                torch._dynamo.reset()
        del cache
        torch.cuda.empty_cache()
    for layer in model.model.layers:
        phase(layer.self_attn, "step", f"part: {layer.mixer} mixer")
        if hasattr(layer, "mlp"):
            phase(layer.mlp, "forward", "part: dense ffn")
        else:
            phase(layer.block_sparse_moe, "forward", "part: moe")
    phase(model.lm_head, "forward", "part: lm_head")
    for name in ("input", "add", "output"):  # the AttnRes mixes (or plain residual adds) + pre-norms; not nested
        phase(ResidualStream, name, "part: residual stream")
    for batch, context in cases:
        limit = step_bytes(model, batch, context) / bw
        cache = fill_cache(model, batch, context, 64)
        ids = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")
        seq = list(range(batch))
        eager = cuda_time(lambda: model.decode(ids, cache, seq), warmup=1, iters=a.steps)  # noqa: F821
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                model.decode(ids, cache, seq)
            torch.cuda.synchronize()
        events = prof.events()
        kernels = device_activity(events)  # not the parts' GPU-side ranges: they span idle gaps too
        busy = busy_seconds(kernels) * 1e3 / a.steps
        block = [
            "",
            f"B={batch} context={context}: graph {graphed[batch, context] * 1e3:.2f} ms/step, "
            f"eager {eager * 1e3:.2f} ms/step, limit {limit * 1e3:.3f} ms "
            f"({limit / graphed[batch, context]:.1%} of it in the graph)",
            f"  kernels per step {len(kernels) / a.steps:.0f}, device busy {busy:.2f} ms/step (eager)",
        ]
        parts = defaultdict(float)  # device time of the kernels each part's CPU range launched
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("part:"):
                parts[e.name] += e.device_time_total / 1e3 / a.steps
        for key, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            block.append(f"  {key:<28} {ms:8.3f} ms/step device")
        block.append(f"  {'part: the rest':<28} {busy - sum(parts.values()):8.3f} ms/step device")
        block += kernel_table(kernels, a.steps, 15)
        print("\n".join(block), flush=True)
        lines += block
        del cache
        torch.cuda.empty_cache()
    custom = a.preset is not None or a.attn_res is not None
    name = "profile_decode" + (f"_{config.name}_{config.attn_res.mode}" if custom else "")
    write_profile(name, "\n".join(lines), echo=False)  # printed block by block above


def kernel_table(kernels: list, steps: int, top: int) -> list[str]:
    """The ``top`` kernels by device time: ms per step and launches per step."""
    by_kernel = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_kernel[e.name][0] += e.device_time / 1e3 / steps
        by_kernel[e.name][1] += 1
    block = ["  top kernels (ms per step, launches per step):"]
    for name, (ms, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        block.append(f"    {name[:70]:<70} {ms:7.3f} {n / steps:6.0f}")
    return block


def compiled_block(
    model,
    cache,
    ids,
    batch: int,
    context: int,
    limit: float,
    steps: int = 3,
    top: int = 40,
    label: str = "",
    sequence: bool = False,
) -> list[str]:
    """Time and profile the compiled step replayed from its CUDA graph (``sequence``: and list the last replay's
    kernels in launch order)."""
    graph = GraphedDecoder(model, cache, compile=True)
    seq = list(range(batch))
    t = cuda_time(lambda: graph(ids, seq), warmup=2, iters=16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph(ids, seq)
        torch.cuda.synchronize()
    kernels = device_activity(prof.events(), memcpy=False)  # the graph's kernels, not the input copies
    busy = busy_seconds(kernels) * 1e3 / steps
    block = [
        "",
        f"B={batch} context={context} compiled{label} + CUDA graph: {t * 1e3:.2f} ms/step, limit "
        f"{limit * 1e3:.3f} ms ({limit / t:.1%} of it); {len(kernels) / steps:.0f} kernels per step, device busy "
        f"{busy:.2f} ms/step",
    ] + kernel_table(kernels, steps, top)
    if sequence:
        last = sorted(kernels, key=lambda e: e.time_range.start)[-(len(kernels) // steps) :]
        block.append("  one replay in launch order (start us from the first kernel, device us, name):")
        block += [
            f"    {e.time_range.start - last[0].time_range.start:8.1f} {e.device_time:7.1f}  {e.name[:90]}"
            for e in last
        ]
    print("\n".join(block), flush=True)
    return block


if __name__ == "__main__":
    main()
