"""The planner's report: layouts compared, predictions set beside every measurement we have, and the balance terms
checked against simulated routing at the model's scale."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from k3.config import K3Config, get_preset
from k3.plan import calibration, cost
from k3.plan.cluster import cluster as make_cluster
from k3.plan.loads import simulate_routing
from k3.plan.placement import contiguous, min_slots, place
from k3.tables import markdown_table
from k3.plan.plan import (
    Serving,
    Training,
    decode_step,
    expected_max_over_mean,
    plan_serving,
    plan_training,
    serving_memory,
)


def compare(
    config: K3Config,
    shares: np.ndarray,
    work: Serving,
    gpus=(8, 16, 64, 128),
    hbm_gib: float = 141.0,
    precisions=("bf16", "mxfp4"),
) -> list[dict]:
    """One row per (GPUs, expert precision, replication): fits or the shortfall, the layout, the decode step and
    its terms."""
    rows = []
    for g in gpus:
        c = make_cluster(gpus=g, hbm_gib=hbm_gib)
        for precision in precisions:
            for extra in (0, 1):
                p = plan_serving(config, c, precision, work, shares, replicas=extra, placements=False)
                row = {"gpus": g, "experts": precision, "replica_slots": extra, "fits": p["fits"]}
                if not p["fits"]:
                    row["shortfall_gib_per_gpu"] = p["shortfall_gib"]
                else:
                    d = p["decode"]
                    row |= {
                        "tp": p["layout"]["tensor_parallel"],
                        "gib_per_gpu": p["memory_gib"]["total"],
                        "max_over_mean": p["load"]["max_over_mean_after"]["mean"],
                        "step_ms": d["step_s"] * 1e3,
                        "tokens_per_s": d["tokens_per_s"],
                        "weights_caches_ms": (d["dense_weights_s"] + d["caches_s"]) * 1e3,
                        "experts_ms": d["experts_s"] * 1e3,
                        "all_to_all_ms": d["all_to_all_s"] * 1e3,
                        "all_to_all_full_width_ms": d["all_to_all_full_width_s"] * 1e3,
                        "straggler_ms": d["straggler_s"] * 1e3,
                        "overhead_ms": d["layer_overhead_s"] * 1e3,
                    }
                rows.append(row)
    return rows


def _one_gpu_decode_s(cfg: K3Config, weights: str, bandwidth: float, batch: int, context: int) -> float:
    """The cost model's decode step on one GPU of ``bandwidth`` bytes/s (memory unbounded), uniform routing."""
    shape = cost.model_shape(cfg)
    c = make_cluster(gpus=1, hbm_bytes_per_s=bandwidth, hbm_gib=1e6)
    work = Serving(concurrency=batch, contexts=((context, 1.0),))
    uniform = np.full((shape.moe_layers, shape.experts), 1 / shape.experts)
    mem = serving_memory(shape, c, weights, work, 1, shape.experts)
    return decode_step(shape, c, weights, work, 1, [contiguous(f, 1) for f in uniform], uniform, mem)["step_s"]


