"""``k3 bench serve``: ``k3 serve`` under load, beside the graph-replayed decode step it is built on.

A ``k3 serve`` child process serves a checkpoint (``--ckpt``, or a random one of ``--preset`` with a 400-token
vocabulary); clients (asyncio, one connection each, spread over up to 4 processes) stream greedy completions with
``ignore_eos`` so each yields exactly ``output`` tokens from a distinct random prompt. At each concurrency C, after
a warm-up round, C clients send requests back to back for ``rounds`` rounds: output tokens/s over the phase, TTFT
(request sent to first text) and TPOT ((last text - first text) / (tokens - 1)) at p50 / p90. Then, in this process
on the same device, the engine's captured decode step at B = max concurrency is timed (CUDA events over graph
replays at a context of prompt + output / 2): ``limit_tok_s`` = B / step, the kernel throughput the server is
measured against.

Results: serve.{md,json} (k3.bench.common.write_results).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from k3.bench.common import environment, write_results
from k3.bench.live_server import Server, bench_tokenizer, random_config, random_model

LEVELS = {"kimi-linear-48b": (1, 16, 64)}  # concurrencies by preset, where not 1, 8, 32, 64
COLUMNS = [
    "model",
    "case",
    "concurrency",
    "requests",
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "of_limit",
    "vs_c1",
    "detail",
]


async def _stream(client, prompt: list[int], output: int) -> dict:
    body = {
        "model": "k3",
        "prompt": prompt,
        "max_tokens": output,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = usage = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if "error" in j:
                raise RuntimeError(j["error"]["message"])
            if j.get("usage"):
                usage = j["usage"]
            if j.get("choices") and j["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    if first is None or usage is None:
        raise RuntimeError("the stream ended without text or usage")
    return {"start": t0, "ttft": first - t0, "span": last - first, "tokens": usage["completion_tokens"]}


async def _clients(url: str, vocab: int, c: int, rounds: int, prompt: int, output: int, seed: int, ready=None):
    """``c`` clients on one event loop: a warm-up request each, then (after ``ready``, a barrier shared with the
    other client processes) ``rounds`` requests each back to back; (results, errors, start, end, the share of a
    core this process used meanwhile: near 1, the clients themselves were the limit)."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one():
            return await _stream(client, [rng.randrange(3, vocab) for _ in range(prompt)], output)

        await asyncio.gather(*(one() for _ in range(c)))  # warm-up round at this concurrency
        if ready is not None:
            await asyncio.to_thread(ready.wait)
        results, errors = [], []

        async def worker():
            for _ in range(rounds):
                try:
                    results.append(await one())
                except Exception as e:  # noqa: BLE001 - counted in the row
                    errors.append(repr(e)[:200])

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(c)))
        t1 = time.perf_counter()
        return results, errors, t0, t1, (time.process_time() - cpu0) / max(t1 - t0, 1e-9)


def _client_process(out, *args) -> None:
    out.put(asyncio.run(_clients(*args)))


def _phase(url: str, vocab: int, c: int, rounds: int, prompt: int, output: int, seed: int, procs: int) -> dict:
    """One concurrency level: ``c`` clients spread over ``procs`` processes (so that parsing the streams does not
    throttle them), timed from the first start to the last end (perf_counter: one clock for all processes)."""
    import httpx

    procs = max(1, min(procs, c))
    marks = {}

    def health() -> None:  # the engine's counters where the phase begins (after the warm-up round)
        marks["before"], marks["t"] = httpx.get(url + "/health", timeout=30).json(), time.perf_counter()

    if procs == 1:
        parts = [asyncio.run(_clients(url, vocab, c, rounds, prompt, output, seed, SimpleNamespace(wait=health)))]
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        out, ready = ctx.Queue(), ctx.Barrier(procs + 1)  # the clients and this process, at the phase's start
        shares = [c // procs + (i < c % procs) for i in range(procs)]
        workers = [
            ctx.Process(
                target=_client_process, args=(out, url, vocab, n, rounds, prompt, output, seed * 1000 + i, ready)
            )
            for i, n in enumerate(shares)
        ]
        for w in workers:
            w.start()
        ready.wait(timeout=1800)
        health()
        parts = [out.get(timeout=1800) for _ in workers]
        for w in workers:
            w.join()
    after, t_after = httpx.get(url + "/health", timeout=30).json(), time.perf_counter()
    before, t_before = marks["before"], marks["t"]
    results = [r for p in parts for r in p[0]]
    errors = [e for p in parts for e in p[1]]
    wall = max(p[3] for p in parts) - min(p[2] for p in parts)
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["span"] * 1e3 / max(1, r["tokens"] - 1) for r in results]
    row = {
        "case": f"prompt {prompt} / output {output}",
        "concurrency": c,
        "requests": len(results),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "detail": f"{wall:.1f} s; {_engine_share(before, after, t_after - t_before)}; clients' CPU "
        f"{max(p[4] for p in parts):.0%} of a core at most",
    }
    if results:
        t0 = min(p[2] for p in parts)
        # per request (JSON only): [sent, s after the phase began; TTFT ms; TPOT ms], in the order sent
        row["timeline"] = sorted(
            [round(r["start"] - t0, 3), round(r["ttft"] * 1e3, 1), round(r["span"] * 1e3 / max(1, r["tokens"] - 1), 2)]
            for r in results
        )
        row |= {
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p90_ms": float(np.percentile(ttft, 90)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)),
            "tpot_p90_ms": float(np.percentile(tpot, 90)),
        }
    if errors:
        row["detail"] += f"; {len(errors)} failed: {errors[0]}"
    return row


