"""PNG figures of ``k3 audit`` (matplotlib, Agg backend, one function per figure)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

MIXER_COLOURS = {"kda": "#4C72B0", "mla": "#DD8452"}
FFN_COLOURS = {"dense": "#55A868", "moe": "#8172B3"}
GiB = 2**30


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recipe_strip(recipe: dict, title: str, path: Path) -> None:
    """Two rows of cells, one per layer: mixer (top) and FFN (bottom); dashed lines at AttnRes block starts."""
    layers = recipe["layers"]
    n = len(layers)
    fig, ax = plt.subplots(figsize=(min(16, 3 + 0.13 * n), 2.1))
    for r in layers:
        ax.add_patch(plt.Rectangle((r["index"], 1), 0.92, 0.9, color=MIXER_COLOURS[r["mixer"]]))
        ax.add_patch(plt.Rectangle((r["index"], 0), 0.92, 0.9, color=FFN_COLOURS[r["ffn"]]))
    for start, _ in recipe["attn_res_blocks"][1:]:
        ax.axvline(start - 0.04, color="black", lw=1.2, ls="--")
    ax.set_xlim(-0.5, n + 0.5)
    ax.set_ylim(-0.1, 2.0)
    ax.set_yticks([0.45, 1.45], ["FFN", "mixer"])
    step = max(1, n // 24)
    ax.set_xticks([i + 0.46 for i in range(0, n, step)], [str(i) for i in range(0, n, step)], fontsize=7)
    ax.set_xlabel("layer (0-indexed); dashed: AttnRes block boundaries" if recipe["attn_res_blocks"] else "layer")
    ax.legend(
        handles=[Patch(color=c, label=k.upper()) for k, c in MIXER_COLOURS.items()]
        + [Patch(color=c, label=k) for k, c in FFN_COLOURS.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, 1.45),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    ax.set_title(title, fontsize=9, pad=22)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    _save(fig, path)


def params_by_path(paths: dict, title: str, path: Path) -> None:
    """Three panels, one unit each: parameters (total vs activated), weight GiB read per token, GFLOP per token.
    Every value is counted (none extrapolated), so nothing is shaded."""
    rows = {k: v for k, v in paths["rows"].items() if v["total"] > 0}
    names = list(rows)
    y = list(range(len(names)))
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    a1.barh([i + 0.2 for i in y], [rows[k]["total"] for k in names], height=0.4, color="C0", label="total")
    a1.barh(
        [i - 0.2 for i in y],
        [max(rows[k]["activated"], 1) for k in names],
        height=0.4,
        color="C1",
        hatch="//",
        label="activated per token",
    )
    a1.set_xscale("log")
    a1.set_xlabel("parameters (log scale)")
    a1.set_title("parameters", fontsize=9)
    a2.barh(y, [rows[k]["weight_bytes"] / GiB for k in names], height=0.6, color="C2", label="bf16, batch 1")
    a2.set_xlabel("weight GiB read per token")
    a2.set_title("weights read per token", fontsize=9)
    a3.barh(
        y,
        [rows[k]["flops_matmul"] / 1e9 for k in names],
        height=0.6,
        color="C3",
        label="matmuls (2 per activated weight)",
    )
    a3.barh(
        y,
        [rows[k]["flops_context"] / 1e9 for k in names],
        left=[rows[k]["flops_matmul"] / 1e9 for k in names],
        height=0.6,
        color="C4",
        hatch="..",
        label=f"attention / KDA state at context {paths['context']}",
    )
    a3.set_xlim(0, 1.08 * max(rows[k]["flops"] / 1e9 for k in names))
    a3.set_xlabel("forward GFLOP per token")
    a3.set_title("forward FLOPs per token", fontsize=9)
    a1.set_yticks(y, names)
    a1.set_ylabel("path")
    for a in (a1, a2, a3):
        a.legend(fontsize=8, loc="lower right")
        a.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def experts_per_step(stream: dict, num_experts: int, k: int, title: str, path: Path) -> None:
    rows = stream["rows"]
    b = [r["batch"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(b, [r["distinct_per_layer"] for r in rows], "o-")
    a1.axhline(num_experts, color="grey", ls=":", label=f"all {num_experts} experts")
    for r in rows:
        if r["batch"] in (1, 4, 16, 64):
            a1.annotate(
                f"{r['distinct_per_layer']:.0f}",
                (r["batch"], r["distinct_per_layer"]),
                textcoords="offset points",
                xytext=(-10, 6),
                fontsize=8,
            )
    a1.set_xscale("log", base=2)
    a1.set_xlabel("decode batch B (tokens per step)")
    a1.set_ylabel("distinct experts per MoE layer")
    a1.set_title(f"E (1 - (1 - k/E)^B), E={num_experts}, k={k}", fontsize=9)
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.plot(b, [r["bytes_bf16"] / GiB for r in rows], "o-", label="expert bytes / step, bf16")
    a2.plot(b, [r["bytes_mxfp4"] / GiB for r in rows], "s-", label="expert bytes / step, MXFP4")
    a2.plot(b, [r["bytes_bf16_per_token"] / GiB for r in rows], "^--", label="bf16 per token (/ B)")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("decode batch B")
    a2.set_ylabel(f"GiB over all {stream['moe_layers']} MoE layers")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def router(frontier: dict, title: str, path: Path) -> None:
    exact, sim = frontier["uniform_exact"], frontier["simulated"]
    models = sorted({r["model"] for r in sim}, key=lambda m: (m != "uniform", m))
    fig, axes = plt.subplots(2, 2, figsize=(11, 9.5))
    a = axes[0, 0]
    t = [r["tokens"] for r in exact]
    for cf, ls in (("1", "-"), ("1.25", "--")):
        a.plot(t, [max(r[f"overflow_cf{cf}"], 1e-9) for r in exact], "k" + ls, label=f"uniform, cf {cf} (exact)")
    for i, m in enumerate(models[1:]):
        rs = [r for r in sim if r["model"] == m]
        for cf, ls in (("1", "-"), ("1.25", "--")):
            a.plot(
                [r["tokens"] for r in rs],
                [max(r[f"overflow_cf{cf}"], 1e-9) for r in rs],
                ls,
                marker="o",
                color=f"C{i + 1}",
                label=f"{m}, cf {cf} (sim)",
            )
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_ylim(1e-6, 1)
    a.set_xlabel("tokens per step (per MoE layer)")
    a.set_ylabel("overflow (dropped / rerouted) slots")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    a = axes[0, 1]
    for m, ls in zip(("8", "128"), ("-", "--")):
        a.plot(t, [r[f"padding_{m}"] for r in exact], "k" + ls, label=f"pad groups to x{m} (uniform, exact)")
    a.set_xscale("log", base=2)
    a.set_xlabel("tokens per step")
    a.set_ylabel("padding share of grouped-GEMM rows")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    a = axes[1, 0]
    a2a = frontier["all_to_all"]
    x = range(len(a2a))
    a.bar([i - 0.2 for i in x], [r["bytes_x"] / 1024 for r in a2a], width=0.4, label="dispatch x (d wide)")
    a.bar([i + 0.2 for i in x], [r["bytes_z"] / 1024 for r in a2a], width=0.4, label="dispatch z (latent l wide)")
    for i, r in zip(x, a2a):
        a.annotate(
            f"{r['distinct_ranks']:.2f} ranks",
            (i, r["bytes_x"] / 1024),
            ha="center",
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=8,
        )
    a.set_xticks(list(x), [f"EP={r['ep']}" for r in a2a])
    a.set_ylabel("KiB per token per MoE layer (dispatch + combine, bf16)")
    a.legend(fontsize=8)
    a.grid(axis="y", alpha=0.3)
    a = axes[1, 1]
    for i, m in enumerate(models):
        rs = [r for r in sim if r["model"] == m]
        for ep, ls in (("8", "-"), ("64", "--")):
            key = f"imbalance_ep{ep}"
            if key in rs[0]:
                a.plot(
                    [r["tokens"] for r in rs],
                    [r[key] for r in rs],
                    ls,
                    marker="o",
                    color=f"C{i}" if i else "k",
                    label=f"{m}, EP {ep}",
                )
            if f"{key}_random_placement" in rs[0]:
                a.plot(
                    [r["tokens"] for r in rs],
                    [r[f"{key}_random_placement"] for r in rs],
                    ls,
                    marker="x",
                    color=f"C{i}",
                    alpha=0.5,
                    label=f"{m}, EP {ep}, random placement",
                )
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("tokens per step")
    a.set_ylabel("max / mean rank load (= MoE step time / balanced)")
    a.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def _measured_models(measured: dict) -> str:
    """The benchmark model(s) the GPU decode files measured, by name (the files' own label or the config
    ``k3 bench decode`` builds): the GPU panel is a stand-in for the audited config, and says so."""
    names = []
    for f in measured.get("files", []):
        m = f.get("model")
        name = m.get("name") if isinstance(m, dict) else m
        if f.get("read") and name and name not in names:
            names.append(str(name))
    return ", ".join(names) or "model not named in the files"


def _measured_devices(measured: dict) -> str:
    return ", ".join(sorted({str(f["device"]) for f in measured.get("files", []) if f.get("read")})) or "a GPU"


def long_context(lc: dict, name: str, path: Path, cpu: dict | None = None) -> None:
    """Left: cache bytes per sequence of config ``name`` and its twins (analytic); then, when measured, GPU and
    CPU decode throughput, each of a stand-in model that the panel title names (the figure's title spans all)."""
    curve = lc["curve"]
    measured = lc.get("measured_gpu")
    measured = measured if measured and any(r["valid"] for r in measured["rows"]) else None
    panels = 1 + bool(measured) + bool(cpu)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    a = axes[0, 0]
    for key, label in (
        ("hybrid", f"{lc['label']} (KDA state + MLA latents)"),
        ("full_mla", "full-MLA twin"),
        ("full_mha", "full-MHA twin"),
    ):
        a.plot(curve["context"], [v / GiB for v in curve[key]], label=label)
    x = lc.get("crossovers")
    if x and x["hybrid_vs_full_mla"] < 2**21:
        a.axvline(x["hybrid_vs_full_mla"], color="grey", ls=":")
        a.annotate(
            f"hybrid < full-MLA above {x['hybrid_vs_full_mla'] / 1000:.1f}K",
            (x["hybrid_vs_full_mla"], min(curve["hybrid"]) / GiB),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("context (tokens)")
    a.set_ylabel("GiB per sequence")
    a.set_title(f"cache bytes per sequence of {name} (analytic)", fontsize=9)
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    col = 1
    if measured:
        a = axes[0, col]
        col += 1
        rows = [r for r in measured["rows"] if r["valid"] and "context" in r and "tokens_per_s" in r]
        groups = sorted({(r["model"], r["batch"], r["source"]) for r in rows})
        batches = sorted({b for _, b, _ in groups})
        sources = sorted({s for _, _, s in groups})
        for model, b, src in groups:
            rs = sorted(
                (r for r in rows if (r["model"], r["batch"], r["source"]) == (model, b, src)),
                key=lambda r: r["context"],
            )
            a.plot(
                [r["context"] for r in rs],
                [r["tokens_per_s"] for r in rs],
                ("o" if "hybrid" in model else "s" if "MLA" in model else "x") + ("-" if "hybrid" in model else "--"),
                color=f"C{batches.index(b)}",
                markersize=8 if src == sources[0] else 5,
                fillstyle="full" if src == measured["files"][0]["name"] else "none",
                label=f"{model}, B={b} ({src})",
            )
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("context (tokens)")
        a.set_ylabel("decode tokens/s (log scale)")
        a.set_title(
            f"decode measured on {_measured_devices(measured)}: {_measured_models(measured)}, not {name}\n"
            "(filled markers: the current file)",
            fontsize=9,
        )
        a.legend(fontsize=5.5)
        a.grid(alpha=0.3)
    if cpu:
        a = axes[0, col]
        rows = cpu["rows"]
        labels = [f"{r['model']}\nB={r['batch']}" for r in rows]
        a.bar(range(len(rows)), [r["decode_tokens_per_s"] for r in rows])
        a.set_xticks(range(len(rows)), labels, fontsize=7)
        a.set_xlabel("model, decode batch B")
        a.set_ylabel("decode tokens/s")
        a.set_title(
            f"decode measured on CPU: {cpu['config_name']}, not {name}\n(prompt {cpu['prompt']} tokens)",
            fontsize=9,
        )
        a.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{name}: long-context serving", fontsize=10)
    _save(fig, path)


def _bar_labels(a, xs, values, fmt: str) -> None:
    for x, v in zip(xs, values):
        a.annotate(fmt.format(v), (x, v), ha="center", textcoords="offset points", xytext=(0, 2), fontsize=7)


def attn_res(
    costs: dict,
    title: str,
    path: Path,
    latency: list[dict] | None = None,
    depth: dict | None = None,
    gpu: dict | None = None,
    depth_gpu: dict | None = None,
    gpu_config: str = "",
) -> None:
    """One unit per panel: depth sources per mix; bytes per token (live, stage boundary); mix FLOPs per token;
    with measurements: CPU forward ms per mode; at the config's depth, saved activation bytes over ``none``'s on
    the CPU and (``depth_gpu``, benchmarks/attn_res_depth.py) on a GPU; and the GPU training / decode overheads
    (``gpu``: :func:`k3.audit.attnres.measured_attn_res` rows, measured on ``gpu_config``). All values are
    counted or measured (none extrapolated), so nothing is shaded."""
    depth_gpu = depth_gpu if depth_gpu and depth_gpu.get("rows") else None
    gpu_rows = [r for r in (gpu or {}).get("rows", []) if r["mode"] != "none"]
    panels = 3 + bool(latency) + bool(depth or depth_gpu) + bool(gpu_rows)
    grid_rows = 1 if panels <= 3 else 2
    fig, grid = plt.subplots(grid_rows, 3, figsize=(15, 4.3 * grid_rows), squeeze=False)
    axes = list(grid.flat)
    for a in axes[panels:]:
        a.set_visible(False)
    modes = list(costs)
    styles = {m: s for m, s in zip(modes, (("k", "-", "o"), ("C0", "--", "s"), ("C1", ":", "^"), ("C3", "-.", "D")))}
    a = axes[0]
    for mode, c in costs.items():
        colour, ls, marker = styles[mode]
        n = len(c["sources_per_mix"])
        a.plot(
            range(n), c["sources_per_mix"], color=colour, ls=ls, marker=marker, markevery=max(1, n // 12), label=mode
        )
    a.set_yscale("log")
    a.set_xlabel("mix index (2 per layer: attention, FFN; then the output mix)")
    a.set_ylabel("depth sources S per mix (log scale)")
    a.set_title("sources per mix", fontsize=9)
    a.legend(fontsize=8, title="mode", title_fontsize=8)
    a.grid(alpha=0.3)
    x = list(range(len(modes)))
    a = axes[1]
    # pipeline sizes are ints, or strings once the costs went through audit.json
    pipes = {m: {int(k): v for k, v in (costs[m]["pipeline"] or {}).items()} for m in modes}
    pp = max(pipes[modes[0]] or [0])
    width = 0.4 if pp else 0.6
    a.bar(
        [i - width / 2 if pp else i for i in x],
        [costs[m]["live_bytes_per_token"] / 1024 for m in modes],
        width=width,
        color="C0",
        label="live sources (inference)",
    )
    if pp:
        a.bar(
            [i + width / 2 for i in x],
            [pipes[m][pp]["max_bytes_per_token"] / 1024 for m in modes],
            width=width,
            color="C2",
            hatch="//",
            label=f"worst stage boundary, PP={pp}",
        )
    a.set_yscale("log")
    a.set_xticks(x, modes)
    a.set_xlabel("AttnRes mode")
    a.set_ylabel("KiB per token (bf16, log scale)")
    a.set_title("bytes per token (analytic)", fontsize=9)
    a.legend(fontsize=7)
    a.grid(axis="y", alpha=0.3)
    a = axes[2]
    a.bar(x, [costs[m]["flops_per_token"] / 1e6 for m in modes], width=0.6, color="C3", label="4 S d per mix, summed")
    a.set_xticks(x, modes)
    a.set_xlabel("AttnRes mode")
    a.set_ylabel("mix MFLOP per token (forward)")
    a.set_title("mix FLOPs per token (analytic)", fontsize=9)
    a.legend(fontsize=7)
    a.grid(axis="y", alpha=0.3)
    col = 3
    if latency:
        a = axes[col]
        col += 1
        a.bar(range(len(latency)), [r["ms"] for r in latency], color="C5", label="min of runs")
        a.plot(range(len(latency)), [r["ms_median"] for r in latency], "kD", ls="none", label="median")
        a.set_xticks(range(len(latency)), [r["mode"] for r in latency])
        a.set_xlabel("AttnRes mode")
        a.set_ylabel(f"CPU forward ms, [1, {latency[0]['tokens']}] tokens")
        a.set_title("CPU forward (the measured stand-in config)", fontsize=9)
        a.legend(fontsize=7)
        a.grid(axis="y", alpha=0.3)
    if depth or depth_gpu:
        a = axes[col]
        col += 1
        runs = [
            (d, label)
            for d, label in (
                (depth, f"CPU, fp32, {(depth or {}).get('tokens', '?')} tokens"),
                (
                    depth_gpu,
                    f"{(depth_gpu or {}).get('device', 'GPU')}, bf16, {(depth_gpu or {}).get('tokens', '?')} tokens",
                ),
            )
            if d
        ]
        dmodes = [r["mode"] for r in runs[0][0]["rows"]]
        w = 0.8 / len(runs)
        for j, (d, label) in enumerate(runs):
            by_mode = {r["mode"]: r for r in d["rows"]}
            base = by_mode["none"]["saved_bytes_per_token"]
            xs = [i + (j - (len(runs) - 1) / 2) * w for i in range(len(dmodes))]
            vals = [by_mode[m]["saved_bytes_per_token"] / base if m in by_mode else np.nan for m in dmodes]
            a.bar(xs, vals, width=w, color=f"C{6 + j}", label=label)
            _bar_labels(a, xs, vals, "{:.2f}x")
        a.axhline(1.0, color="k", ls=":", lw=1)
        a.set_xticks(range(len(dmodes)), dmodes)
        a.set_xlabel("AttnRes mode")
        a.set_ylabel("activations saved for backward / none's")
        first = runs[0][0]
        a.set_title(f"at depth: {first['layers']} layers, d = {first['hidden_size']} (measured)", fontsize=9)
        a.legend(fontsize=7, loc="upper left")
        a.grid(axis="y", alpha=0.3)
    if gpu_rows:
        a = axes[col]
        kinds = [
            (k, label)
            for k, label in (
                ("train_overhead", "training step"),
                ("decode_overhead", "decode step, CUDA graph"),
                ("decode_overhead_compiled", "decode step, compiled + CUDA graph"),
            )
            if any(isinstance(r.get(k), (int, float)) for r in gpu_rows)
        ]
        w = 0.8 / max(len(kinds), 1)
        for j, (k, label) in enumerate(kinds):
            xs = [i + (j - (len(kinds) - 1) / 2) * w for i in range(len(gpu_rows))]
            vals = [100 * r[k] if isinstance(r.get(k), (int, float)) else np.nan for r in gpu_rows]
            a.bar(xs, vals, width=w, color=f"C{j}", label=label)
            _bar_labels(a, xs, vals, "{:+.1f}%")
        a.axhline(0.0, color="k", lw=0.8)
        a.set_xticks(range(len(gpu_rows)), [r["mode"] for r in gpu_rows])
        a.set_xlabel("AttnRes mode")
        a.set_ylabel("time over none's (%)")
        devices = sorted({f["device"] for f in gpu.get("files", []) if f.get("read")})
        where = ", ".join(devices) or "GPU"
        a.set_title(f"overhead on {where}: {gpu_config or 'the benchmark config'}, not this config", fontsize=9)
        a.legend(fontsize=7)
        a.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)
