"""Audit question 6 (analytic part): KV + state bytes per sequence against context for the hybrid model and its
two attention-only twins, the crossovers, the decode bytes a step must move, and the measured GPU decode rows:
``benchmarks/results/decode-targets.json`` (the current target cases) first, ``decode.json`` (an older full grid)
only for cases the first lacks; every row keeps the name of its file.

Twins (same d, same MLA dims, every layer attention):
- full-MLA: every layer MLA, caching one latent row (kv_lora_rank + qk_rope_head_dim, bf16) per token;
- full-MHA: every layer standard multi-head attention with the MLA head count and dims, caching
  H (qk_head_dim + v_head_dim) values per token (bf16): K is H x (qk_nope + qk_rope), V is H x v_head_dim.
The hybrid's KDA layers hold a constant fp32 recurrent state and bf16 conv states per sequence
(``k3.model.cache.cache_bytes_per_sequence``).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from k3.audit.paths import distinct_experts
from k3.audit.recipe import kda_state_bytes, mla_bytes_per_token
from k3.audit.results import RESULTS, read_results
from k3.config import K3Config
from k3.model.cache import cache_bytes_per_sequence
from k3.ops.mx import MXFP4_BYTES_PER_WEIGHT

DEFAULT_CONTEXTS = (4096, 32768, 131072, 1048576)
DECODE_FILES = (RESULTS / "decode-targets.json", RESULTS / "decode.json")  # current first, then the fallback
SERVE_LOAD_FILE = RESULTS / "serve-load.json"  # benchmarks/serve_load.py: TTFT / TPOT vs concurrency, prefix cache
SLICE_FILE = RESULTS / "slice.json"  # k3 bench slice: K3's widths, packed MXFP4 experts, one GPU
PREFILL_FILE = RESULTS / "model.json"  # k3 bench model, case prefill: one-GPU prefill at 128K / 1M tokens
PREFILL_MODEL = "small-1b"  # what k3.bench.model.prefill_rows builds when a row does not name its model


def full_mla_twin(config: K3Config) -> K3Config:
    return config.replace(mla_layers=list(range(config.num_hidden_layers)), name=f"{config.name}-full-mla")


def mha_bytes_per_token_per_layer(config: K3Config, kv_bytes: int = 2) -> int:
    m = config.mla
    return m.num_heads * (m.qk_head_dim + m.v_head_dim) * kv_bytes


def cache_curves(config: K3Config, contexts) -> dict[str, list[float]]:
    """Bytes per sequence at each context: hybrid, full-MLA twin, full-MHA twin."""
    twin = full_mla_twin(config)
    mha = mha_bytes_per_token_per_layer(config) * config.num_hidden_layers
    return {
        "context": [int(c) for c in contexts],
        "hybrid": [cache_bytes_per_sequence(config, c)["total_bytes"] for c in contexts],
        "full_mla": [cache_bytes_per_sequence(twin, c)["total_bytes"] for c in contexts],
        "full_mha": [mha * c for c in contexts],
    }


def crossovers(config: K3Config) -> dict:
    """Contexts (tokens) where: one KDA layer's fp32 state (without / with conv state) equals one MLA layer's
    latent cache; the hybrid's total equals the full-MLA and the full-MHA twins' (above it the hybrid is
    smaller); and, for decode traffic, where a KDA layer's state read + write equals an MLA layer's latent read."""
    kda = kda_state_bytes(config)
    tok = mla_bytes_per_token(config)
    n_kda, n_mla, n = len(config.kda_layers), len(config.mla_layers), config.num_hidden_layers
    const = n_kda * kda["total"]
    mha_tok = mha_bytes_per_token_per_layer(config)
    out = {
        "kda_state_per_layer": kda["state"],
        "kda_conv_per_layer": kda["conv"],
        "mla_bytes_per_token": tok,
        "layer_state_vs_latent": kda["state"] / tok,
        "layer_state_conv_vs_latent": kda["total"] / tok,
        "decode_traffic_layer": 2 * kda["state"] / tok,
    }
    # hybrid(c) = const + n_mla tok c; full-MLA(c) = n tok c; full-MHA(c) = n mha_tok c
    out["hybrid_vs_full_mla"] = const / ((n - n_mla) * tok) if n > n_mla and n_kda else math.inf
    out["hybrid_vs_full_mha"] = const / (n * mha_tok - n_mla * tok) if n * mha_tok > n_mla * tok else math.inf
    return out


def decode_step_bytes(config: K3Config, rep: dict, batch: int, context: int, weight_bytes: int = 2) -> dict:
    """The lower bound (docs/architecture.md#accounting) on what one decode step moves: dense weights (all but the
    routed experts and the
    embedding table) + the distinct experts hit + per sequence KDA state read and write, conv state and the
    MLA latents of the whole context, + the B embedding rows. ``*_mxfp4``: the same with the routed experts
    packed in MXFP4 (4.25 bits a weight), as released."""
    counts = rep["params_by_path"]
    moe = config.moe
    dense = (sum(counts.values()) - counts["routed_experts"] - counts["embedding"] - counts["vision"]) * weight_bytes
    n_moe = len(config.moe_layers)
    hit = distinct_experts(moe.num_experts, moe.num_experts_per_token, batch) if n_moe else 0.0
    experts = counts["routed_experts"] / moe.num_experts * hit * weight_bytes
    experts_mxfp4 = experts / weight_bytes * MXFP4_BYTES_PER_WEIGHT
    c = cache_bytes_per_sequence(config, context)
    per_seq = 2 * c["kda_state_bytes"] + c["conv_state_bytes"] + c["mla_cache_bytes"]
    total = dense + experts + batch * per_seq + batch * config.hidden_size * weight_bytes
    return {
        "batch": batch,
        "context": context,
        "dense_weights": dense,
        "experts": experts,
        "states": batch * per_seq,
        "total": total,
        "per_token": total / batch,
        "experts_mxfp4": experts_mxfp4,
        "total_mxfp4": total - experts + experts_mxfp4,
    }


def _family(model: str) -> str:
    """The model a decode row measures, whatever way it ran (graph, eager, compiled): the key rows merge on."""
    for family in ("hybrid", "full-MLA twin", "transformers"):
        if model.startswith(family):
            return family
    return model


def _mode(row: dict) -> str:
    """How a decode row ran: its ``mode`` field, or (older files) the suffix ``k3 bench decode`` gives its name."""
    name = row.get("model", "")
    return row.get("mode") or ("eager" if "eager" in name else "compiled" if "compiled" in name else "graph")


def bench_model_label(meta: dict) -> dict:
    """What model the decode rows measure: the file's own record when its meta names a config, otherwise the config
    ``k3 bench decode`` builds (``k3.config.presets.kimi_linear_1p3b``), named and counted from the code."""
    for key in ("config", "preset", "model"):
        if meta.get(key):
            return {"name": str(meta[key]), "from": f"the file's meta ({key})"}
    return dict(_bench_decode_config())


@functools.cache
def _bench_decode_config() -> tuple:
    from k3.audit.accounting import report
    from k3.config.presets import kimi_linear_1p3b

    cfg = kimi_linear_1p3b()
    rep = report(cfg)
    return tuple(
        {
            "name": cfg.name,
            "from": "not in the file; the config `k3 bench decode` builds (k3.config.presets.kimi_linear_1p3b)",
            "params_total": rep["params_total"],
            "params_activated": rep["params_activated"],
            "layers": cfg.num_hidden_layers,
            "mla_layers": len(cfg.mla_layers),
            "hidden_size": cfg.hidden_size,
        }.items()
    )


def measured_decode(paths: tuple[Path, ...] = DECODE_FILES) -> dict:
    """The GPU decode rows of ``paths``, earlier files first: a later file adds only the (model family, batch,
    context) cases no earlier file has a valid row for. Rows with a non-positive time or rate are invalid (listed,
    never merged). Every file is listed with its meta, or with why it was not read."""
    files, rows, seen = [], [], set()
    for path in paths:
        raw, why = read_results(path)
        if raw is None:
            files.append({"name": path.name, "path": str(path), "read": False, "why": why})
            continue
        meta = raw.get("meta") or {}
        used = 0
        for r in raw.get("rows", []):
            if not isinstance(r, dict) or "model" not in r:
                continue
            timing = [r.get(k) for k in ("tokens_per_s", "ms_per_step")]
            valid = all(isinstance(v, (int, float)) and v > 0 for v in timing)
            key = (_family(r["model"]), r.get("batch"), r.get("context"))
            if valid and key in seen:
                continue  # an earlier (current) file measured this case
            if valid:
                seen.add(key)
            rows.append({**r, "valid": valid, "source": path.name})
            used += 1
        files.append(
            {
                "name": path.name,
                "path": str(path),
                "read": True,
                "rows_used": used,
                "device": meta.get("device", "?"),
                "time": meta.get("time", "?"),
                "backend": meta.get("backend", ""),
                "copy_bandwidth_TBps": meta.get("copy_bandwidth_TBps"),
                "read_bandwidth_TBps": meta.get("read_bandwidth_TBps"),
                "model": bench_model_label(meta),
            }
        )
    # hybrid_speedup is the twin's step time over the hybrid's of the same file and mode: kept only where that
    # hybrid row is shown too, so a superseded row never stands behind a ratio in the report
    shown = {(_family(r["model"]), _mode(r), r["batch"], r["context"], r["source"]) for r in rows if r["valid"]}
    speedups = []
    for r in rows:
        if not (r["valid"] and isinstance(r.get("hybrid_speedup"), (int, float))):
            continue
        if ("hybrid", _mode(r), r["batch"], r["context"], r["source"]) not in shown:
            r["hybrid_speedup_hidden"] = r.pop("hybrid_speedup")
            continue
        speedups.append(
            {
                "batch": r["batch"],
                "context": r["context"],
                "mode": _mode(r),
                "hybrid_speedup": r["hybrid_speedup"],
                "source": r["source"],
            }
        )
    return {"files": files, "rows": rows, "speedups": speedups}


def long_context(config: K3Config, rep: dict, contexts=DEFAULT_CONTEXTS) -> dict:
    grid = [int(round(2 ** (10 + i / 4))) for i in range(0, 41)]  # 1K .. 1M, 4 points per octave
    decode = [decode_step_bytes(config, rep, b, c) for c in contexts for b in (1, 16, 64)]
    label = "hybrid" if config.kda_layers and config.mla_layers else "this config"
    return {
        "label": label,
        "contexts": list(contexts),
        "table": cache_curves(config, contexts),
        "curve": cache_curves(config, grid),
        "crossovers": crossovers(config) if config.kda_layers and config.mla_layers else None,
        "decode_bytes": decode,
        "measured_gpu": measured_decode(DECODE_FILES),  # read at call time: tests point it elsewhere
        "serving_load": measured_serving(SERVE_LOAD_FILE),
        "slice": measured_slice(SLICE_FILE),
        "prefill": measured_prefill(PREFILL_FILE),
    }


def measured_prefill(path: Path = PREFILL_FILE) -> dict:
    """One-GPU prefill of long prompts (``k3 bench model``, case prefill): per length, the hybrid's and its
    full-MLA twin's time, throughput and peak memory, and the twin's time over the hybrid's; or why there are
    none. Rows name their model (older files: the ``small-1b`` that k3.bench.model builds)."""
    raw, why = read_results(path)
    if raw is None:
        return {"name": path.name, "read": False, "why": why, "rows": []}
    by: dict[int, dict] = {}
    for r in raw.get("rows", []):
        words = str(r.get("case", "")).split() if isinstance(r, dict) else []
        if len(words) != 3 or words[0] != "prefill" or not words[2].isdigit():
            continue
        row = by.setdefault(int(words[2]), {"tokens": int(words[2]), "model": PREFILL_MODEL})
        arm = "hybrid" if words[1] == "hybrid" else "twin"
        if arm == "hybrid" and r.get("model"):
            row["model"] = r["model"]
        if isinstance(r.get("ms"), (int, float)) and r["ms"] > 0:
            row[f"{arm}_s"] = r["ms"] / 1e3
            row[f"{arm}_peak_GiB"] = r.get("peak_GiB")
        else:
            row[f"{arm}_error"] = r.get("error") or "no time"
    rows = [by[t] for t in sorted(by)]
    for row in rows:
        if "hybrid_s" in row and "twin_s" in row:
            row["twin_over_hybrid"] = row["twin_s"] / row["hybrid_s"]
    if not rows:
        return {"name": path.name, "read": False, "why": "no prefill rows", "rows": []}
    meta = raw.get("meta") or {}
    return {"name": path.name, "read": True, "rows": rows, "device": meta.get("device"), "time": meta.get("time")}


def measured_serving(path: Path = SERVE_LOAD_FILE) -> dict:
    """The serving-under-load results (benchmarks/serve_load.py) with their environment, or why there are none."""
    raw, why = read_results(path)
    if raw is None:
        return {"name": path.name, "read": False, "why": why, "rows": []}
    meta = raw.get("meta") or {}
    keep = ("device", "time", "checkpoint", "server_args")
    return {"name": path.name, "read": True, "rows": raw["rows"], **{k: meta.get(k) for k in keep}}


def measured_slice(path: Path = SLICE_FILE) -> dict:
    """K3's true-width slice (``k3 bench slice``): its decode rows with a valid time, its environment, the packed
    expert bytes, and the extrapolation to 93 layers the benchmark states (an estimate); or why there are none."""
    raw, why = read_results(path)
    if raw is None:
        return {"name": path.name, "read": False, "why": why, "rows": []}
    meta = raw.get("meta") or {}
    rows = [
        r
        for r in raw.get("rows", [])
        if isinstance(r, dict) and r.get("phase") == "decode" and isinstance(r.get("ms"), (int, float)) and r["ms"] > 0
    ]
    keep = ("device", "time", "config", "copy_bandwidth_TBps", "routed_expert_GB", "routed_expert_bytes_per_weight")
    return {
        "name": path.name,
        "read": True,
        "rows": rows,
        "extrapolation": meta.get("extrapolation") or [],
        **{k: meta.get(k) for k in keep},
    }
