"""``k3 audit``: answer the auditability questions 1, 2, 5 (analytic), 6 and 7 for one config.

Writes ``report.md``, ``audit.json`` (every number in the report) and the PNG figures into one directory.
Everything but ``measure=True`` runs on the meta device: no weights are allocated, so the 2.78T-parameter
``k3`` preset audits in seconds on a CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from k3.audit import attnres, plots
from k3.audit.accounting import report
from k3.model.accounting import build_meta
from k3.audit.attnres import attn_res_costs, measured_attn_res, measured_depth_gpu
from k3.audit.format import human, human_bytes, md_table, pct, tokens
from k3.audit.longctx import DEFAULT_CONTEXTS, long_context
from k3.audit.paths import by_path, default_batches, expert_stream, is_k3_shaped, spec_check
from k3.audit.recipe import recipe
from k3.audit.report_attnres import _attn_res, _attn_res_depth  # noqa: F401 (re-exported)
from k3.audit.report_serving import _long, _measured_decode, _router, padding_sentence  # noqa: F401 (re-exported)
from k3.audit.router import router_frontier
from k3.config import K3Config

FIGURES = ("recipe.png", "params.png", "experts_per_step.png", "router.png", "long_context.png", "attn_res.png")


def run_audit(
    config: K3Config,
    out_dir: str | Path,
    *,
    source: str,
    command: str = "",
    context: int = 4096,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    measure: bool = False,
    zipf: tuple[float, ...] = (0.5, 1.0),
) -> dict:
    """Compute every section, draw the figures, write report.md and audit.json; returns the audit dict."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_meta(config)
    rep = report(config, context=context, model=model)
    rec = recipe(config, model)
    del model
    paths = by_path(config, rep, context)
    k3_shaped = is_k3_shaped(config)
    check = spec_check(rep, rec["layers"]) if k3_shaped else None
    has_moe = bool(config.moe_layers)
    stream = expert_stream(config, rep, default_batches()) if has_moe else None
    routed = has_moe and config.moe.num_experts_per_token < config.moe.num_experts
    frontier = router_frontier(config, zipf=zipf) if routed else None
    lc = long_context(config, rep, contexts)
    costs = attn_res_costs(config)
    timings = {"analytic_s": time.perf_counter() - t0}

    cpu = None
    if measure:
        from k3.audit import measure as m

        t1 = time.perf_counter()
        cfg, label = m.measured_config(config, rep["params_total"])
        cpu = {
            "config": label,
            "config_name": cfg.name,
            "environment": m.environment(),
            **m.serving(cfg),
            "attn_res": m.attn_res_latency(cfg),
            "attn_res_depth": m.attn_res_depth(config),
        }
        timings["measure_s"] = time.perf_counter() - t1

    name = config.name
    audit = {
        "preset": name,
        "source": source,
        "command": command,
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "timings": timings,
        "context": context,
        "config": config.to_dict(),
        "params_total": rep["params_total"],
        "params_activated": rep["params_activated"],
        "params_activated_with_embedding": rep["params_activated_with_embedding"],
        "recipe": rec,
        "paths": paths,
        "activated_share": None,
        "spec_check": check,
        "expert_stream": stream,
        "router": frontier,
        "long_context": lc,
        "attn_res": costs,
        "attn_res_gpu": measured_attn_res(attnres.GPU_FILES),
        "attn_res_depth_gpu": measured_depth_gpu(attnres.DEPTH_FILE, name),
        "measured_cpu": cpu,
        "figures": [],
    }
    audit["figures"] = draw_figures(audit, out)
    timings["total_s"] = time.perf_counter() - t0
    audit["activated_share"] = activated_share(audit, config)
    (out / "report.md").write_text(render(audit, config))
    (out / "audit.json").write_text(json.dumps(audit, indent=1))
    return audit


