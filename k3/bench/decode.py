"""Decode throughput of the hybrid cache vs the physical limit, vs transformers' generate, vs a full-MLA twin.

Model: a Kimi-Linear-shaped 1.3B model (the shapes of ../shared/peers/hf_kimi_linear_peer.py), random bf16
weights. Each case fills the cache of B sequences to the context with random latents and states (decode speed
does not depend on their values), then times greedy decode steps (one token per sequence per step, absorbed
MLA over the latent cache, fla's fused recurrent KDA, grouped-GEMM experts), replayed from a CUDA graph
(k3.infer.graphs); two cases also run eagerly to show what the graph saves. The transformers peer's decode
time is generate(1 + n new tokens) - generate(1 new token), divided by n (prefill cancels).
Limit per step = bytes that must move / measured copy bandwidth: dense weights + the experts hit (expected
distinct experts E (1 - (1 - k/E)^B) per layer) + lm_head and embedding rows + KDA state read and write +
conv state + every cached latent row. The same bytes over the measured read bandwidth (an fp32 sum, a few percent
higher: benchmarks/results/decode-targets.md) give a tighter limit, reported beside it (``fraction_of_read_limit``).
"""

from __future__ import annotations

import time

import torch

from k3.model.accounting import classify
from k3.bench.common import copy_bandwidth, cuda_time, environment, read_bandwidth, write_results
from k3.config.presets import kimi_linear_1p3b
from k3.infer.graphs import GraphedDecoder
from k3.model.decoder import K3ForCausalLM
from k3.ops import backend, pdl
from k3.ops.kernel_plan import plan


def step_bytes(model: K3ForCausalLM, batch: int, context: int) -> float:
    cfg = model.config
    dense = routed = 0
    for name, p in model.named_parameters():
        path = classify(name, cfg)
        if path == "routed_experts":
            routed += p.numel() * p.element_size()
        elif path != "embedding":
            dense += p.numel() * p.element_size()
    e, k = cfg.moe.num_experts, cfg.moe.num_experts_per_token
    hit = e * (1 - (1 - k / e) ** batch)
    experts = routed * hit / e
    emb = batch * cfg.hidden_size * 2
    kda = cfg.kda
    n_kda = len(cfg.kda_layers)
    state = n_kda * batch * kda.num_heads * kda.head_dim * kda.v_head_dim * 4 * 2
    conv = n_kda * batch * kda.num_heads * (2 * kda.head_dim + kda.v_head_dim) * (kda.conv_kernel_size - 1) * 2 * 2
    latents = len(cfg.mla_layers) * batch * context * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 2
    return dense + experts + emb + state + conv + latents


def fill_cache(model: K3ForCausalLM, batch: int, context: int, steps: int):
    cache = model.new_cache(batch, dtype=torch.bfloat16, capacity=context + steps + 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer in cache.layers:
        if hasattr(layer, "kv"):
            layer.kv[:, :context].normal_(generator=g)
            layer.lengths = [context] * batch
        else:
            layer.recurrent.normal_(generator=g).mul_(0.05)
            for c in layer.conv:
                c.normal_(generator=g)
    cache.seq_lens = [context] * batch
    return cache


MODES = {"graph": "", "eager": " eager (no CUDA graph)", "compiled": " compiled + CUDA graph"}


@torch.no_grad()
def ours(model: K3ForCausalLM, batch: int, context: int, steps: int = 32, mode: str = "graph") -> float:
    """Seconds per greedy decode step: the sync-free decode_step replayed from a CUDA graph ("graph"), run
    eagerly ("eager"), or compiled by torch.compile and then replayed from a CUDA graph ("compiled")."""
    cache = fill_cache(model, batch, context, steps + 8)
    ids = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")
    seq = list(range(batch))
    run_step = (
        (lambda x, s: model.decode(x, cache, s))
        if mode == "eager"
        else GraphedDecoder(model, cache, compile=mode == "compiled")
    )

    def step():
        nonlocal ids
        ids = run_step(ids, seq).argmax(-1)

    return cuda_time(step, warmup=2, iters=steps)


def hf_peer_config():
    """transformers' KimiLinearConfig of :func:`k3.config.presets.kimi_linear_1p3b`'s shapes: the peer that the
    decode and training benchmarks run in the same process."""
    from transformers import KimiLinearConfig

    c = kimi_linear_1p3b()
    return KimiLinearConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        num_experts=64,
        num_experts_per_token=8,
        moe_intermediate_size=512,
        num_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.446,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config={
            "kda_layers": [i for i in range(1, 13) if i % 4],
            "full_attn_layers": [4, 8, 12],
            "num_heads": 16,
            "head_dim": 64,
            "short_conv_kernel_size": 4,
        },
    )


@torch.no_grad()
def transformers_peer(batch: int, context: int, new: int = 16) -> float | None:
    """Seconds per decode step of transformers' KimiLinearForCausalLM.generate (prefill subtracted)."""
    try:
        from transformers import KimiLinearForCausalLM
    except ImportError:
        return None
    c = kimi_linear_1p3b()
    hf = hf_peer_config()
    model = KimiLinearForCausalLM(hf).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(3, c.vocab_size, (batch, context), device="cuda")
    model.generate(ids[:, :64], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up (kernels, autotune)

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)  # noqa: F821
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    generate(1)  # warm-up at the full shapes (fla autotunes per shape)
    one = generate(1)  # prefill + first token
    total = generate(new + 1)
    del model
    torch.cuda.empty_cache()
    return (total - one) / new


