"""Audit question 1: the block recipe, one row per decoder layer.

Widths come from the config; parameters per layer from the meta-device module tree (``model.layers.{i}.``);
state bytes from the cache layout of ``k3.model.cache`` (KDA: recurrent state in fp32 + three conv states in
bf16 per sequence; MLA: one latent row of kv_lora_rank + qk_rope_head_dim values in bf16 per token).
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from k3.model.accounting import classify
from k3.config import K3Config


def kda_state_bytes(config: K3Config, state_bytes: int = 4, conv_bytes: int = 2) -> dict[str, int]:
    """Per KDA layer and sequence: recurrent state H dk dv (fp32) and conv state H (2 dk + dv) (W - 1)."""
    k = config.kda
    state = k.num_heads * k.head_dim * k.v_head_dim * state_bytes
    conv = k.num_heads * (2 * k.head_dim + k.v_head_dim) * (k.conv_kernel_size - 1) * conv_bytes
    return {"state": state, "conv": conv, "total": state + conv}


def mla_bytes_per_token(config: K3Config, kv_bytes: int = 2) -> int:
    """Per MLA layer and token: the latent row c_kv (kv_lora_rank) + k_pe (qk_rope_head_dim)."""
    return (config.mla.kv_lora_rank + config.mla.qk_rope_head_dim) * kv_bytes


def layer_params(config: K3Config, model: nn.Module) -> list[dict[str, float]]:
    """Per layer: parameters of the mixer, the FFN and in total, and the activated total (routed x k / E)."""
    frac = config.moe.num_experts_per_token / config.moe.num_experts
    rows: list[dict[str, float]] = [defaultdict(float) for _ in range(config.num_hidden_layers)]
    for name, p in model.named_parameters():
        if not name.startswith("model.layers."):
            continue
        i = int(name.split(".")[2])
        path = classify(name, config)
        n = p.numel()
        part = (
            "mixer"
            if path in ("kda", "mla")
            else "ffn"
            if path in ("dense_ffn", "shared_experts", "routed_experts", "latent_proj", "router")
            else "other"
        )
        rows[i][part] += n
        rows[i]["total"] += n
        rows[i]["activated"] += n * frac if path == "routed_experts" else n
    return [dict(r) for r in rows]


def _compress(seq: list[str]) -> list[str]:
    """Greedy run-length form of a layer sequence: the repeated pattern covering most layers, then recurse on
    what precedes and follows it."""
    best = (0, 1, 0)  # (covered layers, period, start)
    for period in range(1, min(8, len(seq) // 2) + 1):
        for start in range(0, len(seq) - 2 * period + 1):
            pattern = seq[start : start + period]
            reps = 1
            while seq[start + reps * period : start + (reps + 1) * period] == pattern:
                reps += 1
            if reps >= 2 and reps * period > best[0]:
                best = (reps * period, period, start)
    covered, period, start = best
    if covered == 0:
        return list(seq)
    middle = f"{covered // period} x [{', '.join(seq[start : start + period])}]"
    return _compress(seq[:start]) + [middle] + _compress(seq[start + covered :])


def schedule_summary(config: K3Config) -> str:
    """The mixer schedule in compact form, e.g. ``23 x [KDA, KDA, KDA, MLA] + MLA``."""
    return " + ".join(_compress([config.mixer(i).upper() for i in range(config.num_hidden_layers)]))


def recipe(config: K3Config, model: nn.Module) -> dict:
    """Everything section 1 reports: a row per layer and the shared widths."""
    kda, mla, moe = config.kda, config.mla, config.moe
    d = config.hidden_size
    params = layer_params(config, model)
    kda_bytes = kda_state_bytes(config)
    mla_tok = mla_bytes_per_token(config)
    rows = []
    for i in range(config.num_hidden_layers):
        mixer, ffn = config.mixer(i), config.ffn(i)
        if mixer == "kda":
            mixer_width = f"{kda.num_heads} x {kda.head_dim}/{kda.v_head_dim}"
            state = {"kda_state_bytes_per_seq": kda_bytes["total"], "mla_bytes_per_token": 0}
        else:
            q = "none" if mla.q_lora_rank is None else mla.q_lora_rank
            mixer_width = (
                f"{mla.num_heads} h, q {q}, kv {mla.kv_lora_rank}, "
                f"{mla.qk_nope_head_dim}+{mla.qk_rope_head_dim}/{mla.v_head_dim}"
            )
            state = {"kda_state_bytes_per_seq": 0, "mla_bytes_per_token": mla_tok}
        if ffn == "dense":
            ffn_width, latent, ratio = f"dense {config.intermediate_size}", None, None
        else:
            latent = moe.latent_size
            ratio = None if latent is None else d / latent
            ffn_width = (
                f"{moe.num_experts} x {moe.moe_intermediate_size} top-{moe.num_experts_per_token}"
                f" + {moe.num_shared_experts} shared"
            )
        rows.append(
            {
                "index": i,
                "mixer": mixer,
                "ffn": ffn,
                "attn_res_block": config.attn_res_block(i),
                "d": d,
                "mixer_width": mixer_width,
                "ffn_width": ffn_width,
                "latent": latent,
                "latent_ratio": ratio,
                **state,
                "params": params[i].get("total", 0.0),
                "params_activated": params[i].get("activated", 0.0),
                "params_mixer": params[i].get("mixer", 0.0),
                "params_ffn": params[i].get("ffn", 0.0),
            }
        )
    blocks = sorted({r["attn_res_block"] for r in rows if r["attn_res_block"] is not None})
    block_spans = [[r["index"] for r in rows if r["attn_res_block"] == b] for b in blocks]
    return {
        "schedule": schedule_summary(config),
        "n_kda": len(config.kda_layers),
        "n_mla": len(config.mla_layers),
        "dense_layers": [i for i in range(config.num_hidden_layers) if config.ffn(i) == "dense"],
        "attn_res_mode": config.attn_res.mode,
        "attn_res_blocks": [(s[0], s[-1]) for s in block_spans],
        "kda_state_bytes_per_layer": kda_bytes,
        "mla_bytes_per_token_per_layer": mla_tok,
        "layers": rows,
    }