def draw_figures(a: dict, out: Path) -> list[str]:
    """Draw every figure of audit ``a`` (what :func:`run_audit` computed, or its ``audit.json`` read back) into
    ``out``; returns the figures drawn. Everything drawn comes from ``a``, so redrawing from a committed
    ``audit.json`` reproduces the figures without measuring again."""
    name, cpu = a["preset"], a.get("measured_cpu")
    plots.recipe_strip(a["recipe"], f"{name}: {a['recipe']['schedule']}", out / "recipe.png")
    plots.params_by_path(a["paths"], f"{name}: parameters, weight reads and FLOPs by path", out / "params.png")
    if a.get("expert_stream"):
        moe = a["config"]["moe"]
        plots.experts_per_step(
            a["expert_stream"],
            moe["num_experts"],
            moe["num_experts_per_token"],
            f"{name}: experts streamed per decode step (uniform routing)",
            out / "experts_per_step.png",
        )
    if a.get("router"):
        f = a["router"]
        plots.router(f, f"{name}: router frontier (E={f['num_experts']}, k={f['k']})", out / "router.png")
    plots.long_context(a["long_context"], name, out / "long_context.png", cpu)
    plots.attn_res(
        a["attn_res"],
        f"{name}: Attention Residuals overhead per token",
        out / "attn_res.png",
        cpu["attn_res"] if cpu else None,
        cpu["attn_res_depth"] if cpu else None,
        a.get("attn_res_gpu"),
        a.get("attn_res_depth_gpu"),
        attnres.GPU_CONFIG,
    )
    return [f for f in FIGURES if (out / f).is_file()]


def redraw_figures(out_dir: str | Path) -> list[str]:
    """Redraw the figures of the audit in ``out_dir`` from its ``audit.json``: report.md, audit.json and the
    measurements stay as they are (``k3 audit --figures-only``)."""
    out = Path(out_dir)
    path = out / "audit.json"
    if not path.is_file():
        raise FileNotFoundError(f"{out}: no audit.json to redraw the figures from")
    try:
        a = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    missing = [k for k in ("preset", "recipe", "paths", "long_context", "attn_res") if k not in a]
    if missing:
        raise ValueError(f"{path}: not a k3 audit (missing {', '.join(missing)})")
    return draw_figures(a, out)


# ------------------------------------------------------------------------------------------------ markdown
def render(a: dict, config: K3Config) -> str:
    lines = [f"# Audit of `{a['preset']}`", ""]
    lines += [
        f"Source: {a['source']}. Generated {a['generated']}"
        + (f" by `{a['command']}`" if a["command"] else "")
        + f" in {a['timings']['total_s']:.1f} s on this CPU (module tree on the meta device, no weights"
        + (f"; {a['timings']['measure_s']:.1f} s of it CPU measurements" if "measure_s" in a["timings"] else "")
        + ").",
        "",
    ]
    lines += [
        f"**{human(a['params_total'])} parameters in total, {human(a['params_activated'])} activated per token** "
        f"(input embedding excluded; {human(a['params_activated_with_embedding'])} with it).",
        "",
    ]
    lines += [
        "Questions 3 (ablations) and 4 (scaling) of the audit are answered by `k3 ablate` and `k3 scaling`; "
        "this report covers 1, 2, 5 (analytic part), 6 and 7. Every number is also in `audit.json`.",
        "",
    ]
    lines += _recipe(a, config) + _paths(a, config) + _router(a) + _long(a, config) + _attn_res(a)
    return "\n".join(lines) + "\n"


