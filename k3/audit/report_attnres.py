"""The Attention Residuals sections of ``report.md`` (question 7); split out of ``k3.audit.report``, which
assembles them."""

from __future__ import annotations

from k3.audit.format import human, human_bytes, md_table, pct
from k3.audit.report_serving import _threads


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
    g = a.get("attn_res_depth_gpu")
    if g and g.get("rows"):
        out += _attn_res_depth(g)
    elif g:
        out += [f"AttnRes at this config's depth on a GPU: not measured ({g['why']}).", ""]
    out += _attn_res_gpu(a.get("attn_res_gpu"))
    return out


def _attn_res_depth(d: dict) -> list[str]:
    """The depth table: activation bytes (measured), mix FLOPs and bytes (analytic), time (and on a GPU the peak
    memory), per mode; ``d`` from :func:`k3.audit.measure.attn_res_depth` (CPU) or the GPU results file."""
    gpu = d.get("device", "CPU") != "CPU"
    where = (
        f"{d['device']} under {d['dtype']}, from `benchmarks/results/{d.get('file', 'attn_res_depth.json')}` "
        f"({d.get('time', '?')})"
        if gpu
        else _threads(d["threads"])
    )
    out = [
        f"### At this config's depth ({d['layers']} layers, narrow: `{d['config']}`, {'GPU' if gpu else 'CPU'})",
        "",
        f"`{d['config']}` keeps the depth, the KDA / MLA and dense / MoE schedule and the AttnRes blocks "
        f"({d['block_size']} layers) and narrows the rest: d = {d['hidden_size']}, {human(d['params_total'])} "
        f"parameters, {d['dtype']}. One forward + backward of [1, {d['tokens']}] tokens per mode "
        f"(`k3.audit.measure.attn_res_depth`). *Saved*: bytes autograd keeps for the backward pass, measured with "
        "`torch.autograd.graph.saved_tensors_hooks` (each storage once, parameters excluded: the activation "
        "memory). *Stack-then-mix*: what the reference form would save instead (analytic, `k3.audit.attnres`). "
        f"*Mix FLOPs*: 4 S d per mix (analytic), share of the model's forward FLOPs "
        f"({human(d['forward_flops_per_token'])} per token at context {d['tokens']}, `k3.audit.accounting`). "
        f"*ms*: forward + backward on {where}, min of {d['repeats']} runs after the measuring pass, modes "
        "interleaved; at this width per-op overhead, not FLOPs, sets the time"
        + (
            "; *peak*: the most memory the pass allocated; *first pass*: the first forward + backward, TorchInductor's "
            "compiles of the fused ops included (one per distinct number of depth sources)."
            if gpu
            else "."
        ),
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
        + ([human_bytes(r["peak_bytes"]), f"{r['peak_vs_none']:.3f}" if "peak_vs_none" in r else "-"] if gpu else [])
        + ([f"{r['first_pass_s']:.1f}" if "first_pass_s" in r else "-"] if gpu else [])
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
            ]
            + (["peak", "peak vs none", "first pass s"] if gpu else []),
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
