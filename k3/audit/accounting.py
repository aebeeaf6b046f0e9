"""Parameter, FLOP and byte accounting, counted from the module tree of a (meta-device) model.

Conventions: a multiply-add is 2 FLOPs; "activated" parameters are those a single token touches (all
dense paths plus top-k of the routed experts), the input embedding excluded unless stated; per-token
FLOPs are forward FLOPs of the matmuls plus attention / KDA-state work at a given context (attention
averaged over the positions of a sequence of that length; KDA in its recurrent form, 7 K V per head).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import cache_bytes_per_sequence

PATHS = (
    "embedding",
    "lm_head",
    "kda",
    "mla",
    "dense_ffn",
    "shared_experts",
    "routed_experts",
    "latent_proj",
    "router",
    "attn_res",
    "norms",
    "vision",
)


def classify(name: str, config: K3Config) -> str:
    """Which path a parameter belongs to, from its checkpoint name."""
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if name.startswith("vision"):
        return "vision"
    if "_res_norm." in name or "_res_proj." in name:
        return "attn_res"
    if ".block_sparse_moe.experts." in name:
        return "routed_experts"
    if ".block_sparse_moe.shared_experts." in name:
        return "shared_experts"
    if ".block_sparse_moe.routed_expert_" in name:
        return "latent_proj"
    if ".block_sparse_moe.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_ffn"
    if ".self_attn." in name:
        layer = int(name.split(".")[2])
        return config.mixer(layer)
    if "layernorm" in name or name.startswith("model.norm."):
        return "norms"
    raise ValueError(f"parameter {name!r} has no accounting path")


def build_meta(config: K3Config) -> nn.Module:
    """The model on the meta device: shapes only, no memory."""
    from k3.model.decoder import K3ForCausalLM

    with torch.device("meta"):
        return K3ForCausalLM(config)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters per path (every path present, zeros included)."""
    counts: dict[str, int] = defaultdict(int)
    for name, p in model.named_parameters():
        counts[classify(name, model.config)] += p.numel()
    return {path: counts.get(path, 0) for path in PATHS}


def activated_counts(config: K3Config, counts: dict[str, int]) -> dict[str, float]:
    """Per path, the parameters one token uses: routed experts scaled by top-k / E, the rest whole."""
    frac = config.moe.num_experts_per_token / config.moe.num_experts
    return {path: n * frac if path == "routed_experts" else float(n) for path, n in counts.items()}


def attention_flops_per_token(config: K3Config, context: int, form: str = "forward") -> dict[str, float]:
    """FLOPs per token beyond the weight matmuls at ``context`` tokens (docs/architecture.md#accounting).

    ``form="forward"`` (training and prefill): a token of a ``context``-token sequence sees (context + 1) / 2 keys
    on average, MLA with its keys and values up-projected per head (scores over qk_head_dim, values over
    v_head_dim). ``form="decode"``: one new token over ``context`` cached rows, MLA absorbed as the engine runs it
    (scores over the latent row, kv_lora_rank + qk_rope_head_dim, and values over kv_lora_rank: more per key than
    the forward form, since the latent is wider than a head). The per-head maps the absorbed form applies to the
    query and the output cost what the up-projection costs per token, so the matmul count is the same in both.
    KDA's recurrent state update: 7 H dk dv in both."""
    if form not in ("forward", "decode"):
        raise ValueError(f"form={form!r}: 'forward' or 'decode'")
    mla, kda = config.mla, config.kda
    n_mla = len(config.mla_layers)
    n_kda = config.num_hidden_layers - n_mla
    if form == "forward":
        mla_flops = n_mla * 2 * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) * (context + 1) / 2
    else:
        mla_flops = n_mla * 2 * mla.num_heads * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim) * context
    kda_flops = n_kda * 7 * kda.num_heads * kda.head_dim * kda.v_head_dim
    return {"mla_attention": mla_flops, "kda_state": kda_flops}


def flops_per_token(config: K3Config, context: int = 4096, form: str = "forward", counts: dict | None = None) -> dict:
    """Forward FLOPs per token: the one count ``k3 info``, the audit and the benchmarks' MFU use. 2 per activated
    matmul weight (the input embedding's lookup and the norms excluded), the AttnRes depth mixes, and
    :func:`attention_flops_per_token` in ``form``. ``counts``: :func:`parameter_counts` of the config's model,
    when already made. Returns {"matmul", "attn_res_mix", "mla_attention", "kda_state", "total"}; a training step
    is 3x the forward form."""
    from k3.audit.attnres import mix_flops_per_token  # the depth mixes' own cost model

    counts = parameter_counts(build_meta(config)) if counts is None else counts
    active = activated_counts(config, counts)
    out = {
        "matmul": 2.0 * (sum(active.values()) - active["embedding"] - active["norms"] - active["attn_res"]),
        "attn_res_mix": mix_flops_per_token(config),
        **attention_flops_per_token(config, context, form),
    }
    out["total"] = sum(out.values())
    return out


def report(config: K3Config, context: int = 4096, weight_bytes: int = 2, model: nn.Module | None = None) -> dict:
    """Everything ``k3 info`` prints, as a JSON-able dict (``model``: an already built meta model of ``config``)."""
    model = build_meta(config) if model is None else model
    counts = parameter_counts(model)
    active = activated_counts(config, counts)
    total = sum(counts.values())
    activated = sum(active.values()) - active["embedding"]
    flops = flops_per_token(config, context, counts=counts)
    decode = flops_per_token(config, context, "decode", counts=counts)
    layers = [
        {"index": i, "mixer": config.mixer(i), "ffn": config.ffn(i), "attn_res_block": config.attn_res_block(i)}
        for i in range(config.num_hidden_layers)
    ]
    vision = {}  # the tower is counted apart from the text model's totals (docs/architecture.md#vision, #accounting)
    if config.vision is not None and counts["vision"] == 0:
        from k3.model.vision import vision_param_counts

        vision = vision_param_counts(config)
    return {
        "preset": config.name,
        "params_total": total,
        "params_activated": activated,
        "params_activated_with_embedding": activated + active["embedding"],
        "params_by_path": counts,
        "params_activated_by_path": active,
        "params_routed_experts": counts["routed_experts"],
        "params_shared_experts": counts["shared_experts"],
        "params_dense_path": total - counts["routed_experts"] - counts["embedding"] - counts["vision"],
        "params_vision": counts["vision"] + sum(vision.values()),
        "params_vision_encoder": vision.get("encoder", 0),
        "params_vision_projector": vision.get("projector", 0),
        "context": context,
        "flops_per_token_forward": flops["total"],
        "flops_per_token_breakdown": {k: v for k, v in flops.items() if k != "total"},
        "flops_per_token_decode": decode["total"],
        "flops_per_token_decode_breakdown": {k: v for k, v in decode.items() if k != "total"},
        "weight_bytes_per_token": activated * weight_bytes,
        "weight_bytes_dtype_size": weight_bytes,
        "cache_per_sequence": cache_bytes_per_sequence(config, context),
        "layers": layers,
    }