EAGER_CASES = {(1, 4096), (64, 32768)}  # also run eagerly (hybrid): what the CUDA graph saves
COMPILED_CASES = {(1, 4096), (64, 32768), (16, 131072)}  # also compiled (both models): the target cases


TARGET_CASES = [(1, 4096), (64, 32768), (16, 131072)]  # the performance targets: B=1 / 4K vs the peer, 80% of the
# bandwidth limit at B=64 / 32K, 3x the full-MLA twin at B=16 / 128K
TARGET_TWIN = {(16, 131072)}  # the full-MLA twin where a target compares against it


def modes(batch: int, context: int, full: bool, targets: bool = False) -> tuple[str, ...]:
    if targets:
        return ("compiled",) if not full or (batch, context) in TARGET_TWIN else ()
    eager = ("eager",) if (batch, context) in EAGER_CASES and not full else ()
    return ("graph",) + eager + (("compiled",) if (batch, context) in COMPILED_CASES else ())


def run(out_dir: str | None = None, quick: bool = False, peer_budget_s: float = 240.0, targets: bool = False) -> None:
    """``quick``: the three target cases in every mode; ``targets``: only their compiled rows, the full-MLA twin at
    B=16 / 128K only and no transformers peer (its figure is in decode-quick.md), about 5 minutes on an H200."""
    backend.set_backend("fast")
    started = time.perf_counter()
    bw, read_bw = copy_bandwidth(), read_bandwidth()
    columns = [
        "model",
        "batch",
        "context",
        "tokens_per_s",
        "ms_per_step",
        "limit_ms",
        "fraction_of_limit",
        "fraction_of_read_limit",
        "x_transformers",
        "hybrid_speedup",
        "error",
    ]
    cuda = torch.device("cuda")
    meta = environment() | {
        "copy_bandwidth_TBps": bw / 1e12,
        "read_bandwidth_TBps": read_bw / 1e12,
        "kernel_plan": [" | ".join(row) for row in plan(cuda)],
        "inductor_pdl": bool(pdl.inductor_options(cuda)),
        "decode_step": "CUDA graphs",
    }
    torch.manual_seed(0)
    cases = [(1, 4096), (16, 4096), (64, 4096), (1, 32768), (16, 32768), (64, 32768), (1, 131072), (16, 131072)]
    if quick or targets:
        cases = TARGET_CASES
    rows, peer = [], {}
    for batch, context in [] if targets else [(1, 4096)] + ([] if quick else [(16, 4096)]):  # the peer first
        if time.perf_counter() - started > peer_budget_s:
            print(f"skipping the transformers peer at B={batch}: time budget spent", flush=True)
            continue
        t = transformers_peer(batch, context, new=8)
        if t is not None:
            peer[(batch, context)] = t
            rows.append(
                {
                    "model": "transformers KimiLinear generate",
                    "batch": batch,
                    "context": context,
                    "tokens_per_s": batch / t,
                    "ms_per_step": t * 1e3,
                }
            )
            print(rows[-1], flush=True)
    for full in (False, True):
        model = K3ForCausalLM(kimi_linear_1p3b(full)).cuda().to(torch.bfloat16).eval()
        for batch, context in cases:
            limit = step_bytes(model, batch, context) / bw
            name = "full-MLA twin" if full else "hybrid 3:1"
            for mode in modes(batch, context, full, targets):
                row = {
                    "model": name + MODES[mode],
                    "mode": mode,
                    "batch": batch,
                    "context": context,
                    "limit_ms": limit * 1e3,
                }
                try:
                    t = ours(model, batch, context, mode=mode)
                    row |= {
                        "tokens_per_s": batch / t,
                        "ms_per_step": t * 1e3,
                        "fraction_of_limit": limit / t,
                        "fraction_of_read_limit": limit * bw / read_bw / t,
                    }
                except Exception as e:  # recorded in the table, never hidden
                    row["error"] = f"{type(e).__name__}: {e}"[:120]
                rows.append(row)
                print(rows[-1], flush=True)
            write_results("decode", rows, columns, meta, out_dir=out_dir)
        del model
        torch.cuda.empty_cache()
    for r in rows:
        key = (r["batch"], r["context"])
        if r["model"].startswith("hybrid") and key in peer and "ms_per_step" in r:
            r["x_transformers"] = peer[key] * 1e3 / r["ms_per_step"]
    hybrid = {
        (r["mode"], r["batch"], r["context"]): r["ms_per_step"]
        for r in rows
        if r["model"].startswith("hybrid") and "ms_per_step" in r
    }
    for r in rows:  # the full-MLA twin's step time over the hybrid's, both run the same way
        key = (r.get("mode"), r["batch"], r["context"])
        if r["model"].startswith("full-MLA") and "ms_per_step" in r and key in hybrid:
            r["hybrid_speedup"] = r["ms_per_step"] / hybrid[key]
    write_results("decode", rows, columns, meta, out_dir=out_dir)
