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
    return {"device": "CPU", "torch": torch.__version__, "dtype": "float32", "time": time.strftime("%Y-%m-%d %H:%M:%S")}


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

    eng = Engine(
        model,
        _IdTokenizer(),
        max_batch=batch,
        max_num_batched_tokens=prompt_len * batch,
        max_context=prompt_len + decode_steps + 2,
    )
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


def serving(
    config: K3Config,
    prompt_len: int = 512,
    batches: tuple[int, ...] = (1, 4),
    decode_steps: int = 8,
    block: int = 64,
    repeats: int = 3,
    threads: int = 1,
) -> dict:
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
                rows.append(
                    {
                        "model": label,
                        "batch": b,
                        "prompt": prompt_len,
                        "prefill_tokens_per_s": b * prompt_len / pre,
                        "decode_tokens_per_s": b * decode_steps / dec,
                        "decode_ms_per_step": 1e3 * dec / decode_steps,
                    }
                )
        shared = (prompt_len // block - 1) * block
        model = _model(config)
        head = _prompt(config, shared, 99)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        best: dict[str, dict] = {}
        for _ in range(repeats):
            eng = Engine(
                model,
                _IdTokenizer(),
                max_batch=1,
                max_num_batched_tokens=max(shared, block),
                block_size=block,
                prefix_cache_bytes=1 << 30,
                max_context=prompt_len + 4,
            )
            for attempt, seed in (("miss (cold cache)", 100), ("hit (shared prefix cached)", 101)):
                prompt = head + _prompt(config, prompt_len - shared, seed)
                t0 = time.perf_counter()
                out = eng.generate([prompt], params)[0]
                row = {
                    "request": attempt,
                    "prompt": prompt_len,
                    "seconds": time.perf_counter() - t0,
                    "cached_tokens": out.get("cached_tokens", 0),
                }
                if attempt not in best or row["seconds"] < best[attempt]["seconds"]:
                    best[attempt] = row
    return {
        "rows": rows,
        "prefix_cache": list(best.values()),
        "prompt": prompt_len,
        "threads": threads,
        "decode_steps": decode_steps,
        "repeats": repeats,
    }


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
    rows = [
        {"mode": m, "tokens": tokens, "ms": 1e3 * min(t), "ms_median": 1e3 * statistics.median(t)}
        for m, t in times.items()
    ]
    base = next(r["ms"] for r in rows if r["mode"] == "none")
    for r in rows:
        r["vs_none"] = r["ms"] / base
    return rows


def depth_config(config: K3Config, hidden: int = 256) -> K3Config:
    """``config`` at its own depth, schedule (KDA / MLA, dense / MoE) and AttnRes blocks, but narrow enough to
    run forward and backward on a CPU in seconds: width ``hidden``, 2 heads per mixer, 8 experts top-2, one shared
    expert (if the config has any), a 512-token vocabulary. AttnRes costs scale with depth and width, so this keeps
    the depth that sets their size and lets the width be read off as a factor."""
    moe = config.moe
    return config.replace(
        **{
            "name": f"{config.name}-depth-narrow",
            "vision": None,
            "vocab_size": 512,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "kda.num_heads": 2,
            "kda.head_dim": 64,
            "kda.v_head_dim": 64,
            "kda.forget_gate_rank": 32,
            "kda.output_gate_rank": 32,
            "mla.num_heads": 2,
            "mla.q_lora_rank": None if config.mla.q_lora_rank is None else hidden // 4,
            "mla.kv_lora_rank": hidden // 4,
            "mla.qk_nope_head_dim": 32,
            "mla.qk_rope_head_dim": 16,
            "mla.v_head_dim": 32,
            "moe.num_experts": 8,
            "moe.num_experts_per_token": 2,
            "moe.num_shared_experts": min(moe.num_shared_experts, 1),
            "moe.moe_intermediate_size": hidden // 4,
            "moe.latent_size": None if moe.latent_size is None else hidden // 2,
        }
    )


def saved_tensor_bytes(model, x: torch.Tensor, autocast: bool = False) -> tuple[int, float, int]:
    """(bytes autograd saves for the backward pass of one forward + backward, seconds of that pass, peak bytes the
    pass allocated above what was allocated before it (0 off CUDA)): every saved tensor's storage counted once,
    parameters (and views of them) excluded: the activation memory of the step. ``autocast``: bf16 autocast on
    the model's device, as training runs there."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    cuda = x.device.type == "cuda"

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return t

    if cuda:
        torch.cuda.synchronize(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        before = torch.cuda.memory_allocated(x.device)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).logits.float().logsumexp(-1).mean()
    loss.backward()
    peak = 0
    if cuda:
        torch.cuda.synchronize(x.device)
        peak = torch.cuda.max_memory_allocated(x.device) - before
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return sum(storages.values()), seconds, peak


def attn_res_depth(
    config: K3Config,
    tokens: int = 64,
    repeats: int = 2,
    threads: int = 1,
    hidden: int = 256,
    modes: tuple[str, ...] = ("none", "snapshot", "block_sum", "full"),
    device: str = "cpu",
) -> dict:
    """AttnRes at ``config``'s depth (``depth_config``): per mode, the activation bytes autograd saves for one
    forward + backward of [1, tokens] (measured), the analytic mix FLOPs and bytes (k3.audit.attnres) against the
    model's forward FLOPs (k3.audit.accounting), the first pass's time (on a GPU it includes the kernel compiles)
    and the time of forward + backward (min and median of ``repeats`` after it, modes interleaved). On CPU in fp32
    with ``threads`` threads; on a CUDA ``device`` under bf16 autocast (the training setting, so the fast kernels
    run), with the peak memory the pass allocated. The rows come from :func:`attn_res_depth_rows`."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    base = depth_config(config, hidden)
    x = depth_tokens(base, tokens, dev)
    models = {mode: depth_model(base, mode).to(dev) for mode in modes}
    saved, first, peak, times = {}, {}, {}, {mode: [] for mode in modes}
    with _Threads(threads):
        for mode, model in models.items():
            saved[mode], first[mode], _ = saved_tensor_bytes(model, x, autocast=cuda)  # also the warm-up
        for _ in range(repeats):
            for mode, model in models.items():
                _, seconds, peak[mode] = saved_tensor_bytes(model, x, autocast=cuda)
                times[mode].append(seconds)
    measured = {m: {"saved": saved[m], "first": first[m], "times": times[m], "peak": peak[m]} for m in modes}
    return attn_res_depth_rows(base, tokens, measured, threads, torch.cuda.get_device_name(dev) if cuda else None)


def depth_model(base: K3Config, mode: str):
    """``base`` (a ``depth_config``) with AttnRes mode ``mode``, seeded: every mode's model starts alike."""
    return _model(base.replace(**{"attn_res.mode": mode})).train()


def depth_tokens(base: K3Config, tokens: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The [1, tokens] input every depth measurement runs on."""
    return torch.tensor([_prompt(base, tokens, 11)], device=device)


def attn_res_depth_rows(base: K3Config, tokens: int, measured: dict[str, dict], threads: int, gpu: str | None) -> dict:
    """The depth result from per-mode measurements ``measured[mode] = {saved: bytes, first: s, times: [s...],
    peak: bytes (GPU)}`` taken on ``base`` at ``tokens`` (on GPU ``gpu``, by name, under bf16 autocast; else
    CPU fp32), with the analytic costs and the ratios to mode ``none``."""
    from k3.audit.accounting import report
    from k3.audit.attnres import attn_res_costs

    rep = report(base.replace(**{"attn_res.mode": "none"}), context=tokens)
    costs = attn_res_costs(base, stages=(), act_bytes=2 if gpu else 4)
    rows = []
    for mode, m in measured.items():
        c = costs[mode]
        rows.append(
            {
                "mode": mode,
                "saved_bytes": m["saved"],
                "saved_bytes_per_token": m["saved"] / tokens,
                "stacked_bytes_per_token": c["stacked_bytes_per_token"],
                "live_bytes_per_token": c["live_bytes_per_token"],
                "mix_flops_per_token": c["flops_per_token"],
                "mix_flops_share": c["flops_per_token"] / rep["flops_per_token_forward"],
                "first_pass_s": m["first"],
                "ms": 1e3 * min(m["times"]),
                "ms_median": 1e3 * statistics.median(m["times"]),
                **({"peak_bytes": m["peak"]} if gpu else {}),
            }
        )
    none = next((r for r in rows if r["mode"] == "none"), None)
    for r in rows:
        if none:
            r["saved_vs_none"] = r["saved_bytes"] / none["saved_bytes"]
            r["ms_vs_none"] = r["ms"] / none["ms"]
            if gpu:
                r["peak_vs_none"] = r["peak_bytes"] / none["peak_bytes"]
    return {
        "config": base.name,
        "layers": base.num_hidden_layers,
        "hidden_size": base.hidden_size,
        "block_size": base.attn_res.block_size,
        "params_total": rep["params_total"],
        "forward_flops_per_token": rep["flops_per_token_forward"],
        "tokens": tokens,
        "threads": threads,
        "repeats": len(next(iter(measured.values()))["times"]),
        "device": gpu or "CPU",
        "dtype": "bf16 autocast" if gpu else "float32",
        "rows": rows,
    }
