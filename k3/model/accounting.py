"""Counting from the module tree of a (meta-device) model: parameters per path (from their checkpoint names), the
parameters one token activates, and the FLOPs per token beyond the weight matmuls (docs/architecture.md#accounting).
k3.audit.accounting builds the full report on these; the placement planner prices a config with them."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from k3.config import K3Config

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
