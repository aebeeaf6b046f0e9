"""Serving under load through ``k3 serve``: time to first token and time per output token against concurrency, and
what the prefix cache saves.

    python benchmarks/serve_load.py [--ckpt DIR | --preset NAME] [--device cpu|cuda] [--concurrency 1,4,16]
                                    [--prompt 256]
                                    [--output 32] [--requests 2] [--prefix 512] [--out benchmarks/results]

Without ``--ckpt`` it serves a random checkpoint of ``--preset`` (default tiny; k3.bench.live_server.tiny_checkpoint,
a 400-token vocabulary). The server runs with
a prefix cache; every request streams, greedy, with ``ignore_eos`` so each produces exactly ``--output`` tokens,
and a prompt of ``--prompt`` random token ids (distinct per request: no cache hits). Per concurrency C, C clients
each send ``--requests`` requests one after another: TTFT (request sent to first text chunk), TPOT ((last chunk -
first chunk) / (tokens - 1)), each at p50 / p90 over all requests, and output tokens/s over the phase.

Prefix cache: requests that share a ``--prefix``-token prefix and differ in a 32-token tail, sent one at a time:
the first misses, the others hit; TTFT of the miss vs the mean of the hits, and the hit rate the server reports
(usage.prompt_tokens_details.cached_tokens / prompt tokens).
Results: serve-load.{md,json} (k3.bench.common.write_results).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from k3.bench.common import environment, write_results
from k3.bench.live_server import Server, tiny_checkpoint

COLUMNS = [
    "phase",
    "case",
    "requests",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "tokens_per_s",
    "detail",
]
MODEL = "k3"


def stream_one(url: str, prompt: list[int], max_tokens: int, timeout: float = 600) -> dict:
    """One streamed greedy completion: seconds to the first text chunk and to the last, chunks seen, usage."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    usage = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if "error" in j:
                raise RuntimeError(j["error"]["message"])
            if j.get("usage"):
                usage = j["usage"]
            if j.get("choices") and j["choices"][0].get("text"):
                now = time.perf_counter()
                first = now if first is None else first
                last = now
    if first is None or usage is None:
        raise RuntimeError("the stream ended without text or usage")
    return {"ttft": first - t0, "span": last - first, "usage": usage}


def load_phase(url: str, vocab: int, concurrency: int, requests: int, prompt: int, output: int, rng) -> dict:
    """C clients x ``requests`` streamed requests each, distinct random prompts."""
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(concurrency * requests)]
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(requests):
            try:
                r = stream_one(url, prompts[i * requests + j], output)
            except Exception as e:  # noqa: BLE001 - recorded in the row
                with lock:
                    errors.append(repr(e)[:200])
                continue
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["span"] * 1e3 / max(1, r["usage"]["completion_tokens"] - 1) for r in results]
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    row = {
        "phase": "load",
        "case": f"concurrency {concurrency}",
        "requests": len(results),
        "tokens_per_s": tokens / wall,
        "detail": f"{prompt}-token prompts, {output} tokens each, {wall:.1f}s",
    }
    if results:
        row |= {
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p90_ms": float(np.percentile(ttft, 90)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)),
            "tpot_p90_ms": float(np.percentile(tpot, 90)),
        }
    if errors:
        row["error"] = f"{len(errors)} failed: {errors[0]}"
    return row


def prefix_phase(url: str, vocab: int, prefix: int, output: int, n: int, rng) -> dict:
    """n requests sharing a ``prefix``-token prefix (32-token tails), one at a time: the first misses."""
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    runs = [stream_one(url, shared + [rng.randrange(3, vocab) for _ in range(32)], output) for _ in range(n)]
    miss, hits = runs[0], runs[1:]
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in hits)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in hits)
    hit_ttft = statistics.mean(r["ttft"] for r in hits) * 1e3
    return {
        "phase": "prefix cache",
        "case": f"{prefix}-token shared prefix",
        "requests": n,
        "ttft_p50_ms": hit_ttft,
        "detail": f"miss TTFT {miss['ttft'] * 1e3:.1f} ms, hits {hit_ttft:.1f} ms mean "
        f"({miss['ttft'] * 1e3 / hit_ttft:.2f}x faster); hit rate {cached / prompt_tokens:.1%} of the hits' "
        f"prompt tokens; the miss cached {miss['usage']['prompt_tokens_details']['cached_tokens']}",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint to serve (default: a random one of --preset)")
    ap.add_argument("--preset", default="tiny", help="preset of the random checkpoint served without --ckpt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=32, help="output tokens per request")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--prefix", type=int, default=512, help="shared-prefix tokens of the prefix-cache phase")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    if not levels or min(levels) < 1 or min(a.prompt, a.output, a.requests, a.prefix) < 1:
        raise SystemExit("--concurrency, --prompt, --output, --requests and --prefix must be positive")
    work = Path(tempfile.mkdtemp(prefix="k3-serve-load-"))
    ckpt = Path(a.ckpt) if a.ckpt else tiny_checkpoint(work / "ckpt", a.preset)
    config = json.loads((ckpt / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]  # a multimodal release wraps the text config
    args = ["--device", a.device, "--max-batch", str(a.max_batch), "--max-context", str(a.max_context)]
    args += ["--prefix-cache-gb", "1"]
    server = Server(ckpt, work / "server.log", args, start_s=600)
    rows: list[dict] = []
    meta = {**environment(), "checkpoint": a.ckpt or f"{a.preset} random (vocabulary 400)", "server_args": args}
    rng = random.Random(0)
    try:
        stream_one(server.url, [rng.randrange(3, vocab) for _ in range(a.prompt)], a.output)  # warm-up
        for c in levels:
            rows.append(load_phase(server.url, vocab, c, a.requests, a.prompt, a.output, rng))
            print(rows[-1], flush=True)
        rows.append(prefix_phase(server.url, vocab, a.prefix, a.output, 4, rng))
        print(rows[-1], flush=True)
    finally:
        server.stop()
    notes = (
        "Streamed greedy completions with ignore_eos through k3 serve on 127.0.0.1 (client threads in this "
        "process). TTFT: request sent to the first text chunk; TPOT: (last chunk - first chunk) / (tokens - 1); "
        "tokens/s: output tokens over the phase's wall time."
    )
    write_results("serve-load", rows, COLUMNS, meta, notes, out_dir=a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