def _recipe(a: dict, config: K3Config) -> list[str]:
    r = a["recipe"]
    kda, mla, moe = config.kda, config.mla, config.moe
    k = r["kda_state_bytes_per_layer"]
    blocks = ", ".join(f"{s}-{e}" for s, e in r["attn_res_blocks"]) or "none"
    dense = r["dense_layers"]
    ffn = (
        (
            "dense FFN (width "
            + str(config.intermediate_size)
            + ") at layer"
            + ("s " if len(dense) > 1 else " ")
            + ", ".join(map(str, dense))
            + ", MoE elsewhere"
        )
        if dense
        else "MoE in every layer"
    )
    latent = (
        f"latent width l = {moe.latent_size} (d/l = {config.hidden_size / moe.latent_size:g})"
        if moe.latent_size
        else "no latent projection (experts at full width d)"
    )
    out = [
        "## 1. Block recipe",
        "",
        f"- Mixers: {r['schedule']} ({r['n_kda']} KDA, {r['n_mla']} MLA); {ffn}.",
        f"- AttnRes `{r['attn_res_mode']}`"
        + (
            f", blocks of {config.attn_res.block_size} layers: {blocks}."
            if r["attn_res_mode"] != "none"
            else " (plain residual stream)."
        ),
        f"- d = {config.hidden_size}. KDA: {kda.num_heads} heads x d_k {kda.head_dim} / d_v {kda.v_head_dim}, "
        f"conv {kda.conv_kernel_size}; state per layer per sequence {human_bytes(k['state'])} fp32 + conv "
        f"{human_bytes(k['conv'])} bf16.",
        f"- MLA: {mla.num_heads} heads, q_lora {mla.q_lora_rank}, kv_lora {mla.kv_lora_rank}, qk "
        f"{mla.qk_nope_head_dim}+{mla.qk_rope_head_dim}, v {mla.v_head_dim}; latent cache "
        f"{r['mla_bytes_per_token_per_layer']} B per token per layer (bf16).",
        f"- MoE: {moe.num_experts} experts top-{moe.num_experts_per_token} + {moe.num_shared_experts} shared, "
        f"expert width {moe.moe_intermediate_size}, {latent}.",
        "",
        "![block recipe](recipe.png)",
        "",
    ]
    rows = []
    for x in r["layers"]:
        state = (
            human_bytes(x["kda_state_bytes_per_seq"]) + " / seq"
            if x["mixer"] == "kda"
            else f"{x['mla_bytes_per_token']} B / token"
        )
        block = "-" if x["attn_res_block"] is None else x["attn_res_block"]
        rows.append(
            [
                x["index"],
                x["mixer"].upper(),
                x["ffn"],
                block,
                x["mixer_width"],
                x["ffn_width"],
                "-" if x["latent"] is None else f"{x['latent']} ({x['latent_ratio']:g})",
                state,
                human(x["params"]),
                human(x["params_activated"]),
            ]
        )
    out += [
        md_table(
            [
                "layer",
                "mixer",
                "FFN",
                "AttnRes block",
                "mixer widths",
                "FFN widths",
                "latent l (d/l)",
                "state",
                "params",
                "activated",
            ],
            rows,
            "rllrllrrrr",
        ),
        "",
    ]
    return out


def _paths(a: dict, config: K3Config) -> list[str]:
    p = a["paths"]
    out = [
        "## 2. Total vs routed vs activated",
        "",
        "Per token at batch 1: weights read in bf16 (the input embedding: one row), forward FLOPs = 2 per "
        f"activated matmul weight + attention work at context {tokens(p['context'])} (MLA scores/values averaged "
        "over the sequence, KDA state update) + AttnRes depth mixes; norms not counted.",
        "",
    ]
    rows = []
    for path, r in p["rows"].items():
        rows.append(
            [
                path,
                human(r["total"]),
                human(r["activated"]),
                human_bytes(r["weight_bytes"]),
                human(r["flops"]),
                pct(r["flops"] / p["total"]["flops"], 1),
            ]
        )
    t = p["total"]
    rows.append(
        [
            "**total**",
            f"**{human(t['total'])}**",
            f"**{human(t['activated'])}** (excl. input embedding)",
            human_bytes(t["weight_bytes"]),
            human(t["flops"]),
            "100%",
        ]
    )
    out += [
        md_table(
            ["path", "total", "activated / token", "weights read / token", "forward FLOPs / token", "FLOP share"], rows
        ),
        "",
        "![parameters by path](params.png)",
        "",
    ]
    if a.get("activated_share"):
        out += [activated_share_text(a["activated_share"]), ""]
    if a["spec_check"]:
        ok = all(c["ok"] for c in a["spec_check"])
        out += [
            "### Check against K3's published figures (docs/architecture.md#accounting)",
            "",
            ("All figures within tolerance." if ok else "**Some figures are outside tolerance.**")
            + " Tolerance: the larger of 0.5% and the rounding of the quoted figure.",
            "",
        ]
        rows = [
            [
                c["figure"],
                c["quoted"],
                _like(c["ours"], c["quoted"]),
                f"{100 * c['rel_err']:+.3f}%",
                pct(c["tolerance"], 1),
                "ok" if c["ok"] else "**NO**",
            ]
            for c in a["spec_check"]
        ]
        out += [md_table(["figure", "spec", "ours", "rel. error", "tolerance", ""], rows), ""]
    else:
        out += [
            "K3's published figures describe the `k3` preset; this config has another shape, so they are not "
            "checked here.",
            "",
        ]
    s = a["expert_stream"]
    if s:
        moe = config.moe
        out += [
            "### Experts streamed per decode step",
            "",
            f"Distinct experts one MoE layer reads for a decode step of B tokens under uniform routing: "
            f"E (1 - (1 - k/E)^B) with E = {moe.num_experts}, k = {moe.num_experts_per_token}; bytes over all "
            f"{s['moe_layers']} MoE layers ({human(s['params_per_expert'])} weights per expert; all routed "
            f"experts: {human_bytes(s['all_experts_bytes_bf16'])} in bf16). MXFP4 = 4.25 bits per weight.",
            "",
        ]
        rows = [
            [
                r["batch"],
                f"{r['distinct_per_layer']:.1f}",
                pct(r["fraction_of_experts"], 1),
                human_bytes(r["bytes_bf16"]),
                human_bytes(r["bytes_mxfp4"]),
                human_bytes(r["bytes_bf16_per_token"]),
            ]
            for r in s["rows"]
        ]
        out += [
            md_table(
                ["B", "distinct experts / layer", "of all", "expert bytes / step (bf16)", "(MXFP4)", "bf16 per token"],
                rows,
            ),
            "",
            "![experts per step](experts_per_step.png)",
            "",
        ]
    return out