def validate(measured: dict | None = None) -> list[dict]:
    """Predicted vs measured for every run of ``measured`` (k3.plan.calibration; default the packaged one): rows
    say which results file and what was calibrated."""
    measured = calibration.load() if measured is None else measured
    _read = measured.get
    rows: list[dict] = []
    targets = _read("decode-targets.json")
    if targets:
        from k3.config.presets import kimi_linear_1p3b

        bw = targets["meta"]["copy_bandwidth_TBps"] * 1e12
        for r in targets["rows"]:
            cfg = kimi_linear_1p3b(full_mla=r["model"].startswith("full-MLA"))
            step_s = _one_gpu_decode_s(cfg, "bf16", bw, r["batch"], r["context"])
            rows.append(
                {
                    "run": f"decode {r['model']}, B={r['batch']}, context {r['context']}, 1 H200",
                    "predicted": f"{step_s * 1e3:.3f} ms",
                    "measured": f"{r['ms_per_step']:.3f} ms",
                    "ratio": step_s * 1e3 / r["ms_per_step"],
                    "note": "calibrates the per-layer overhead" if r["batch"] == 1 else "",
                    "source": "decode-targets.json",
                }
            )
    train = _read("model-train-precision.json")
    if train:
        cfg = get_preset("small-1b")
        shape = cost.model_shape(cfg)
        p = plan_training(
            cfg,
            make_cluster(gpus=1),
            Training(global_tokens=8 * 4096, seq_len=4096, micro_tokens=8 * 4096, checkpointing=False),
            np.full((shape.moe_layers, shape.experts), 1 / shape.experts),
        )
        measured = train["rows"][-1]["ms"]
        rows.append(
            {
                "run": "training step small-1b, 8 x 4096, 1 H200",
                "predicted": f"{p['step']['step_s'] * 1e3:.0f} ms",
                "measured": f"{measured:.0f} ms",
                "ratio": p["step"]["step_s"] * 1e3 / measured,
                "note": "the roofline counts matmuls, Muon and nothing else: KDA, MLA attention, short convs "
                "and element-wise work are the rest",
                "source": "model-train-precision.json",
            }
        )
    floor = _read("model-train-peer-floor.json")
    if floor and train:
        parts = {r["case"]: r["ms"] for r in floor["rows"]}
        ns = next((v for k, v in parts.items() if "Newton-Schulz" in k), None)
        mm = next((v for k, v in parts.items() if "matrix products" in k), None)
        if ns is not None:
            rows.append(
                {
                    "run": "Newton-Schulz of every Muon matrix, small-1b, 1 H200",
                    "predicted": f"{p['step']['newton_schulz_s'] * 1e3:.1f} ms",
                    "measured": f"{ns:.1f} ms",
                    "ratio": p["step"]["newton_schulz_s"] * 1e3 / ns,
                    "note": "at the measured bf16 rate",
                    "source": "model-train-peer-floor.json",
                }
            )
        if mm is not None:
            pred = p["step"]["dense_flops_s"] + p["step"]["expert_flops_s"]
            rows.append(
                {
                    "run": "matrix products of a small-1b step at 100% of the bf16 rate, 1 H200",
                    "predicted": f"{pred * 1e3:.1f} ms",
                    "measured": f"{mm:.1f} ms",
                    "ratio": pred * 1e3 / mm,
                    "note": "ours adds attention FLOPs and prices experts at the grouped-GEMM rate",
                    "source": "model-train-peer-floor.json",
                }
            )
    multi = _read("multi_gpu.json")
    if multi:
        cfg = get_preset("small-1b")
        shape = cost.model_shape(cfg)
        run = multi["rows"][1]
        per_rank = 8 * 2048 / 2 * shape.top_k * shape.moe_layers
        rows.append(
            {
                "run": "expert-parallel rows received per rank per step, small-1b, 2 H200s, EP 2",
                "predicted": f"{per_rank:,.0f}",
                "measured": " / ".join(f"{x:,}" for x in run["ep_rows_per_rank_mean"]),
                "ratio": per_rank / float(np.mean(run["ep_rows_per_rank_mean"])),
                "note": "tokens x top-k x MoE layers / ranks",
                "source": "multi_gpu.json",
            }
        )
        c2 = make_cluster(gpus=2, gpus_per_node=2)
        pred = 4 * shape.moe_layers * cost.all_to_all_time(8 * 2048 / 2 * shape.top_k * 2 * shape.expert_width, c2)
        rows.append(
            {
                "run": "all-to-all time per training step, small-1b, 2 H200s, EP 2",
                "predicted": f"{pred * 1e3:.1f} ms",
                "measured": f"{run['a2a_s_median'] * 1e3:.0f} ms",
                "ratio": pred / run["a2a_s_median"],
                "note": "measured includes waiting for the other rank and 88 small calls: the fabric term "
                "alone is far below it. Not calibrated: plans mark the all-to-all so and straggler shares "
                "leave it out",
                "source": "multi_gpu.json",
            }
        )
    sliced = _read("slice.json")
    if sliced:
        cfg = get_preset("k3-slice")
        bw = sliced["meta"]["copy_bandwidth_TBps"] * 1e12
        for r in sliced["rows"]:
            if (
                r.get("phase") != "decode"
                or "ms" not in r
                or (r["batch"], r["context"]) not in ((1, 4096), (64, 32768))
            ):
                continue
            step_s = _one_gpu_decode_s(cfg, "mxfp4", bw, r["batch"], r["context"])
            rows.append(
                {
                    "run": f"decode k3-slice, MXFP4 experts, CUDA graph, B={r['batch']}, context {r['context']}, "
                    "1 H200",
                    "predicted": f"{step_s * 1e3:.2f} ms",
                    "measured": f"{r['ms']:.2f} ms",
                    "ratio": step_s * 1e3 / r["ms"],
                    "note": "K3's widths; per-layer overhead as calibrated on the small model",
                    "source": "slice.json",
                }
            )
    return rows