def _engine_share(before: dict, after: dict, seconds: float) -> str:
    """What the engine did between two /health answers (the phase's start and its end): steps a second, decode
    rows a step, the share of the time inside ``Engine.step`` (near 100%: the engine is the limit; far below: it
    waited for requests), the prefill passes, and the engine's part of the time to first token (means: waiting
    for a slot, then from the slot to the token on the engine's host; the rest of TTFT is the API and transport)."""
    keys = ("steps", "decode_rows", "busy_s", "prefill_passes", "first_tokens", "queue_s", "first_token_s")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    steps, firsts = max(d["steps"], 1), max(d["first_tokens"], 1)
    return (
        f"engine {d['steps'] / seconds:.0f} steps/s, {d['decode_rows'] / steps:.1f} rows a step, busy "
        f"{d['busy_s'] / seconds:.0%}, {d['prefill_passes']} prefill passes, first token after "
        f"{1e3 * d['queue_s'] / firsts:.0f} ms queued + {1e3 * d['first_token_s'] / firsts:.0f} ms"
    )


def graph_step_ms(model, tokenizer, batch: int, context: int) -> float:
    """The captured decode step of ``model`` at ``batch`` sequences of ``context`` tokens: median ms over CUDA-event
    replays."""
    import torch

    from k3.infer.engine import Engine

    engine = Engine(model, tokenizer, max_batch=batch, max_context=context + 8)
    cache, slots, times = engine.cache, list(range(batch)), []
    for i in range(30):
        for s in slots:  # every replay at the same context: undo the previous step's advance
            cache.seq_lens[s] = context
            for layer in cache.layers:
                if hasattr(layer, "lengths"):
                    layer.lengths[s] = context
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.graphs.replay_from(engine.last_tokens, slots, [])
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return float(np.median(times))


def _served_model(ckpt: str | None, preset: str, device: str):
    """(model, tokenizer) the server served: the checkpoint, or the same random model (seed 0) rebuilt here."""
    if ckpt:
        from k3.infer.load import load_for_inference

        model, tokenizer, _ = load_for_inference(ckpt, device, "bfloat16")
        return model, tokenizer
    tokenizer = bench_tokenizer()
    return random_model(random_config(preset, tokenizer), device), tokenizer


def _one_model(rows, label, source, vocab, device, levels, cases, rounds, server_args, client_procs, rng, log):
    """Every case and concurrency through one ``k3 serve`` of one model; returns its server arguments and the
    engine's start-up lines of its log (warm-up and graph capture times)."""
    top = max(levels)
    context = max(p + o for p, o in cases) + 64
    args = ["--device", device, "--max-batch", str(top), "--max-context", str(context), *source, *server_args]
    server = Server(None, log, args, start_s=1800)
    try:
        for prompt, output in cases:
            for c in levels if (prompt, output) == cases[0] else tuple(c for c in levels if c >= 16):
                row = _phase(server.url, vocab, c, rounds, prompt, output, rng.randrange(2**31), client_procs)
                rows.append({"model": label, **row})
                print({k: v for k, v in row.items() if k != "timeline"}, flush=True)
    finally:
        server.stop()
    return args, [line for line in Path(log).read_text(errors="replace").splitlines() if "k3.infer: engine:" in line]


