"""The router, long-context and decode-serving sections of ``report.md`` (questions 5 and 6); split out of
``k3.audit.report``, which assembles them."""

from __future__ import annotations

from k3.audit.format import human, human_bytes, md_table, pct, tokens
from k3.config import K3Config


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


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
        "bf16 weights, and the last two columns with the routed experts in MXFP4 (4.25 bits a weight, as "
        "released). Divide by the aggregate memory bandwidth for the lower bound on step time.",
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
            human_bytes(r["experts_mxfp4"]),
            human_bytes(r["total_mxfp4"]),
        ]
        for r in lc["decode_bytes"]
    ]
    columns = ["B", "context", "dense weights", "experts", "states + latents", "total / step", "per token"]
    out += [
        md_table(columns + ["experts MXFP4", "total / step MXFP4"], rows),
        "",
    ]
    out += _measured_decode(lc.get("measured_gpu"))
    out += _measured_slice(lc.get("slice"))
    out += _prefill(lc.get("prefill"))
    out += _serving_load(lc.get("serving_load"))
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


def _measured_slice(s: dict | None) -> list[str]:
    """K3's widths on one GPU (benchmarks/results/slice.json): decode against its bytes' limit, and the
    benchmark's extrapolation to 93 layers under expert parallelism, labelled as one."""
    if not s or not s.get("read") or not s["rows"]:
        why = (s or {}).get("why", "no decode rows")
        return [f"No measurement at K3's widths (`benchmarks/results/slice.json`: {why}; run `k3 bench slice`).", ""]
    out = [
        "### K3's widths on one GPU (`k3 bench slice`)",
        "",
        f"`benchmarks/results/{s['name']}`: {s.get('device')}, {s.get('time')}; model `{s.get('config')}`: K3's "
        "exact widths (d 7168, 96 heads, 896 experts top-16 in a latent 3584) in 5 layers, the routed experts "
        f"packed in MXFP4 ({s.get('routed_expert_GB', float('nan')):.1f} GB, "
        f"{s.get('routed_expert_bytes_per_weight', float('nan')):.4f} bytes a weight). Each step replayed from a "
        "CUDA graph; `limit` is the bytes the step must read (the distinct experts one step selected, packed) at "
        f"the copy bandwidth the same run measured ({s.get('copy_bandwidth_TBps', float('nan')):.2f} TB/s).",
        "",
    ]
    rows = [
        [
            r["batch"],
            tokens(r["context"]),
            f"{r['ms']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['step_GB']:.1f}",
            f"{r['limit_ms']:.2f}",
            pct(r["fraction_of_limit"], 1),
        ]
        for r in s["rows"]
        if all(isinstance(r.get(k), (int, float)) for k in ("tokens_per_s", "step_GB", "limit_ms", "fraction_of_limit"))
    ]
    out += [md_table(["B", "context", "ms / step", "tokens/s", "GB / step", "limit ms", "of limit"], rows), ""]
    ex = [e for e in s.get("extrapolation", []) if isinstance(e, dict) and "step_ms" in e]
    if ex:
        rows = [
            [e["batch_per_gpu"], tokens(e["context"]), f"{e['step_ms']:.1f}", f"{e['tokens_per_s_per_gpu']:,.0f}"]
            + [f"{e['tokens_per_s_cluster']:,.0f}"]
            for e in ex
        ]
        out += [
            f"Extrapolated, not measured: the full 93-layer K3 on {ex[0]['gpus']} GPUs, expert parallel, from the "
            "slice's per-layer times (each GPU running every attention layer for its own sequences and its share "
            "of every MoE layer's experts); the all-to-alls are not included (`k3 plan` prices them).",
            "",
            md_table(["B per GPU", "context", "ms / step", "tokens/s per GPU", "tokens/s, all GPUs"], rows),
            "",
        ]
    return out


def _prefill(p: dict | None) -> list[str]:
    """The one-GPU long-prompt prefill rows of benchmarks/results/model.json (hybrid vs its full-MLA twin)."""
    if not p or not p.get("read"):
        why = (p or {}).get("why", "not found")
        return [f"No GPU prefill results (`benchmarks/results/model.json`: {why}).", ""]

    def cell(r: dict, arm: str) -> str:
        if f"{arm}_s" not in r:
            return r.get(f"{arm}_error", "—")
        sec = r[f"{arm}_s"]
        return f"{sec:.2f} s ({r['tokens'] / sec / 1e3:.1f}K tokens/s, {r[f'{arm}_peak_GiB']:.0f} GiB)"

    rows = [
        [
            tokens(r["tokens"]),
            r["model"],
            cell(r, "hybrid"),
            cell(r, "twin"),
            f"{r['twin_over_hybrid']:.2f}" if "twin_over_hybrid" in r else "—",
        ]
        for r in p["rows"]
    ]
    return [
        "### Long-prompt prefill on a GPU (`k3 bench model --cases prefill`)",
        "",
        f"`benchmarks/results/{p['name']}`: {p.get('device')}, {p.get('time')}. One sequence, one forward pass, "
        "logits at the last token only; time, throughput and peak memory of the hybrid and of its full-MLA twin "
        "(every layer MLA). Above 1 in the last column the hybrid is faster.",
        "",
        md_table(["tokens", "model", "hybrid", "full-MLA twin", "twin / hybrid"], rows),
        "",
    ]


def _serving_load(s: dict | None) -> list[str]:
    """TTFT / TPOT against concurrency and the prefix cache's effect, from benchmarks/results/serve-load.json."""
    if not s or not s.get("read"):
        why = (s or {}).get("why", "not found")
        return [f"No serving-under-load results (`benchmarks/results/serve-load.json`: {why}).", ""]
    out = [
        "### Serving under load (`benchmarks/serve_load.py`)",
        "",
        f"`benchmarks/results/{s['name']}`: {s.get('device')}, {s.get('time')}; checkpoint: {s.get('checkpoint')}. "
        "Streamed greedy completions through `k3 serve`; TTFT from request to first text, TPOT per later token.",
        "",
    ]
    rows = [
        [
            r.get("case", ""),
            r.get("requests", ""),
            *(f"{r[k]:.1f}" if isinstance(r.get(k), (int, float)) else "—" for k in ("ttft_p50_ms", "ttft_p90_ms")),
            *(f"{r[k]:.2f}" if isinstance(r.get(k), (int, float)) else "—" for k in ("tpot_p50_ms", "tokens_per_s")),
            r.get("error") or r.get("detail", ""),
        ]
        for r in s["rows"]
    ]
    head = ["case", "requests", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "tokens/s", "detail"]
    return out + [md_table(head, rows), ""]


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