def _like(value: float, quoted: str) -> str:
    """``value`` in the unit of a quoted figure like '2.7227T', with one more decimal."""
    scale = {"T": 1e12, "B": 1e9, "M": 1e6}[quoted[-1]]
    decimals = len(quoted[:-1].split(".")[1]) + 1 if "." in quoted else 1
    return f"{value / scale:.{decimals}f}{quoted[-1]}"


def activated_share(a: dict, config: K3Config) -> dict | None:
    """The activated share of all parameters next to the share of routed-expert slots a token uses (k / E), and
    the always-on paths that separate them; None without routed experts."""
    rows = a["paths"]["rows"]
    moe = config.moe
    routed = rows.get("routed_experts", {})
    if not routed.get("total"):
        return None
    dense = {k: r["activated"] for k, r in rows.items() if k not in ("routed_experts", "embedding") and r["activated"]}
    always = sum(dense.values())
    return {
        "activated": a["params_activated"],
        "total": a["params_total"],
        "activated_share": a["params_activated"] / a["params_total"],
        "k": moe.num_experts_per_token,
        "experts": moe.num_experts,
        "slot_share": moe.num_experts_per_token / moe.num_experts,
        "routed_total": routed["total"],
        "routed_share_of_total": routed["total"] / a["params_total"],
        "routed_activated": routed["activated"],
        "always_on": always,
        "always_on_share_of_activated": always / a["params_activated"],
        "always_on_by_path": dict(sorted(dense.items(), key=lambda kv: -kv[1])),
    }


def activated_share_text(s: dict) -> str:
    """One paragraph: both shares, computed, and why they differ."""
    paths = ", ".join(f"{k} {human(v)}" for k, v in s["always_on_by_path"].items())
    return (
        f"**Activated share:** {human(s['activated'])} of {human(s['total'])} = {pct(s['activated_share'])} of the "
        f"parameters, while {s['k']} / {s['experts']} = {pct(s['slot_share'])} of the routed-expert slots are "
        f"active per token. They differ because only the routed experts ({human(s['routed_total'])}, "
        f"{pct(s['routed_share_of_total'], 1)} of the total) are sparse: every token also runs all the other paths "
        f"({paths}; {human(s['always_on'])} together, {pct(s['always_on_share_of_activated'], 1)} of the activated "
        f"count), the shared experts among them. So the activated share is k / E of the routed experts plus all the "
        f"rest: ({human(s['routed_activated'])} + {human(s['always_on'])}) / {human(s['total'])}."
    )
