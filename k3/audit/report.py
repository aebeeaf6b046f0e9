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
from k3.audit.accounting import build_meta, report
from k3.audit.attnres import attn_res_costs, measured_attn_res
from k3.audit.format import human, human_bytes, md_table, pct, tokens
from k3.audit.longctx import DEFAULT_CONTEXTS, long_context
from k3.audit.paths import by_path, default_batches, expert_stream, is_k3_shaped, spec_check
from k3.audit.recipe import recipe
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
    has_moe = any(config.ffn(i) == "moe" for i in range(config.num_hidden_layers))
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
    plots.recipe_strip(rec, f"{name}: {rec['schedule']}", out / "recipe.png")
    plots.params_by_path(paths, f"{name}: parameters, weight reads and FLOPs by path", out / "params.png")
    if stream:
        plots.experts_per_step(
            stream,
            config.moe.num_experts,
            config.moe.num_experts_per_token,
            f"{name}: experts streamed per decode step (uniform routing)",
            out / "experts_per_step.png",
        )
    if frontier:
        plots.router(
            frontier, f"{name}: router frontier (E={frontier['num_experts']}, k={frontier['k']})", out / "router.png"
        )
    plots.long_context(lc, f"{name}: cache bytes per sequence", out / "long_context.png", cpu)
    plots.attn_res(
        costs,
        f"{name}: Attention Residuals overhead per token",
        out / "attn_res.png",
        cpu["attn_res"] if cpu else None,
        cpu["attn_res_depth"] if cpu else None,
    )
    timings["total_s"] = time.perf_counter() - t0

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
        "measured_cpu": cpu,
        "figures": [f for f in FIGURES if (out / f).is_file()],
    }
    audit["activated_share"] = activated_share(audit, config)
    (out / "report.md").write_text(render(audit, config))
    (out / "audit.json").write_text(json.dumps(audit, indent=1))
    return audit


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


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


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


def padding_sentence(rows: list[dict], multiple: int, what: str) -> str:
    """What padding expert groups to ``multiple`` wastes, read off the uniform-routing table ``rows`` (tokens,
    mean_load, padding_<multiple>): the values around the point where the waste falls to half of the rows, and at
    the largest step."""
    key = f"padding_{multiple}"

    def at(r: dict, first: bool = False) -> str:
        load = f"a mean load of {r['mean_load']:.1f} tokens per expert" if first else f"{r['mean_load']:.1f}"
        return f"{pct(r[key], 1)}{' of the rows' if first else ''} at {load} (T = {r['tokens']})"

    over = [r for r in rows if r[key] > 0.5]
    under = [r for r in rows if r[key] <= 0.5]
    if under and over and over[0]["tokens"] < under[0]["tokens"]:
        before = [r for r in over if r["tokens"] < under[0]["tokens"]][-1]
        shown = [before, under[0]] + ([rows[-1]] if rows[-1] is not under[0] else [])
        where = (
            f": more than half of the rows up to a mean load of {before['mean_load']:.1f}, at most half from "
            f"{under[0]['mean_load']:.1f} on"
        )
    else:
        shown = [rows[0], rows[-1]] if len(rows) > 1 else rows
        where = ": " + ("more than half" if not under else "at most half") + " of the rows at every step in the table"
    values = [at(r, i == 0) for i, r in enumerate(shown)]
    listed = ", ".join(values[:-1]) + " and " + values[-1] if len(values) > 1 else values[0]
    return f"Padding each expert's group to a multiple of {multiple} {what} wastes {listed}{where}."


