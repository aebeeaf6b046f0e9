"""Where a training step's time goes: torch.profiler over a few steps of ``k3.train.trainer.Trainer``.

    python benchmarks/profile_train_step.py [--preset small] [--batch-size 16] [--seq-len 512] [--steps 3] [--stacks]

Prints (and writes to $K3_BENCH_OUT/profile_train_step.txt when set) the step time with and without the profiler,
the phases of one step (forward + loss, backward, optimizer, balancer), the number of kernels launched per step,
and the top operators by self CPU time and by device time. A step whose CPU time per step is close to its wall time
while the device is mostly idle is launch-bound: fewer, larger kernels (fusion, batching, CUDA graphs) help it,
faster kernels do not.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import k3.train.step as step_module
from k3.bench.common import busy_seconds, cuda_time, device_activity, write_profile
from k3.train.trainer import TrainConfig, Trainer


def phase(obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` in a profiler range called ``label``."""
    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


def device_timeline(events, kernels, steps: int) -> list[str]:
    """Where on the device's timeline it waits: each phase's GPU-side range (from its first kernel to its last),
    the device's work inside it and the idle rest, per step; the rest of the profiled window (from the first kernel
    to the last) is one more row. Idle time inside a phase whose host time exceeds its device work is the host's:
    fewer launches there pay, faster kernels do not. Only ranges the profiler records on the device count: the
    backward's kernels are launched from autograd's own thread, outside its range, and the optimizer's range has
    had no device-side counterpart (torch 2.11): their kernels and gaps land in the last row."""
    spans: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.is_user_annotation and e.name.startswith("phase:"):
            acc = spans.setdefault(e.name, [0.0, 0.0])
            acc[0] += (e.time_range.end - e.time_range.start) / 1e6
            acc[1] += busy_seconds(kernels, e.time_range.start, e.time_range.end)
    window = (max(k.time_range.end for k in kernels) - min(k.time_range.start for k in kernels)) / 1e6
    total = busy_seconds(kernels)
    spans = {name: v for name, v in spans.items() if v[0] > 0}  # (a range without kernels on the device)
    spans["outside those ranges"] = [
        window - sum(v[0] for v in spans.values()),
        total - sum(v[1] for v in spans.values()),
    ]
    lines = ["device timeline (ms per step): span of the phase's kernels, device busy in it, idle in it"]
    for name, (span, busy) in spans.items():
        lines.append(
            f"  {name[:44]:<44} {span * 1e3 / steps:8.1f} {busy * 1e3 / steps:8.1f} {(span - busy) * 1e3 / steps:8.1f}"
        )
    lines.append(
        f"  {'window (first kernel to last)':<44} {window * 1e3 / steps:8.1f} {total * 1e3 / steps:8.1f} "
        f"{(window - total) * 1e3 / steps:8.1f}"
    )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 3 warm-up steps)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="runs/profile-train-step")
    p.add_argument(
        "--stacks",
        action="store_true",
        help="also device time by k3 call site (forward, optimizer) "
        "and by autograd node (backward); records Python stacks, so the profiled step runs slower",
    )
    a = p.parse_args()

    cfg = TrainConfig(
        preset=a.preset,
        steps=1000,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        out=a.out,
        samples=0,
        eval_every=1000,
        save_every=1000,
        max_tokens=max(300_000, 40 * a.batch_size * a.seq_len),
        device=a.device,
    )
    trainer = Trainer(cfg, progress=False)
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def steps(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            trainer.train_step()
            trainer.step += 1
        sync()
        return (time.perf_counter() - t0) / n

    steps(3)  # warm-up: kernel compilation / autotuning, allocator
    plain = steps(a.steps)
    print(f"step time {plain * 1e3:.1f} ms ({a.preset}, {a.batch_size} x {a.seq_len}, {trainer.device})", flush=True)
    phase(trainer, "_forward_loss", "phase: forward + loss")
    phase(trainer.optimizer, "step", "phase: optimizer")
    phase(trainer.balancer, "observe", "phase: balancer observe")
    phase(trainer.balancer, "step", "phase: balancer update")
    phase(torch.Tensor, "backward", "phase: backward")
    phase(step_module, "to_host", "phase: host read (the step's one sync)")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    stacks = torch._C._profiler._ExperimentalConfig(verbose=True) if a.stacks else None  # (else no stacks, 2.x)
    with profile(activities=activities, with_stack=a.stacks, experimental_config=stacks) as prof:
        profiled = steps(a.steps)
    ev = prof.key_averages()
    lines = [
        f"preset {a.preset}, batch {a.batch_size} x {a.seq_len}, device {trainer.device}",
        f"step time {plain * 1e3:.1f} ms (profiled {profiled * 1e3:.1f} ms)",
        "",
    ]
    phases = sorted((e for e in ev if e.key.startswith("phase:")), key=lambda e: e.key)
    for e in phases:
        lines.append(f"{e.key:<40} CPU {e.cpu_time_total / 1e3 / a.steps:8.1f} ms/step")
    rest = profiled * 1e3 - sum(e.cpu_time_total for e in phases) / 1e3 / a.steps
    lines.append(f"{'rest (metrics, host)':<40} wall {rest:7.1f} ms/step")
    if cuda:
        kernels = device_activity(prof.events())  # not the phases' GPU-side ranges: they would count twice
        busy = busy_seconds(kernels) * 1e3 / a.steps
        lines += [
            f"kernels per step {len(kernels) / a.steps:.0f}, device busy {busy:.1f} ms/step "
            f"({busy / (profiled * 1e3):.0%} of the step)",
            "",
        ]
        lines += device_timeline(prof.events(), kernels, a.steps)
    ops = [e for e in ev if not e.key.startswith("phase:")]
    lines += ["", "top operators by self CPU time (ms per step, calls per step):"]
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:25]:
        lines.append(f"  {e.key[:60]:<60} {e.self_cpu_time_total / 1e3 / a.steps:8.2f} {e.count / a.steps:8.0f}")
    if cuda:
        lines += ["", "top operators by device time (ms per step):"]
        for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:20]:
            lines.append(f"  {e.key[:60]:<60} {e.self_device_time_total / 1e3 / a.steps:8.2f} {e.count / a.steps:8.0f}")
    if cuda and a.stacks:
        lines += ["", "device time by (operator, innermost k3 call site), forward and optimizer (ms per step):"]
        sites: dict[tuple[str, str], float] = {}
        for e in prof.key_averages(group_by_stack_n=16):
            frame = next(
                (f for f in e.stack if "k3/" in f and "k3/ops/backend.py" not in f and "k3/ops/fused.py" not in f), None
            )  # (the dispatchers: their callers say more)
            if frame is not None and not e.key.startswith("phase:"):
                sites[e.key, frame] = sites.get((e.key, frame), 0.0) + e.self_device_time_total
        for (key, frame), t in sorted(sites.items(), key=lambda kv: -kv[1])[:30]:
            lines.append(f"  {key[:24]:<24} {frame[-64:]:<64} {t / 1e3 / a.steps:8.2f}")
        lines += ["", "device time by autograd node, backward (ms per step, calls per step):"]
        nodes: dict[str, list[float]] = {}
        for e in prof.events():
            if e.name.startswith("autograd::engine::evaluate_function: "):
                acc = nodes.setdefault(e.name.split(": ", 1)[1], [0.0, 0])
                acc[0] += e.device_time_total
                acc[1] += 1
        for name, (t, n) in sorted(nodes.items(), key=lambda kv: -kv[1][0])[:25]:
            lines.append(f"  {name[:60]:<60} {t / 1e3 / a.steps:8.2f} {n / a.steps:6.0f}")
    if cuda and a.stacks:  # which tensors the copy-like backward nodes handle (they carry no Python stack)
        loss_sum, _, _ = trainer._forward_loss(trainer.next_batches()[0])
        lines += ["", "autograd nodes of one micro-batch (count, node, input shape / dtype when saved):"]
        census: dict[str, int] = {}
        seen, todo = set(), [loss_sum.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            key = type(node).__name__
            if key == "SelectBackward0":
                key += f" {tuple(node._saved_self_sym_sizes)} dim {node._saved_dim}"
            elif key == "ToCopyBackward0":  # saves nothing: name what it feeds
                nxt = node.next_functions[0][0] if node.next_functions else None
                var = getattr(nxt, "variable", None)
                key += f" -> {type(nxt).__name__}" + ("" if var is None else f" {tuple(var.shape)} {var.dtype}")
            census[key] = census.get(key, 0) + 1
            todo += [n for n, _ in node.next_functions]
        for key, n in sorted(census.items(), key=lambda kv: -kv[1])[:40]:
            lines.append(f"  {n:6d}  {key[:100]}")
        del loss_sum
        from k3.train.newton_schulz import block_shape, newton_schulz

        lines += ["", "Newton-Schulz alone per group and block shape (device ms, CUDA events; random blocks):"]
        for group in trainer.optimizer.param_groups:
            if group["kind"] == "adamw":
                continue
            shapes: dict[tuple[int, int], int] = {}
            for p in group["params"]:
                rows, cols = block_shape(group, p.shape)
                shapes[rows, cols] = shapes.get((rows, cols), 0) + p.numel() // (rows * cols)
            for (rows, cols), n in shapes.items():
                x = torch.randn(n, rows, cols, device=trainer.device, dtype=torch.bfloat16)
                ms = cuda_time(lambda: newton_schulz(x, dtype=torch.bfloat16), warmup=1, iters=3) * 1e3
                tflop = n * 5 * (4 * min(rows, cols) ** 2 * max(rows, cols) + 2 * min(rows, cols) ** 3) / 1e12
                lines.append(
                    f"  {group['kind']:<12} {n:5d} x [{rows:4d}, {cols:4d}]  {ms:7.2f} ms  "
                    f"{tflop / ms * 1e3:6.0f} TFLOP/s"
                )
    if cuda:  # the optimizer by group kind (its whole step is one profiler range above)
        loss_sum, _, _ = trainer._forward_loss(trainer.next_batches()[0])
        loss_sum.backward()  # gradients to step on (the timed calls move the weights; this is a profile)
        lines += ["", "optimizer by group (device ms per call, CUDA events):"]
        opt = trainer.optimizer
        for group in opt.param_groups:
            fn = opt._adamw_group if group["kind"] == "adamw" else opt._muon_group
            with torch.no_grad():  # as in K3Muon.step
                ms = cuda_time(lambda: fn(group), warmup=1, iters=3) * 1e3
            numel = sum(p.numel() for p in group["params"])
            lines.append(f"  {group['kind']:<12} {len(group['params']):4d} tensors {numel / 1e6:8.1f}M  {ms:8.2f} ms")
    write_profile("profile_train_step", "\n".join(lines))


if __name__ == "__main__":
    main()