def simulate_balance(
    config: K3Config, gpus: int, s: float, tokens_per_step: int, steps: int = 8, seed: int = 0
) -> dict:
    """Route simulated tokens at the model's scale (E experts, top-k, popularity rank^-s): shares from one long run
    (what router logs give), a placement from them, then per-step loads of fresh steps on that placement (a
    replicated expert's slots split uniformly at random among its replicas). Returns the planner's expected
    max / mean per step (:func:`k3.plan.plan.expected_max_over_mean`) beside the simulated one, before and after
    the placement."""
    moe = config.moe
    e, k = moe.num_experts, moe.num_experts_per_token
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, e + 1, dtype=torch.float64)
    log_w = (-s * ranks.log())[torch.randperm(e, generator=g)]
    logged = simulate_routing(log_w, 16 * tokens_per_step, k, g).double()
    shares = (logged / logged.sum()).numpy()
    slots = min_slots(e, gpus)
    out = {"experts": e, "top_k": k, "gpus": gpus, "zipf": s, "tokens_per_step": tokens_per_step, "steps": steps}
    rng = np.random.default_rng(seed)
    for name, p in (
        ("contiguous", contiguous(shares, gpus)),
        ("placed", place(shares, gpus, 8, slots, False)),
        ("replicated", place(shares, gpus, 8, slots + 1, True)),
    ):
        where = {}  # expert -> its GPUs
        for gpu, xs in enumerate(p.gpu_experts):
            for j in xs:
                where.setdefault(j, []).append(gpu)
        ratios = []
        for _ in range(steps):
            counts = simulate_routing(log_w, tokens_per_step, k, g).numpy()
            load = np.zeros(gpus)
            for j, n in enumerate(counts):
                if n:
                    load += np.bincount(rng.choice(where[j], size=int(n)), minlength=gpus)
            ratios.append(load.max() / load.mean())
        out[name] = {
            "predicted": expected_max_over_mean(p, tokens_per_step * k),
            "simulated": float(np.mean(ratios)),
            "expected_shares_only": p.max_over_mean,
        }
    return out


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fitted = [r for r in rows if r["fits"]]
    if not fitted:
        return
    terms = [
        ("weights_caches_ms", "dense weights + caches"),
        ("experts_ms", "experts"),
        ("all_to_all_ms", "all-to-all (latent rows)"),
        ("overhead_ms", "per-layer launch chain"),
    ]
    labels = [f"{r['gpus']} GPUs\n{r['experts']}{' +rep' if r['replica_slots'] else ''}" for r in fitted]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(fitted)), 4))
    bottom = np.zeros(len(fitted))
    for key, label in terms:
        vals = np.array([r[key] for r in fitted])
        ax.bar(labels, vals, bottom=bottom, label=label)
        bottom += vals
    ax.set_ylabel("predicted decode step (ms)")
    ax.set_title("decode step per layout, by term")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    config: K3Config,
    shares: np.ndarray,
    work: Serving,
    out: Path,
    plans: dict[int, dict],
    zipf: float,
    measured: dict | None = None,
) -> Path:
    """``out``/report.md (+ decode_terms.png, plans.json): the plans given (GPUs -> plan), the layout comparison,
    predicted vs ``measured`` (k3.plan.calibration, default the packaged one), and the simulated balance check."""
    out.mkdir(parents=True, exist_ok=True)
    rows = compare(config, shares, work)
    _plot(rows, out / "decode_terms.png")
    checks = validate(measured)
    sim = simulate_balance(config, 64, zipf, 4096)
    parts = [
        f"# Placement of {config.name}\n",
        f"Workload: {work.concurrency} sequences decoding together, mean context {work.mean_context:,.0f} "
        f"tokens; expert popularity rank^-{zipf:g} (Zipf, assumed), experts shuffled per layer.\n",
    ]
    for g, p in sorted(plans.items()):
        parts.append(f"## {g} GPUs\n")
        if not p["fits"]:
            parts.append(p["why"] + "\n")
            continue
        lay, mem, d = p["layout"], p["memory_gib"], p["decode"]
        parts.append(
            f"Layout: expert parallel {lay['expert_parallel']}, attention tensor parallel "
            f"{lay['tensor_parallel']} x data parallel {lay['data_parallel']}, {lay['expert_slots_per_gpu']} "
            f"expert slots per GPU per layer ({lay['replica_slots_per_gpu']} for replicas).\n"
        )
        parts.append(markdown_table([{k: v for k, v in mem.items()}], [k for k in mem if k != "fits"]) + "\n")
        parts.append(
            "Decode step (ms): "
            + ", ".join(f"{k[:-2]} {v * 1e3:.2f}" for k, v in d.items() if k.endswith("_s") and k != "tokens_per_s")
            + f"; {d['tokens_per_s']:,.0f} tokens/s.\n"
        )
        load = p["load"]
        parts.append(
            f"Load max / mean per GPU (mean over layers): {load['max_over_mean_before']['mean']:.3f} in "
            f"contiguous blocks, {load['max_over_mean_after']['mean']:.3f} placed.\n"
        )
    parts.append("## Layouts compared\n")
    parts.append(
        markdown_table(
            rows,
            [
                "gpus",
                "experts",
                "replica_slots",
                "fits",
                "shortfall_gib_per_gpu",
                "tp",
                "gib_per_gpu",
                "max_over_mean",
                "step_ms",
                "tokens_per_s",
                "weights_caches_ms",
                "experts_ms",
                "all_to_all_ms",
                "all_to_all_full_width_ms",
                "straggler_ms",
                "overhead_ms",
            ],
        )
        + "\n"
    )
    parts.append("![decode terms](decode_terms.png)\n")
    parts.append("## Predicted vs measured\n")
    parts.append(markdown_table(checks, ["run", "predicted", "measured", "ratio", "note", "source"]) + "\n")
    parts.append("## Balance terms against simulated routing\n")
    sim_rows = [{"placement": name, **sim[name]} for name in ("contiguous", "placed", "replicated")]
    parts.append(
        f"{sim['experts']} experts, top-{sim['top_k']}, {sim['gpus']} GPUs, {sim['tokens_per_step']} tokens "
        f"per step, popularity rank^-{sim['zipf']:g}, {sim['steps']} simulated steps: max / mean "
        "token-slots per GPU.\n"
    )
    parts.append(markdown_table(sim_rows, ["placement", "expected_shares_only", "predicted", "simulated"]) + "\n")
    sources = make_cluster(gpus=1).sources
    parts.append("## Where the rates come from\n")
    parts.append("\n".join(f"- {k}: {v}" for k, v in sources.items()) + "\n")
    parts.append(
        f"- per-layer decode overhead {cost.LAYER_OVERHEAD_S * 1e6:.1f} us: measured (decode-targets.json, "
        "B=1 / 4K)\n- grouped GEMM "
        + ", ".join(f"{r / 1e12:.0f} TFLOP/s at {t} tokens per expert" for t, r in cost.GROUPED_GEMM)
        + ": measured\n- workspace "
        f"{cost.WORKSPACE_GIB:g} GiB per GPU: assumed\n- all-to-alls and compute do not overlap: assumed\n"
        "- all-to-all time: bytes at the fabric rates plus one latency, not calibrated (the measured 2-GPU "
        "all-to-all above is far slower)\n"
    )
    (out / "report.md").write_text("\n".join(parts))
    (out / "plans.json").write_text(
        json.dumps(
            {
                "plans": {str(g): {k: v for k, v in p.items() if k != "placement"} for g, p in plans.items()},
                "compare": rows,
                "validation": checks,
                "simulation": sim,
            },
            indent=1,
            default=_num,
        )
    )
    return out / "report.md"


def _num(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    raise TypeError(type(x))