def _router(a: dict) -> list[str]:
    f = a["router"]
    if not f:
        return ["## 5. Router frontier (analytic)", "", "No routed experts in this config.", ""]
    e, k = f["num_experts"], f["k"]
    out = [
        "## 5. Router frontier (analytic)",
        "",
        f"E = {e}, k = {k}. *Tokens per step* = tokens one MoE layer routes in one step over the whole expert-"
        f"parallel group. Capacity C = ceil(cf T k / E) per expert; *overflow* = token-slots above capacity "
        f"(dropped, or moved by a rerouting policy — total capacity cf T k >= T k always has room for them). "
        f"Uniform routing: exact expectations from the Binomial(T, k/E) expert load. Zipf(s): expert j has "
        f"popularity (j+1)^-s and each token takes the top-k of log popularity + Gumbel noise (a skewed router "
        f"without balancing); seeded simulation (seed {f['seed']}).",
        "",
        "### Uniform routing (exact)",
        "",
    ]
    rows = [
        [
            r["tokens"],
            f"{r['mean_load']:.1f}",
            pct(r["overflow_cf1"]),
            pct(r["overflow_cf1.25"]),
            pct(r["padding_8"], 1),
            pct(r["padding_128"], 1),
        ]
        for r in f["uniform_exact"]
    ]
    out += [
        md_table(
            [
                "tokens / step",
                "mean load / expert",
                "overflow cf 1.0",
                "overflow cf 1.25",
                "padding (groups x8)",
                "padding (groups x128)",
            ],
            rows,
        ),
        "",
        "Small steps (decode) overflow at any capacity factor: with a mean load near 1, C rounds up to the same "
        "small integer for both factors. "
        + padding_sentence(f["uniform_exact"], 128, "rows (a typical GEMM tile)")
        + " "
        + padding_sentence(f["uniform_exact"], 8, "rows"),
        "",
        "### Simulated routing: overflow, padding, per-rank imbalance",
        "",
    ]
    sim = [r for r in f["simulated"] if r["tokens"] in (256, 4096, 16384)]
    rows = []
    for r in sim:

        def imb(ep):
            v = r.get(f"imbalance_ep{ep}")
            w = r.get(f"imbalance_ep{ep}_random_placement")
            return "-" if v is None else f"{v:.2f}" + (f" ({w:.2f})" if w is not None else "")

        rows.append(
            [
                r["model"],
                r["tokens"],
                f"{r['max_load_over_mean']:.2f}",
                pct(r["overflow_cf1"]),
                pct(r["overflow_cf1.25"]),
                pct(r["padding_8"], 1),
                imb(8),
                imb(64),
            ]
        )
    out += [
        md_table(
            [
                "routing",
                "tokens / step",
                "max / mean expert load",
                "overflow cf 1.0",
                "overflow cf 1.25",
                "padding x8",
                "rank max/mean EP 8",
                "EP 64",
            ],
            rows,
        ),
        "",
        "Rank imbalance: token-expert pairs on the busiest rank over the mean, experts placed contiguously in "
        "popularity order (worst case); in brackets a random placement. Straggler model: the MoE phase of a step "
        "(expert GEMMs and the all-to-all they gate) takes max/mean times the balanced time, so these columns are "
        "the slowdown factors.",
        "",
        "### All-to-all bytes per token per MoE layer",
        "",
    ]
    rows = [
        [
            r["ep"],
            f"{r['experts_per_rank']:g}",
            f"{r['distinct_ranks']:.2f}",
            f"{r['remote_ranks']:.2f}",
            human_bytes(r["bytes_x"]),
            human_bytes(r["bytes_z"]),
            f"{r['ratio_z_over_x']:.3f}",
            human_bytes(r["bytes_x_no_dedup"]),
        ]
        for r in f["all_to_all"]
    ]
    out += [
        md_table(
            [
                "EP ranks",
                "experts / rank",
                "distinct ranks / token",
                "remote ranks",
                "x dispatch (d)",
                "z dispatch (l)",
                "z / x",
                "x without dedup",
            ],
            rows,
        ),
        "",
        "Dispatch + combine, bf16, one copy per distinct rank holding the token's experts (exact hypergeometric "
        "expectation for uniform routing, contiguous placement), (R-1)/R of it remote. Dispatching the latent z "
        "instead of x scales the traffic by l/d.",
        "",
        "![router frontier](router.png)",
        "",
    ]
    return out


