"""Audit question 7: what Attention Residuals cost, per token, for none / snapshot / block_sum / full.

The number of depth sources each mix sees is taken from ``k3.model.attn_res.ResidualStream`` itself (driven
with 1-wide dummy vectors), so the counts follow the model's own bookkeeping:
- live vectors: the most d-vectors a token keeps alive for later mixes (none: the residual r only);
- stacked for backward: sum over mixes of S, the [S, d] stacks a stack-then-mix implementation saves for the
  backward pass (the model's two-phase form keeps only the sources and one phase-1 output o per mix);
- FLOPs: 4 S d per mix (logits 2 S d against the folded query, weighted sum 2 S d; each source's rms is
  computed once and reused);
- pipeline bytes: the d-vectors that must cross a pipeline-stage boundary per token (bank + running state).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from k3.audit.results import RESULTS, read_results
from k3.config import ATTN_RES_MODES, K3Config
from k3.model.attn_res import ResidualStream
from k3.model.norm import RMSNorm

MODES = ("none", "snapshot", "block_sum", "full")
GPU_FILES = (RESULTS / "model-attn_res.json", RESULTS / "model-attn_res_compiled.json")
GPU_CONFIG = "small-1b"  # the preset k3/bench/model.py's attn_res_rows measures (GPU_FILES do not name it)
DEPTH_FILE = RESULTS / "attn_res_depth.json"  # benchmarks/attn_res_depth.py: the depth measurement on a GPU
assert set(MODES) == set(ATTN_RES_MODES)


def source_counts(config: K3Config, mode: str | None = None) -> dict:
    """Drive a ResidualStream through the layers: sources per mix and d-vectors live before each layer."""
    mode = mode or config.attn_res.mode
    norm, proj = RMSNorm(1), nn.Linear(1, 1, bias=False)
    one = torch.ones(1, 1)
    mixers = [(norm, proj)] * (2 * config.num_hidden_layers + 1)
    stream = ResidualStream(mode, config.attn_res.block_size, one, mixers)
    mixes: list[tuple[int, str, int]] = []
    crossing: list[int] = []  # d-vectors of state before layer i (what a stage boundary there must carry)
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            crossing.append(len(stream.sources()))
            for sub in ("attn", "mlp"):
                stream.input(i, sub, norm)
                mixes.append((i, sub, len(stream.sources())))
                stream.add(one)
        if mode != "none":
            mixes.append((-1, "output", len(stream.sources())))
    if mode == "none":
        mixes = [(i, s, 1) for i, s, _ in mixes]
    return {"mode": mode, "mixes": mixes, "crossing": crossing}


def stage_boundaries(num_layers: int, stages: int) -> list[int]:
    """First layer of stages 2..P when ``num_layers`` are split as evenly as possible."""
    return sorted({round(j * num_layers / stages) for j in range(1, stages)} - {0, num_layers})


def attn_res_costs(config: K3Config, stages: tuple[int, ...] = (4, 8, 16), act_bytes: int = 2) -> dict:
    """Per mode: live vectors, stacked-for-backward vectors, mix FLOPs per token and pipeline bytes."""
    d = config.hidden_size
    out = {}
    for mode in MODES:
        c = source_counts(config, mode)
        mixing = [s for _, _, s in c["mixes"] if s > 1] if mode != "none" else []
        live = max(max(s for _, _, s in c["mixes"]), max(c["crossing"]))
        pipe = {}
        for p in stages:
            bounds = stage_boundaries(config.num_hidden_layers, p)
            vecs = max((c["crossing"][b] for b in bounds), default=1)
            pipe[p] = {"boundaries": bounds, "max_vectors": vecs, "max_bytes_per_token": vecs * d * act_bytes}
        out[mode] = {
            "mixes": len(mixing),
            "max_sources": max(s for _, _, s in c["mixes"]),
            "mean_sources": sum(mixing) / len(mixing) if mixing else 1.0,
            "live_vectors": live,
            "live_bytes_per_token": live * d * act_bytes,
            "stacked_vectors": sum(mixing),
            "stacked_bytes_per_token": sum(mixing) * d * act_bytes,
            "flops_per_token": 4 * sum(mixing) * d,
            "pipeline": pipe,
            "sources_per_mix": [s for _, _, s in c["mixes"]],
        }
    return out


def mix_flops_per_token(config: K3Config) -> float:
    """Depth-mix FLOPs per token of the config's own AttnRes mode (0 for none)."""
    return float(attn_res_costs(config, stages=())[config.attn_res.mode]["flops_per_token"])


def measured_attn_res(paths: tuple[Path, ...] = GPU_FILES) -> dict:
    """The GPU AttnRes rows of ``k3 bench model --cases attn_res`` (training step, peak memory, CUDA-graph decode
    step) and ``attn_res_compiled`` (the decode step compiled), one row per mode with the file each value came from;
    every file is listed with its meta or why it was not read."""
    files, modes = [], {}
    for path in paths:
        raw, why = read_results(path)
        if raw is None:
            files.append({"name": path.name, "read": False, "why": why})
            continue
        rows = raw.get("rows", [])
        meta = raw.get("meta") or {}
        files.append(
            {"name": path.name, "read": True, "device": meta.get("device", "?"), "time": meta.get("time", "?")}
        )
        compiled = "compiled" in path.stem
        for r in rows:
            words = str(r.get("case", "")).split()
            if len(words) < 2 or words[0] != "AttnRes" or words[1] not in MODES:
                continue
            m = modes.setdefault(words[1], {"mode": words[1]})
            fields = (("decode_ms", "decode_ms_compiled"), ("decode_overhead", "decode_overhead_compiled"))
            if compiled:
                for src, dst in fields:
                    if isinstance(r.get(src), (int, float)):
                        m[dst], m[dst + "_source"] = r[src], path.name
            else:
                for key in ("ms", "peak_GiB", "decode_ms", "train_overhead", "decode_overhead"):
                    if isinstance(r.get(key), (int, float)):
                        m[key], m[key + "_source"] = r[key], path.name
    return {"files": files, "rows": [modes[m] for m in MODES if m in modes]}


def measured_depth_gpu(path: Path = DEPTH_FILE, preset: str | None = None) -> dict:
    """``benchmarks/attn_res_depth.py``'s result (the form :func:`k3.audit.measure.attn_res_depth` returns, plus
    the file's environment) when it measured ``preset`` (any preset when None); else ``{"why": ...}``."""
    raw, why = read_results(path)
    if raw is None:
        return {"why": f"`benchmarks/results/{path.name}` {why}"}
    meta, rows = raw.get("meta") or {}, raw.get("rows", [])
    if preset is not None and meta.get("preset") != preset:
        return {"why": f"`benchmarks/results/{path.name}` measured preset {meta.get('preset')!r}, not {preset!r}"}
    return {**meta, "rows": rows, "file": path.name}
