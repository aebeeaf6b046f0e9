"""Where the layers of ``k3 bench kernels`` spend their time, kernel by kernel (the profile behind its goals).

    python benchmarks/profile_kernels.py [--kda-t 4096] [--moe-tokens 65536] [--steps 3] [--device auto] [--host N]

- KDA layer, fwd + bwd under bf16 autocast at T tokens: ours and fla's ``KimiDeltaAttention`` (same shape as the
  benchmark), each with its kernels per step, device time and top kernels: why the ratio is what it is.
- LatentMoE routed experts (E=896, k=16, latent 1024, width 768), forward at N tokens: the device time of the
  grouped GEMM kernels vs everything around them (sort, gathers, GLU, scatter-add), and the GEMMs' own TFLOP/s
  against the measured bf16 roof.
``--host N`` adds, for each KDA layer, its wall time per fwd+bwd step against its device time, a cProfile of N
steps (the Python functions by own time) and the CPU time of every thread's operators (the backward's too): where
the host time of a host-bound layer goes.
On a CPU (a smoke run, small sizes) it profiles the reference paths by operator instead of kernel.
Writes $K3_BENCH_OUT/profile_kernels.txt when set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from k3.bench.common import device_activity, write_profile
from k3.bench.kernels import kda_layers, moe_block
from k3.ops import backend
from k3.ops.moe import moe_experts
from k3.ops.segments import as_segments

GEMM_MARKS = ("grouped", "cutlass", "gemm", "nvjet", "sm90_xmma")  # kernel names of (grouped) matrix products
GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm")  # the same, as CPU operators


def kernel_times(fn, steps: int, cuda: bool) -> tuple[dict[str, list], float]:
    """Run fn() ``steps`` times under the profiler -> ({kernel or operator name: [ms per step, launches per
    step]}, busy ms per step). On CUDA: device kernels; on a CPU: operators by self CPU time."""
    fn()  # warm-up (compilation, autotuning)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    table: dict[str, list] = defaultdict(lambda: [0.0, 0.0])
    if cuda:
        for e in device_activity(prof.events()):
            table[e.name][0] += e.device_time / 1e3 / steps
            table[e.name][1] += 1 / steps
    else:
        for e in prof.key_averages():
            table[e.key] = [e.self_cpu_time_total / 1e3 / steps, e.count / steps]
    return dict(table), sum(ms for ms, _ in table.values())


def describe(title: str, table: dict[str, list], busy: float, top: int = 12) -> list[str]:
    lines = [title, f"  launches per step {sum(n for _, n in table.values()):.0f}, busy {busy:.3f} ms/step"]
    for name, (ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"    {name[:72]:<72} {ms:8.3f} ms {n:6.0f}x")
    return lines


def host_profile(fn, steps: int, cuda: bool, top: int = 30) -> list[str]:
    """Wall ms per call of fn() (synchronised at the end), cProfile's top functions by own time (the calling
    thread) and torch.profiler's top operators and autograd nodes by CPU time (every thread)."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    body = [ln for ln in buf.getvalue().splitlines() if ln.strip()][3:]  # from the "ncalls tottime" header on
    # cProfile sees the calling thread only; the backward runs on the autograd engine's thread: its operators and
    # autograd nodes (Python ones included) by CPU time from torch.profiler, which records every thread
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    table = tp.key_averages().table(sort_by="cpu_time_total", row_limit=top, max_name_column_width=60)
    return (
        [
            f"  wall {wall:.3f} ms per step (host-bound when far above the busy time); cProfile of {steps} steps "
            "(the forward's thread) by own time:"
        ]
        + ["    " + ln for ln in body]
        + [f"  torch.profiler, {steps} steps, every thread, by total CPU time:"]
        + ["    " + ln for ln in table.splitlines()]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kda-t", type=int, default=4096)
    p.add_argument("--moe-tokens", type=int, default=65536)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--host", type=int, default=0, metavar="N", help="also the KDA layers' host time: cProfile of N steps"
    )
    a = p.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    cuda = device.type == "cuda"
    backend.set_backend("fast" if cuda else "reference")
    lines = [f"device {device}, backend {backend.get_backend()}", ""]

    ours, theirs = kda_layers(device=device) if cuda else kda_layers(hidden=256, heads=2, head_dim=64, device=device)
    hidden = ours.q_proj.in_features
    x = torch.randn(a.kda_t, hidden, device=device, requires_grad=True)
    cu = as_segments(torch.tensor([0, a.kda_t]), device)  # Segments, as in the model (no syncs)

    def fwd_bwd(layer):
        def run():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                out = layer(x)
            out.float().sum().backward()

        return run

    fla = None if theirs is None else lambda z: theirs(z[None])[0]
    for name, layer in (("ours", lambda z: ours(z, cu)), ("fla", fla)):
        if layer is None:
            lines.append(f"KDA layer T={a.kda_t} {name}: not available")
            continue
        table, busy = kernel_times(fwd_bwd(layer), a.steps, cuda)
        lines += describe(f"KDA layer T={a.kda_t} fwd+bwd, {name}", table, busy)
        lines += (host_profile(fwd_bwd(layer), a.host, cuda) if a.host else []) + [""]

    moe = moe_block(device=device) if cuda else moe_block(hidden=256, latent=128, width=96, device=device)
    latent, width = moe.experts.w1.shape[2], moe.experts.w1.shape[1]
    with torch.no_grad():
        xm = torch.randn(a.moe_tokens, moe.gate.weight.shape[1], device=device, dtype=torch.bfloat16)
        _, idx, w = moe.gate(xm)
        z = moe.routed_expert_down_proj(xm)
        table, busy = kernel_times(
            lambda: moe_experts(z, idx, w, moe.experts.w1, moe.experts.w2, moe.experts.w3, moe.glu), a.steps, cuda
        )
    gemm = sum(
        ms
        for name, (ms, _) in table.items()
        if (any(m in name.lower() for m in GEMM_MARKS) if cuda else name in GEMM_OPS)
    )
    flops = a.moe_tokens * 16 * 3 * 2 * latent * width
    lines += describe(f"LatentMoE routed experts, {a.moe_tokens} tokens x top-16 of 896, forward", table, busy)
    if gemm == 0:
        raise SystemExit("no matrix-product kernel recognised in the MoE profile: extend GEMM_MARKS")
    lines.append(
        f"  matrix-product kernels {gemm:.3f} ms of {busy:.3f} ms ({gemm / busy:.0%}); their rate "
        f"{flops / gemm / 1e9:.1f} TFLOP/s, whole call {flops / busy / 1e9:.1f} TFLOP/s"
    )
    if cuda:
        from k3.bench.common import matmul_flops

        roof = matmul_flops()
        lines.append(
            f"  roof {roof / 1e12:.0f} TFLOP/s: GEMM kernels at {flops / (gemm / 1e3) / roof:.1%}, whole "
            f"call at {flops / (busy / 1e3) / roof:.1%}"
        )
    write_profile("profile_kernels", "\n".join(lines))


if __name__ == "__main__":
    main()