def _long(a: dict, config: K3Config) -> list[str]:
    lc = a["long_context"]
    t = lc["table"]
    out = [
        "## 6. Long-context serving",
        "",
        f"Cache bytes per sequence: the {lc['label']} (KDA fp32 state + bf16 conv state + bf16 MLA latents), its "
        "full-MLA twin (every layer MLA, same dims) and a full-MHA twin (every layer standard attention with the "
        f"MLA head count and dims: {config.mla.num_heads} x ({config.mla.qk_head_dim} + {config.mla.v_head_dim}) "
        "bf16 values per token per layer).",
        "",
    ]
    rows = [
        [tokens(c), human_bytes(h), human_bytes(m), human_bytes(x), f"{h / m:.3f}", f"{h / x:.4f}"]
        for c, h, m, x in zip(t["context"], t["hybrid"], t["full_mla"], t["full_mha"])
    ]
    h = lc["label"]
    out += [md_table(["context", h, "full-MLA twin", "full-MHA twin", f"{h} / MLA", f"{h} / MHA"], rows), ""]
    x = lc["crossovers"]
    if x:
        out += [
            f"- One KDA layer's fp32 state ({human_bytes(x['kda_state_per_layer'])}) equals one MLA layer's latent "
            f"cache ({x['mla_bytes_per_token']} B / token) at **{x['layer_state_vs_latent']:,.0f} tokens** "
            f"({x['layer_state_conv_vs_latent']:,.0f} with the conv state); below that a KDA layer holds and moves "
            "more bytes than an MLA layer would.",
            f"- The hybrid's cache undercuts the full-MLA twin above {x['hybrid_vs_full_mla']:,.0f} tokens and the "
            f"full-MHA twin above {x['hybrid_vs_full_mha']:,.0f} tokens.",
            f"- Decode traffic: a KDA state is read and written back every step, so per layer the decode-bytes "
            f"crossover with MLA's read-only latents is at {x['decode_traffic_layer']:,.0f} tokens.",
            "",
        ]
    out += [
        "![long context](long_context.png)",
        "",
        "### Bytes one decode step must move (lower bound)",
        "",
        "Dense weights (everything but the routed experts and the embedding table) + the distinct experts hit "
        "(uniform routing) + per sequence KDA state read and write, conv state and all latents of the context; "
        "bf16 weights. Divide by the aggregate memory bandwidth for the lower bound on step time.",
        "",
    ]
    rows = [
        [
            r["batch"],
            tokens(r["context"]),
            human_bytes(r["dense_weights"]),
            human_bytes(r["experts"]),
            human_bytes(r["states"]),
            human_bytes(r["total"]),
            human_bytes(r["per_token"]),
        ]
        for r in lc["decode_bytes"]
    ]
    out += [
        md_table(["B", "context", "dense weights", "experts", "states + latents", "total / step", "per token"], rows),
        "",
    ]
    out += _measured_decode(lc.get("measured_gpu"))
    c = a["measured_cpu"]
    if c:
        env = c["environment"]
        out += [
            f"### Measured on CPU ({_threads(c['threads'])}, {env['dtype']}, torch {env['torch']}, {env['time']})",
            "",
            f"Config: {c['config']}, random weights, `k3.infer.engine.Engine`, reference PyTorch kernels; prompt "
            f"{c['prompt']} tokens, one packed prefill pass for all sequences, then {c['decode_steps']} greedy "
            f"decode steps; best of {c['repeats']} fresh runs.",
            "",
        ]
        rows = [
            [
                r["model"],
                r["batch"],
                f"{r['prefill_tokens_per_s']:.0f}",
                f"{r['decode_tokens_per_s']:.1f}",
                f"{r['decode_ms_per_step']:.1f}",
            ]
            for r in c["rows"]
        ]
        out += [md_table(["model", "B", "prefill tokens/s", "decode tokens/s", "ms / decode step"], rows), ""]
        rows = [[r["request"], r["prompt"], r["cached_tokens"], f"{1e3 * r['seconds']:.0f}"] for r in c["prefix_cache"]]
        out += [
            "Prefix cache (two prompts sharing all but their last block; time to the first token):",
            "",
            md_table(["request", "prompt tokens", "cached tokens", "ms"], rows),
            "",
        ]
    return out