def run(
    out_dir: str | None = None,
    quick: bool = False,
    ckpt: str | None = None,
    presets: tuple[str, ...] = ("small-1b",),
    device: str = "cuda",
    concurrency: tuple[int, ...] | None = None,
    cases: tuple[tuple[int, int], ...] = ((256, 128), (32, 512)),
    rounds: int = 2,
    server_args: tuple[str, ...] = (),
    client_procs: int | None = None,
) -> list[dict]:
    """Serve each model (``ckpt``, else each preset with random weights built on the device: ``k3 serve
    --random``) and load it at each concurrency (default: LEVELS, else 1, 8, 32, 64); on a GPU time its graph step
    at the largest concurrency after its server stopped. One results file for all."""
    import torch

    work = Path(tempfile.mkdtemp(prefix="k3-bench-serve-"))
    rows: list[dict] = []
    rng = random.Random(0)
    if client_procs is None:  # a process of clients per 4 cores, at most 4: the server keeps the rest
        client_procs = max(1, min(4, (os.cpu_count() or 1) // 4))
    models = [(ckpt, None)] if ckpt else [(None, p) for p in presets]
    served, started = {}, {}
    for path, preset in models:
        label = Path(path).name if path else f"{preset} (random)"
        source = ["--ckpt", str(path)] if path else ["--random", preset]
        if path:
            config = json.loads((Path(path) / "config.json").read_text())
            vocab = config.get("text_config", config)["vocab_size"]
        else:
            vocab = bench_tokenizer().vocab_size
        levels = concurrency or LEVELS.get(preset, (1, 8, 32, 64))
        log = work / f"server-{len(served)}.log"
        args, started[label] = _one_model(
            rows,
            label,
            source,
            vocab,
            device,
            levels,
            cases,
            1 if quick else rounds,
            server_args,
            client_procs,
            rng,
            log,
        )
        served[label] = args
        if device != "cuda":
            continue
        top = max(levels)
        model, tokenizer = _served_model(path, preset, device)
        limits = {}
        for prompt, output in cases:
            ms = graph_step_ms(model, tokenizer, top, prompt + output // 2)
            limits[f"prompt {prompt} / output {output}"] = top / ms * 1e3
            rows.append(
                {
                    "model": label,
                    "case": f"graph decode step, B={top}, context {prompt + output // 2}",
                    "concurrency": top,
                    "tokens_per_s": top / ms * 1e3,
                    "detail": f"{ms:.3f} ms a step",
                }
            )
        del model
        torch.cuda.empty_cache()
        for row in rows:
            if row["model"] == label and row["concurrency"] == top and row["case"] in limits:
                row["of_limit"] = row["tokens_per_s"] / limits[row["case"]]
    for row in rows:  # throughput over the same model and case at one client
        one = next(
            (r for r in rows if r["model"] == row["model"] and r["case"] == row["case"] and r["concurrency"] == 1), None
        )
        if one is not None and row is not one and "ttft_p50_ms" in row:
            row["vs_c1"] = row["tokens_per_s"] / one["tokens_per_s"]
    notes = (
        "Streamed greedy completions (ignore_eos) through k3 serve on 127.0.0.1; asyncio clients, one connection "
        f"each, spread over {client_procs} client process(es), a warm-up round per concurrency. TTFT: request sent "
        "to first text; TPOT: (last text - first text) / (tokens - 1); tokens/s: output tokens over the phase. "
        "detail: the phase's wall time; what the engine did from a /health answer at the phase's start (after the "
        "warm-up round) to one after it (busy: time inside Engine.step; first token: the engine's mean wait for a "
        "slot, then from the slot to the token; the rest of TTFT is the API and transport); the busiest client "
        "process's CPU share. "
        "of_limit (at a model's largest concurrency): tokens/s over B / the graph decode step at that B, measured "
        "after its server stopped, on the same device. vs_c1: tokens/s over the same case's at one client. "
        "Random models: bfloat16 weights built on the device, "
        "vocabulary narrowed to a 400-token BPE (their lm_head is that much smaller than the preset's)."
    )
    engine = next((server_args[i + 1] for i, a in enumerate(server_args[:-1]) if a == "--engine"), None)
    meta = {
        **environment(),
        "server_args": served,
        "server_start": started,
        "engine": engine or ("process" if device == "cuda" else "thread"),
        "client_processes": client_procs,
    }
    write_results("serve", rows, COLUMNS, meta, notes, out_dir=out_dir)
    return rows
