"""Audit question 2: total vs routed vs activated parameters, weight reads and FLOPs per token by path, the
check against K3's published figures (docs/architecture.md#accounting), and the experts a decode step streams as the
batch grows.

Per-token weight bytes (batch 1): every activated weight once, except the input embedding, of which only the
token's row is read. Forward FLOPs: 2 per activated matmul weight (embedding lookup 0; norms not counted),
plus the context-dependent attention work (MLA scores and values averaged over a sequence of the context,
KDA's recurrent state update) from ``accounting.attention_flops_per_token`` and the AttnRes depth mixes.
"""

from __future__ import annotations

import math

from k3.model.accounting import PATHS, attention_flops_per_token
from k3.audit.attnres import mix_flops_per_token
from k3.config import K3Config, get_preset
from k3.ops.mx import MXFP4_BYTES_PER_WEIGHT

# K3's published figures (docs/architecture.md#accounting): (label, key, figure).
SPEC_FIGURES = (
    ("total parameters", "total", "2.78T"),
    ("activated per token (input embedding excluded)", "activated", "104.2B"),
    ("routed experts", "routed_experts", "2.7227T"),
    ("routed experts activated (16 of 896)", "routed_activated", "48.6B"),
    ("shared experts", "shared_experts", "12.2B"),
    ("latent down/up projections", "latent_proj", "4.7B"),
    ("routers", "router", "0.6B"),
    ("MLA (24 layers)", "mla", "5.6B"),
    ("MLA per layer", "mla_per_layer", "232.2M"),
    ("KDA (69 layers)", "kda", "30.6B"),
    ("KDA per layer", "kda_per_layer", "443.6M"),
    ("dense FFN (layer 0)", "dense_ffn", "0.73B"),
    ("embedding", "embedding", "1.17B"),
    ("lm_head", "lm_head", "1.17B"),
)
_SCALE = {"T": 1e12, "B": 1e9, "M": 1e6}
SPEC_TOLERANCE = 0.005  # the spec: an accounting tool not within 0.5% of 2.78T / 104.2B is wrong


def is_k3_shaped(config: K3Config) -> bool:
    """True when the text model has the released K3 shape (names, token ids and vision aside)."""
    ignore = (
        "name",
        "vision",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "max_position_embeddings",
    )
    a, b = config.to_dict(), get_preset("k3").to_dict()
    return all(a[k] == b[k] for k in a if k not in ignore)


def by_path(config: K3Config, rep: dict, context: int, weight_bytes: int = 2) -> dict:
    """Rows per path: total, activated, weight bytes read per token and forward FLOPs per token."""
    counts, active = rep["params_by_path"], rep["params_activated_by_path"]
    attn = attention_flops_per_token(config, context)
    mix = mix_flops_per_token(config)
    rows = {}
    for path in PATHS:
        if path == "vision" and counts[path] == 0:
            continue
        read = config.hidden_size if path == "embedding" else active[path]
        if path in ("embedding", "norms"):
            flops = 0.0
        elif path == "attn_res":
            flops = mix
        else:
            flops = 2.0 * active[path]
        ctx = attn["mla_attention"] if path == "mla" else attn["kda_state"] if path == "kda" else 0.0
        rows[path] = {
            "total": counts[path],
            "activated": active[path],
            "weight_bytes": read * weight_bytes,
            "flops_matmul": flops,
            "flops_context": ctx,
            "flops": flops + ctx,
        }
    total = {
        "total": sum(r["total"] for r in rows.values()),
        "activated": rep["params_activated"],  # input embedding excluded, as reported
        "weight_bytes": sum(r["weight_bytes"] for r in rows.values()),
        "flops": sum(r["flops"] for r in rows.values()),
    }
    return {"context": context, "weight_bytes_dtype_size": weight_bytes, "rows": rows, "total": total}


def spec_check(rep: dict, layer_rows: list[dict]) -> list[dict]:
    """Our count next to every published K3 figure (docs/architecture.md#accounting), with the relative error and
    whether it is within tolerance
    (the larger of 0.5% and the rounding of the quoted figure)."""
    counts, active = rep["params_by_path"], rep["params_activated_by_path"]
    mixer = {m: [r["params_mixer"] for r in layer_rows if r["mixer"] == m] for m in ("kda", "mla")}
    ours = {
        "total": rep["params_total"],
        "activated": rep["params_activated"],
        "routed_activated": active["routed_experts"],
        "mla_per_layer": sum(mixer["mla"]) / max(len(mixer["mla"]), 1),
        "kda_per_layer": sum(mixer["kda"]) / max(len(mixer["kda"]), 1),
        **counts,
    }
    out = []
    for label, key, quoted in SPEC_FIGURES:
        number = quoted[:-1]
        value = float(number) * _SCALE[quoted[-1]]
        decimals = len(number.split(".")[1]) if "." in number else 0
        got = float(ours[key])
        rel = got / value - 1
        tol = max(SPEC_TOLERANCE, 0.5 * 10**-decimals / float(number))
        out.append(
            {
                "figure": label,
                "key": key,
                "quoted": quoted,
                "spec": value,
                "ours": got,
                "rel_err": rel,
                "tolerance": tol,
                "ok": abs(rel) <= tol,
            }
        )
    return out


def distinct_experts(num_experts: int, k: int, batch: int) -> float:
    """Expected distinct experts one MoE layer reads for ``batch`` tokens under uniform routing:
    E (1 - (1 - k/E)^B) (each token picks k of E; an expert is missed by a token with probability 1 - k/E)."""
    return num_experts * (1.0 - (1.0 - k / num_experts) ** batch)


def expert_stream(config: K3Config, rep: dict, batches: tuple[int, ...]) -> dict:
    """Distinct experts hit per layer and per decode step, and their bytes (bf16 and MXFP4) streamed per step."""
    moe = config.moe
    n_moe = len(config.moe_layers)
    routed = rep["params_by_path"]["routed_experts"]
    per_expert = routed / (moe.num_experts * n_moe) if n_moe else 0.0
    rows = []
    for b in batches:
        hit = distinct_experts(moe.num_experts, moe.num_experts_per_token, b)
        params = hit * per_expert * n_moe
        rows.append(
            {
                "batch": b,
                "distinct_per_layer": hit,
                "fraction_of_experts": hit / moe.num_experts,
                "bytes_bf16": params * 2,
                "bytes_mxfp4": params * MXFP4_BYTES_PER_WEIGHT,
                "bytes_bf16_per_token": params * 2 / b,
            }
        )
    return {"moe_layers": n_moe, "params_per_expert": per_expert, "rows": rows, "all_experts_bytes_bf16": routed * 2}


def default_batches(limit: int = 1024) -> tuple[int, ...]:
    return tuple(2**i for i in range(int(math.log2(limit)) + 1))