def _model_label(m: dict) -> str:
    """The benchmark model as its results file (or, failing that, the benchmark code) describes it."""
    if not m or not m.get("name"):
        return "a model the file does not name" + (f" ({m['from']})" if m else "")
    text = f"`{m['name']}`"
    if "params_total" in m:
        text += (
            f" ({human(m['params_total'])} parameters, {human(m['params_activated'])} activated; {m['layers']} layers, "
            f"{m['mla_layers']} of them MLA; d = {m['hidden_size']})"
        )
    return text + f"; source of the label: {m['from']}"


def _measured_decode(g: dict | None) -> list[str]:
    """The GPU decode rows, each with its results file; files that are missing or unreadable are said."""
    files = (g or {}).get("files", [])
    read = [f for f in files if f["read"]]
    missing = [f for f in files if not f["read"]]
    out = []
    if not any(r["valid"] for r in (g or {}).get("rows", [])):
        names = ", ".join(f"`benchmarks/results/{f['name']}` ({f.get('why', 'no valid rows')})" for f in files)
        return [
            f"No GPU decode measurements found ({names or 'no results files'}; run `k3 bench decode` on a GPU).",
            "",
        ]
    out += ["### Measured on a GPU (`k3 bench decode`)", ""]
    for f in read:
        bw = f" Copy bandwidth {f['copy_bandwidth_TBps']:.2f} TB/s" if f.get("copy_bandwidth_TBps") else ""
        if f.get("read_bandwidth_TBps"):
            bw += f", read bandwidth {f['read_bandwidth_TBps']:.2f} TB/s"
        out += [
            f"- `benchmarks/results/{f['name']}`: {f['device']}, {f['time']}; {f['rows_used']} row(s) used. Model: "
            f"{_model_label(f['model'])}. Backend: {f['backend']}.{bw + '.' if bw else ''}",
        ]
    for f in missing:
        out += [f"- `benchmarks/results/{f['name']}`: {f['why']}; none of its rows are in the table."]
    out += [
        "",
        "The first file holds the current figures; a later file contributes only the (model, B, context) cases the "
        "earlier ones lack, so a case measured again (e.g. compiled) shows only its latest row. These are the "
        "benchmark's model, not this config: they measure our decode path, hybrid vs its full-MLA twin. `limit` is "
        "the bytes-moved lower bound at the copy bandwidth measured by the same run; *hybrid x* is the twin's step "
        "time over the hybrid's, same file and mode.",
        "",
    ]
    valid = [r for r in g["rows"] if r["valid"]]
    rows = [
        [
            r.get("model"),
            r.get("batch"),
            tokens(r["context"]) if "context" in r else "-",
            f"{r['tokens_per_s']:.1f}",
            f"{r['ms_per_step']:.3f}",
            f"{r['limit_ms']:.3f}" if "limit_ms" in r else "-",
            pct(r["fraction_of_limit"], 1) if "fraction_of_limit" in r else "-",
            f"{r['hybrid_speedup']:.2f}x" if "hybrid_speedup" in r else "-",
            f"`{r['source']}`",
        ]
        for r in valid
    ]
    out += [
        md_table(["model", "B", "context", "tokens/s", "ms / step", "limit ms", "of limit", "hybrid x", "file"], rows),
        "",
    ]
    sp = g.get("speedups", [])
    if sp:
        best = sp[0]
        out += [
            f"Hybrid vs full-MLA twin: {best['hybrid_speedup']:.2f}x at B={best['batch']} / "
            f"{tokens(best['context'])} ({best['mode']}, `{best['source']}`)"
            + (
                "; older runs: "
                + ", ".join(
                    f"{s['hybrid_speedup']:.2f}x at B={s['batch']} / {tokens(s['context'])} ({s['mode']}, "
                    f"`{s['source']}`)"
                    for s in sp[1:]
                )
                if len(sp) > 1
                else ""
            )
            + ".",
            "",
        ]
    hidden = [r for r in valid if "hybrid_speedup_hidden" in r]
    if hidden:
        out += [
            "Ratios left out (their hybrid row was measured again in a newer file, so the pair is not shown): "
            + "; ".join(f"{r['model']} B={r['batch']} / {tokens(r['context'])} (`{r['source']}`)" for r in hidden)
            + ".",
            "",
        ]
    bad = [r for r in g["rows"] if not r["valid"]]
    if bad:
        out += [
            f"{len(bad)} row(s) have a non-positive rate or time (a broken measurement) and are left out: "
            + "; ".join(f"{r.get('model')} B={r.get('batch')} (`{r['source']}`)" for r in bad)
            + ".",
            "",
        ]
    return out


