"""CPU measurements for ``k3 audit --measure`` (questions 6 and 7), on a randomly initialised small model.

The audited config itself is measured when it is small (<= ``MAX_MEASURE_PARAMS``); otherwise the ``small``
preset stands in, and the report says so. Timings are wall-clock medians on this CPU in fp32 with the
reference (pure PyTorch) kernels, one thread by default (stable on a shared CPU), best of a few runs: they
show relative costs (prefix hit vs miss, AttnRes modes, hybrid vs full-MLA), not what a GPU does.
"""

from __future__ import annotations

import statistics
import time

import torch

from k3.config import K3Config, get_preset

MAX_MEASURE_PARAMS = 60e6


class _IdTokenizer:
    """Engine needs ``eos_id`` and ``decode``; the audit never looks at text."""

    eos_id = None

    def decode(self, ids):
        return ""


def measured_config(config: K3Config, params_total: float) -> tuple[K3Config, str]:
    if params_total <= MAX_MEASURE_PARAMS:
        return config, config.name
    return get_preset("small"), "small (stand-in: the audited config is too large to run on a CPU)"


def _model(config: K3Config, seed: int = 0):
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(seed)
    return K3ForCausalLM(config).eval()


def environment() -> dict:
    return {"device": "CPU", "torch": torch.__version__, "dtype": "float32",
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _prompt(config: K3Config, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (n,), generator=g).tolist()


class _Threads:
    """Run with a fixed torch thread count (1 by default: stable timings on a shared, busy CPU)."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def _decode_run(model, cfg: K3Config, batch: int, prompt_len: int, decode_steps: int) -> tuple[float, float]:
    """(seconds of the packed prefill pass, seconds of ``decode_steps`` decode steps) for one fresh engine."""
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    eng = Engine(model, _IdTokenizer(), max_batch=batch, prefill_chunk=prompt_len * batch,
                 max_context=prompt_len + decode_steps + 2)
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add(_prompt(cfg, prompt_len, i), params)
    t0 = time.perf_counter()
    eng.step()  # the whole prefill of every sequence (one packed pass) + first tokens
    t1 = time.perf_counter()
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    assert steps == decode_steps
    return t1 - t0, time.perf_counter() - t1


def serving(config: K3Config, prompt_len: int = 512, batches: tuple[int, ...] = (1, 4), decode_steps: int = 8,
            block: int = 64, repeats: int = 3, threads: int = 1) -> dict:
    """Prefill tokens/s, decode tokens/s per batch for the model and its full-MLA twin, and a prefix-cache
    miss vs hit (two prompts sharing all but their last block) through ``k3.infer.engine.Engine``.
    Best of ``repeats`` fresh runs each."""
    from k3.audit.longctx import full_mla_twin
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    rows = []
    with _Threads(threads):
        for label, cfg in (("hybrid", config), ("full-MLA twin", full_mla_twin(config))):
            model = _model(cfg)
            for b in batches:
                runs = [_decode_run(model, cfg, b, prompt_len, decode_steps) for _ in range(repeats)]
                pre, dec = min(r[0] for r in runs), min(r[1] for r in runs)
                rows.append({"model": label, "batch": b, "prompt": prompt_len,
                             "prefill_tokens_per_s": b * prompt_len / pre,
                             "decode_tokens_per_s": b * decode_steps / dec,
                             "decode_ms_per_step": 1e3 * dec / decode_steps})
        shared = (prompt_len // block - 1) * block
        model = _model(config)
        head = _prompt(config, shared, 99)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        best: dict[str, dict] = {}
        for _ in range(repeats):
            eng = Engine(model, _IdTokenizer(), max_batch=1, prefill_chunk=max(shared, block), block_size=block,
                         prefix_cache_bytes=1 << 30, max_context=prompt_len + 4)
            for attempt, seed in (("miss (cold cache)", 100), ("hit (shared prefix cached)", 101)):
                prompt = head + _prompt(config, prompt_len - shared, seed)
                t0 = time.perf_counter()
                out = eng.generate([prompt], params)[0]
                row = {"request": attempt, "prompt": prompt_len, "seconds": time.perf_counter() - t0,
                       "cached_tokens": out.get("cached_tokens", 0)}
                if attempt not in best or row["seconds"] < best[attempt]["seconds"]:
                    best[attempt] = row
    return {"rows": rows, "prefix_cache": list(best.values()), "prompt": prompt_len, "threads": threads,
            "decode_steps": decode_steps,
            "repeats": repeats}


def attn_res_latency(config: K3Config, tokens: int = 256, repeats: int = 5, threads: int = 1) -> list[dict]:
    """Forward latency of [1, tokens] per AttnRes mode (same seed, same input): min and median of ``repeats``
    after a warm-up, the modes interleaved so that a burst of load elsewhere hits them alike."""
    from k3.audit.attnres import MODES

    x = torch.tensor([_prompt(config, tokens, 7)])
    models = {mode: _model(config.replace(**{"attn_res.mode": mode})) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with _Threads(threads), torch.no_grad():
        for mode, model in models.items():
            model(x)  # warm-up
        for _ in range(repeats):
            for mode, model in models.items():
                t0 = time.perf_counter()
                model(x)
                times[mode].append(time.perf_counter() - t0)
    rows = [{"mode": m, "tokens": tokens, "ms": 1e3 * min(t), "ms_median": 1e3 * statistics.median(t)}
            for m, t in times.items()]
    base = next(r["ms"] for r in rows if r["mode"] == "none")
    for r in rows:
        r["vs_none"] = r["ms"] / base
    return rows
