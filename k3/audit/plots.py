"""PNG figures of ``k3 audit`` (matplotlib, Agg backend, one function per figure)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
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
    ax.legend(handles=[Patch(color=c, label=k.upper()) for k, c in MIXER_COLOURS.items()]
              + [Patch(color=c, label=k) for k, c in FFN_COLOURS.items()],
              loc="upper center", bbox_to_anchor=(0.5, 1.45), ncol=4, fontsize=8, frameon=False)
    ax.set_title(title, fontsize=9, pad=22)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    _save(fig, path)


def params_by_path(paths: dict, title: str, path: Path) -> None:
    rows = {k: v for k, v in paths["rows"].items() if v["total"] > 0}
    names = list(rows)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    y = range(len(names))
    a1.barh([i + 0.2 for i in y], [rows[k]["total"] for k in names], height=0.4, label="total")
    a1.barh([i - 0.2 for i in y], [max(rows[k]["activated"], 1) for k in names], height=0.4, label="activated / token")
    a1.set_xscale("log")
    a1.set_yticks(list(y), names)
    a1.set_xlabel("parameters")
    a1.legend(fontsize=8)
    a1.grid(axis="x", alpha=0.3)
    a2.barh([i + 0.2 for i in y], [rows[k]["weight_bytes"] / GiB for k in names], height=0.4,
            label="weight GiB read / token (bf16, batch 1)")
    a2.barh([i - 0.2 for i in y], [rows[k]["flops"] / 1e9 for k in names], height=0.4,
            label=f"GFLOP / token (context {paths['context']})")
    a2.set_yticks(list(y), names)
    a2.legend(fontsize=8, loc="lower right")
    a2.grid(axis="x", alpha=0.3)
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
            a1.annotate(f"{r['distinct_per_layer']:.0f}", (r["batch"], r["distinct_per_layer"]),
                        textcoords="offset points", xytext=(-10, 6), fontsize=8)
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
            a.plot([r["tokens"] for r in rs], [max(r[f"overflow_cf{cf}"], 1e-9) for r in rs], ls, marker="o",
                   color=f"C{i + 1}", label=f"{m}, cf {cf} (sim)")
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
        a.annotate(f"{r['distinct_ranks']:.2f} ranks", (i, r["bytes_x"] / 1024), ha="center",
                   textcoords="offset points", xytext=(0, 3), fontsize=8)
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
                a.plot([r["tokens"] for r in rs], [r[key] for r in rs], ls, marker="o", color=f"C{i}" if i else "k",
                       label=f"{m}, EP {ep}")
            if f"{key}_random_placement" in rs[0]:
                a.plot([r["tokens"] for r in rs], [r[f"{key}_random_placement"] for r in rs], ls, marker="x",
                       color=f"C{i}", alpha=0.5, label=f"{m}, EP {ep}, random placement")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("tokens per step")
    a.set_ylabel("max / mean rank load (= MoE step time / balanced)")
    a.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def long_context(lc: dict, title: str, path: Path, cpu: dict | None = None) -> None:
    curve = lc["curve"]
    measured = lc.get("measured_gpu")
    panels = 1 + bool(measured) + bool(cpu)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    a = axes[0, 0]
    for key, label in (("hybrid", f"{lc['label']} (KDA state + MLA latents)"), ("full_mla", "full-MLA twin"),
                       ("full_mha", "full-MHA twin")):
        a.plot(curve["context"], [v / GiB for v in curve[key]], label=label)
    x = lc.get("crossovers")
    if x and x["hybrid_vs_full_mla"] < 2**21:
        a.axvline(x["hybrid_vs_full_mla"], color="grey", ls=":")
        a.annotate(f"hybrid < full-MLA above {x['hybrid_vs_full_mla'] / 1000:.1f}K",
                   (x["hybrid_vs_full_mla"], min(curve["hybrid"]) / GiB),
                   textcoords="offset points", xytext=(4, 4), fontsize=8)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("context (tokens)")
    a.set_ylabel("GiB per sequence")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    col = 1
    if measured:
        a = axes[0, col]
        col += 1
        rows = [r for r in measured["rows"] if r["valid"] and "context" in r and "tokens_per_s" in r]
        groups = sorted({(r["model"], r["batch"]) for r in rows})
        batches = sorted({b for _, b in groups})
        for model, b in groups:
            rs = sorted((r for r in rows if r["model"] == model and r["batch"] == b), key=lambda r: r["context"])
            if len(rs) > 1:
                a.plot([r["context"] for r in rs], [r["tokens_per_s"] for r in rs],
                       "o-" if "hybrid" in model else "s--", color=f"C{batches.index(b)}", label=f"{model}, B={b}")
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("context (tokens)")
        a.set_ylabel("decode tokens/s")
        a.set_title(f"measured on {measured['device']} ({measured['time']})", fontsize=9)
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    if cpu:
        a = axes[0, col]
        rows = cpu["rows"]
        labels = [f"{r['model']}\nB={r['batch']}" for r in rows]
        a.bar(range(len(rows)), [r["decode_tokens_per_s"] for r in rows])
        a.set_xticks(range(len(rows)), labels, fontsize=7)
        a.set_ylabel("decode tokens/s")
        a.set_title(f"measured on CPU ({cpu['config_name']}, prompt {cpu['prompt']})", fontsize=9)
        a.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def attn_res(costs: dict, title: str, path: Path, latency: list[dict] | None = None) -> None:
    panels = 2 + bool(latency)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    a = axes[0]
    for mode, c in costs.items():
        a.plot(range(len(c["sources_per_mix"])), c["sources_per_mix"], label=mode)
    a.set_yscale("log")
    a.set_xlabel("mix index (2 per layer: attention, FFN; then the output mix)")
    a.set_ylabel("depth sources S")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    a = axes[1]
    modes = list(costs)
    x = range(len(modes))
    a.bar([i - 0.27 for i in x], [costs[m]["live_bytes_per_token"] / 1024 for m in modes], width=0.27,
          label="live sources, KiB / token")
    pp = max(next(iter(costs.values()))["pipeline"] or [0])
    if pp:
        a.bar([i for i in x], [costs[m]["pipeline"][pp]["max_bytes_per_token"] / 1024 for m in modes], width=0.27,
              label=f"max stage-boundary KiB / token (PP={pp})")
    a.bar([i + 0.27 for i in x], [costs[m]["flops_per_token"] / 1e6 for m in modes], width=0.27,
          label="mix MFLOP / token")
    a.set_yscale("log")
    a.set_ylim(bottom=1)
    a.set_xticks(list(x), modes)
    a.legend(fontsize=7)
    a.grid(axis="y", alpha=0.3)
    if latency:
        a = axes[2]
        a.bar(range(len(latency)), [r["ms"] for r in latency])
        a.set_xticks(range(len(latency)), [r["mode"] for r in latency])
        a.set_ylabel(f"CPU forward ms ([1, {latency[0]['tokens']}] tokens, best of runs)")
        a.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)
