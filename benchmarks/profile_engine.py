"""Where a serving step's time goes: the Engine alone (no HTTP), then under cProfile.

    python benchmarks/profile_engine.py [--preset small-1b] [--batches 1,8,64] [--prompt 256] [--output 128]
        [--profile 64] [--top 35] [--closed 64] [--rounds 3] [--no-warm-up] [--no-graphs] [--prefill 1,4,16]
        [--budgets 4096,16384]

For each batch B: B random prompts of ``--prompt`` tokens, greedy, ``--output`` tokens each with ignore_eos, run
by ``Engine.step`` to the end; output tokens/s, wall time per decode-only step, and the captured graph step at B
(CUDA events) beside it, so the host work a step adds is visible (random bf16 weights, the serving benchmark's
400-token vocabulary). Then one run at ``--profile`` under cProfile:
the functions with the most own time. With ``--closed C``: C closed-loop clients first (each adds its next request
when its last one finishes, ``--rounds`` each, as the serving benchmark's clients do): time to first token in
engine steps and wall time, and the slowest steps with what they ran, so a stall (a compilation, an autotuner)
shows with the pass that caused it; with ``--budgets``, once per step token budget, each on its own engine, so
budgets compare in one process. With ``--prefill N,...``: one packed prefill pass of N prompts of ``--prompt``
tokens each (``NxL``: of L tokens), its wall time, device time (CUDA events) and the kernels it launched
(torch.profiler), so a pass whose host work exceeds its device work shows. Writes $K3_BENCH_OUT/profile_engine.txt
when set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import random
import time
from pathlib import Path


def run_batch(engine, batch: int, prompt: int, output: int, vocab: int, rng: random.Random) -> dict:
    from k3.infer.sampling import SamplingParams

    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add([rng.randrange(vocab) for _ in range(prompt)], params)
    marks, tokens = [], 0
    t0 = time.perf_counter()
    while engine.has_work():
        out = engine.step()
        tokens += sum(len(o.token_ids) for o in out)
        marks.append((time.perf_counter(), len(out)))
    wall = time.perf_counter() - t0
    full = [b - a for (a, _), (b, n) in zip(marks, marks[1:]) if n == batch]
    full.sort()
    return {
        "batch": batch,
        "tokens_per_s": tokens / wall,
        "steps": len(marks),
        "step_ms_p50": 1e3 * full[len(full) // 2] if full else float("nan"),
        "wall_s": wall,
    }


def run_closed(engine, clients: int, rounds: int, prompt: int, output: int, vocab: int, rng) -> list[str]:
    """``clients`` closed-loop clients of ``rounds`` requests each; TTFT percentiles and the 8 slowest steps."""
    from k3.infer.sampling import SamplingParams

    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    left, added, ttft, steps = {}, {}, [], []

    def submit(client: int) -> None:
        rid = engine.add([rng.randrange(vocab) for _ in range(prompt)], params)
        left[rid], added[rid] = client, time.perf_counter()

    todo = {c: rounds - 1 for c in range(clients)}
    for c in range(clients):
        submit(c)
    tokens, t0 = 0, time.perf_counter()
    while engine.has_work():
        timing = dict(engine.timing)
        a = time.perf_counter()
        out = engine.step()
        b = time.perf_counter()
        passes = engine.timing["prefill_passes"] - timing["prefill_passes"]
        fed = engine.timing["prefill_tokens"] - timing["prefill_tokens"]
        steps.append((b - a, len(engine.running), passes, fed, b - t0))
        for o in out:
            tokens += len(o.token_ids)
            if o.request_id in added and o.token_ids:
                ttft.append(b - added.pop(o.request_id))
            if o.finished:
                c = left.pop(o.request_id)
                if todo[c]:
                    todo[c] -= 1
                    submit(c)
    wall = time.perf_counter() - t0
    ttft.sort()
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    lines = [
        f"closed loop, {clients} clients x {rounds}: {tokens / wall:.0f} tok/s, wall {wall:.2f} s, {len(steps)} steps, "
        f"TTFT p50 {1e3 * q(ttft, 0.5):.1f} ms p90 {1e3 * q(ttft, 0.9):.1f} ms max {1e3 * ttft[-1]:.1f} ms"
    ]
    for dt, running, passes, fed, at in sorted(steps, reverse=True)[:8]:
        lines.append(
            f"  slow step {1e3 * dt:.1f} ms at {at:.2f} s: {running} running, {passes} prefill pass(es), {fed} tokens"
        )
    step_ms = sorted(1e3 * s[0] for s in steps)
    lines.append(f"  step p50 {q(step_ms, 0.5):.3f} ms, p90 {q(step_ms, 0.9):.3f} ms")
    mixed = sorted(1e3 * s[0] for s in steps if s[2])
    if mixed:
        lines.append(f"  steps with a prefill: {len(mixed)}, p50 {q(mixed, 0.5):.3f} ms, p90 {q(mixed, 0.9):.3f} ms")
    return lines


def prefill_pass(engine, segments: int, prompt: int, vocab: int) -> str:
    """One packed prefill forward of ``segments`` prompts of ``prompt`` tokens on free slots (then emptied)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    slots = engine.free_slots[:segments]
    cuda = engine.device.type == "cuda"

    def once() -> None:
        engine.cache.reset(slots)
        ids = torch.randint(vocab, (1, segments * prompt), device=engine.device)
        cu = torch.tensor([0] + [prompt] * segments).cumsum(0)
        with torch.no_grad():
            engine.model(ids, cu_seqlens=cu, cache=engine.cache, seq_ids=slots, last_only=True)

    once()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    once()
    host = time.perf_counter() - t0
    device = None
    if cuda:
        end.record()
        torch.cuda.synchronize()
        device = start.elapsed_time(end)
    wall = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        once()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    engine.cache.reset(slots)
    dev = f", device {device:.1f} ms" if device is not None else ""
    head = (
        f"prefill pass {segments} x {prompt} tokens: launched in {1e3 * host:.1f} ms, done in {1e3 * wall:.1f} ms"
        f"{dev}; {ops} aten ops, {kernels} kernels"
    )
    by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    tables = [events.table(sort_by=key, row_limit=12) for key in dict.fromkeys([by, "self_cpu_time_total"])]
    return "\n".join([head, *tables])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--profile", type=int, default=64)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--closed", type=int, default=0, help="closed-loop clients (0: none)")
    p.add_argument("--rounds", type=int, default=3, help="requests per closed-loop client")
    p.add_argument("--no-warm-up", action="store_true", help="build the engine without its prefill warm-up")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs captured at start)")
    p.add_argument(
        "--prefill",
        default="",
        help="prefill passes to time, comma-separated: N (prompts of --prompt tokens) or NxL (of L tokens)",
    )
    p.add_argument(
        "--budgets",
        default="",
        help="step token budgets (max_num_batched_tokens) to run the closed loop at, each on its own engine in this "
        "process, comma-separated (default: the engine's)",
    )
    a = p.parse_args()
    passes = [tuple(map(int, x.split("x"))) if "x" in x else (int(x), a.prompt) for x in a.prefill.split(",") if x]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from k3.bench.live_server import bench_tokenizer, random_config, random_model
    from k3.bench.serve import graph_step_ms
    from k3.infer.engine import Engine

    tokenizer = bench_tokenizer()
    model = random_model(random_config(a.preset, tokenizer), a.device)
    batches = [int(b) for b in a.batches.split(",")]
    budgets = [int(b) for b in a.budgets.split(",") if b] or [None]

    def build(budget):
        return Engine(
            model,
            tokenizer,
            max_batch=max(batches + [a.profile, a.closed] + [n for n, _ in passes]),
            max_context=a.prompt + a.output + 64,
            max_num_batched_tokens=budget,
            warm_up=False if a.no_warm_up else None,
            cuda_graphs=False if a.no_graphs else None,
        )

    vocab, rng, lines = model.config.vocab_size, random.Random(0), []
    for i, budget in enumerate(budgets):
        engine = build(budget)
        if i == 0:
            for n, length in passes:
                lines.append(prefill_pass(engine, n, length, vocab))
                print(lines[-1], flush=True)
        if a.closed:
            lines.append(f"step budget {engine.max_num_batched_tokens} tokens:")
            print(lines[-1], flush=True)
            for line in run_closed(engine, a.closed, a.rounds, a.prompt, a.output, vocab, rng):
                lines.append(line)
                print(line, flush=True)
        if i < len(budgets) - 1:
            del engine
    run_batch(engine, max(batches), a.prompt, 8, vocab, rng)  # warm-up
    for b in batches:
        r = run_batch(engine, b, a.prompt, a.output, vocab, rng)
        lines.append(
            f"engine B={b}: {r['tokens_per_s']:.0f} tok/s, {r['steps']} steps, decode step p50 "
            f"{r['step_ms_p50']:.3f} ms, wall {r['wall_s']:.2f} s"
        )
        print(lines[-1], flush=True)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        r = run_batch(engine, a.profile, a.prompt, a.output, vocab, rng)
        prof.disable()
        lines.append(f"profiled B={a.profile}: {r['tokens_per_s']:.0f} tok/s, step p50 {r['step_ms_p50']:.3f} ms")
        for order in ("tottime", "cumtime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(a.top)
            lines.append(s.getvalue())
    del engine
    for b in batches if model.lm_head.weight.is_cuda else []:
        ms = graph_step_ms(model, tokenizer, b, a.prompt + a.output // 2)
        lines.append(f"graph step B={b}: {ms:.3f} ms ({b / ms * 1e3:.0f} tok/s)")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if os.environ.get("K3_BENCH_OUT"):
        Path(os.environ["K3_BENCH_OUT"], "profile_engine.txt").write_text(text)


if __name__ == "__main__":
    main()