def _attn_res(a: dict) -> list[str]:
    costs = a["attn_res"]
    flops = a["paths"]["total"]["flops"] - a["paths"]["rows"].get("attn_res", {}).get("flops", 0.0)
    stages = list(next(iter(costs.values()))["pipeline"])
    out = [
        "## 7. AttnRes overhead",
        "",
        "Per token, from the model's own residual bookkeeping (`ResidualStream`). *Live*: d-vectors a token keeps "
        "for later mixes (inference). *Stacked*: sum over mixes of the sources S, what a stack-then-mix "
        "implementation (the reference) saves for the backward pass (ours, two-phase, keeps the sources and one "
        "phase-1 output per mix). *FLOPs*: 4 S d per mix (logits and weighted sum; "
        "each source's rms reused), as a share of the forward FLOPs without AttnRes. *Stage boundary*: d-vectors "
        "that cross a pipeline-stage boundary (the bank of block summaries + the running state), worst boundary "
        "for an even split into PP stages. bf16 activations.",
        "",
    ]
    rows = []
    for mode, c in costs.items():
        rows.append(
            [
                mode,
                c["mixes"],
                c["max_sources"],
                f"{c['mean_sources']:.1f}",
                f"{c['live_vectors']} ({human_bytes(c['live_bytes_per_token'])})",
                f"{c['stacked_vectors']} ({human_bytes(c['stacked_bytes_per_token'])})",
                f"{human(c['flops_per_token'])} ({pct(c['flops_per_token'] / flops, 3)})",
            ]
            + [
                f"{c['pipeline'][p]['max_vectors']} ({human_bytes(c['pipeline'][p]['max_bytes_per_token'])})"
                for p in stages
            ]
        )
    out += [
        md_table(
            ["mode", "mixes", "max S", "mean S", "live / token", "stacked / token", "mix FLOPs / token"]
            + [f"stage boundary PP={p}" for p in stages],
            rows,
        ),
        "",
        "![AttnRes](attn_res.png)",
        "",
    ]
    c = a["measured_cpu"]
    if c and c.get("attn_res"):
        rows = [
            [r["mode"], r["tokens"], f"{r['ms']:.1f}", f"{r['ms_median']:.1f}", f"{r['vs_none']:.3f}"]
            for r in c["attn_res"]
        ]
        out += [
            f"Measured on CPU ({c['config']}, {_threads(c['threads'])}, forward of one sequence, modes "
            "interleaved, 5 runs after a warm-up):",
            "",
            md_table(["mode", "tokens", "ms (min)", "ms (median)", "min vs none"], rows),
            "",
        ]
    if c and c.get("attn_res_depth"):
        out += _attn_res_depth(c["attn_res_depth"])
    out += _attn_res_gpu(a.get("attn_res_gpu"))
    return out


def _attn_res_depth(d: dict) -> list[str]:
    """The depth table: activation bytes (measured), mix FLOPs and bytes (analytic), CPU time, per mode."""
    out = [
        f"### At this config's depth ({d['layers']} layers, narrow: `{d['config']}`, CPU)",
        "",
        f"`{d['config']}` keeps the depth, the KDA / MLA and dense / MoE schedule and the AttnRes blocks "
        f"({d['block_size']} layers) and narrows the rest: d = {d['hidden_size']}, {human(d['params_total'])} "
        f"parameters, {d['dtype']}. One forward + backward of [1, {d['tokens']}] tokens per mode "
        f"(`k3.audit.measure.attn_res_depth`). *Saved*: bytes autograd keeps for the backward pass, measured with "
        "`torch.autograd.graph.saved_tensors_hooks` (each storage once, parameters excluded: the activation "
        "memory). *Stack-then-mix*: what the reference form would save instead (analytic, `k3.audit.attnres`). "
        f"*Mix FLOPs*: 4 S d per mix (analytic), share of the model's forward FLOPs "
        f"({human(d['forward_flops_per_token'])} per token at context {d['tokens']}, `k3.audit.accounting`). "
        f"*ms*: forward + backward on {_threads(d['threads'])}, min of {d['repeats']} runs after the measuring "
        "pass, modes interleaved; at this width the reference kernels' per-op overhead, not FLOPs, sets the time.",
        "",
    ]
    rows = [
        [
            r["mode"],
            human_bytes(r["saved_bytes_per_token"]),
            f"{r['saved_vs_none']:.3f}" if "saved_vs_none" in r else "-",
            human_bytes(r["stacked_bytes_per_token"]),
            human_bytes(r["live_bytes_per_token"]),
            f"{human(r['mix_flops_per_token'])} ({pct(r['mix_flops_share'], 2)})",
            f"{r['ms']:.0f}",
            f"{r['ms_median']:.0f}",
            f"{r['ms_vs_none']:.2f}" if "ms_vs_none" in r else "-",
        ]
        for r in d["rows"]
    ]
    out += [
        md_table(
            [
                "mode",
                "saved / token",
                "vs none",
                "stack-then-mix / token",
                "live / token",
                "mix FLOPs / token",
                "ms (min)",
                "ms (median)",
                "min vs none",
            ],
            rows,
        ),
        "",
    ]
    none = next((r for r in d["rows"] if r["mode"] == "none"), None)
    if none:
        extra = [
            f"{r['mode']} {human_bytes(r['saved_bytes_per_token'] - none['saved_bytes_per_token'])} "
            f"(stack-then-mix: {human_bytes(r['stacked_bytes_per_token'])})"
            for r in d["rows"]
            if r["mode"] != "none"
        ]
        out += [
            "Saved per token above `none`: " + "; ".join(extra) + ". The mix FLOP shares here are those of a "
            f"d = {d['hidden_size']} model; mix FLOPs grow with d while the layers' grow with d^2, so at this "
            "config's own width they are the shares of the table above.",
            "",
        ]
    return out


def _attn_res_gpu(g: dict | None) -> list[str]:
    """The GPU overheads of ``k3 bench model --cases attn_res`` (and ``attn_res_compiled``), each value's file."""
    files = (g or {}).get("files", [])
    if not (g and g["rows"]):
        names = ", ".join(f"`benchmarks/results/{f['name']}` ({f.get('why', 'no AttnRes rows')})" for f in files)
        return [f"No GPU AttnRes measurements found ({names or 'no results files'}).", ""]
    out = [
        "### Measured on a GPU (`k3 bench model --cases attn_res,attn_res_compiled`)",
        "",
    ]
    for f in files:
        out.append(
            f"- `benchmarks/results/{f['name']}`: "
            + (f"{f['device']}, {f['time']}." if f["read"] else f"{f['why']}; not in the table.")
        )
    out += [
        "",
        "The files do not name their config: it is the one `attn_res_rows` in `k3/bench/model.py` builds (training "
        "step, peak memory, CUDA-graph decode step; the compiled file: the decode step compiled before capture). "
        "Overheads are against `none` of the same file.",
        "",
    ]
    by_file = {}
    for r in g["rows"]:
        for key, value in r.items():
            if key.endswith("_source"):
                by_file.setdefault(value, set()).add(key[: -len("_source")])

    def v(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "-"

    rows = [
        [
            r["mode"],
            v(r, "ms", ".1f"),
            v(r, "train_overhead", "+.1%"),
            v(r, "peak_GiB", ".2f"),
            v(r, "decode_ms", ".3f"),
            v(r, "decode_overhead", "+.1%"),
            v(r, "decode_ms_compiled", ".3f"),
            v(r, "decode_overhead_compiled", "+.1%"),
        ]
        for r in g["rows"]
    ]
    heads = ["mode", "train ms", "train overhead", "peak GiB", "decode ms", "decode overhead"]
    heads += ["compiled decode ms", "compiled overhead"]
    out += [md_table(heads, rows), ""]
    out += [
        "Files: " + "; ".join(f"{', '.join(sorted(keys))} from `{name}`" for name, keys in by_file.items()) + ".",
        "",
    ]
    return out
