"""``k3 plan``: where a model's weights, experts and caches go on a cluster of GPUs, and what a step costs.

    k3 plan --preset k3 --gpus 64 --hbm-gib 141 [--precision mxfp4] [--concurrency 1024 --context 32768]
            [--loads RUN_DIR | RUNS_DIR | --zipf 0.5] [--workload serve|train] [--json] [--report DIR]
            [--placement FILE]

Prints the layout, each GPU's memory, the expert load before and after placement, and the predicted step with
every term; exits 1 when the model does not fit, saying by how much. ``--placement FILE`` writes the serving
plan's expert placement for ``k3 serve --ep GPUS --placement FILE`` (k3.distributed.placement). With ``--loads``
naming a directory of training runs (a grid), plans once per run and prints the straggler table (k3.plan.runs);
there a cluster the model does not fit is an error (exit 2), since no row could be planned.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from k3.config import PRESETS, get_preset
from k3.config.hf import from_hf_config
from k3.plan.cluster import PROFILES, cluster

if TYPE_CHECKING:
    from k3.plan.plan import Serving, Training


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="k3", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--config", help="a config.json (a checkpoint's) instead of --preset")
    p.add_argument("--profile", help=f"cluster profile: {', '.join(PROFILES)}")
    p.add_argument("--gpus", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--hbm-gib", type=float, help="memory per GPU (GiB)")
    p.add_argument("--hbm-tbps", type=float, help="HBM bandwidth per GPU (TB/s)")
    p.add_argument("--intra-gbps", type=float, help="all-to-all bandwidth inside a node per GPU (GB/s)")
    p.add_argument("--inter-gbps", type=float, help="all-to-all bandwidth across nodes per GPU (GB/s)")
    p.add_argument("--intra-latency-us", type=float)
    p.add_argument("--inter-latency-us", type=float)
    p.add_argument("--precision", choices=("mxfp4", "bf16"), default="mxfp4", help="routed experts' storage")
    p.add_argument("--workload", choices=("serve", "train"), default="serve")
    p.add_argument("--concurrency", type=int, default=1024, help="sequences decoding together (serve)")
    p.add_argument(
        "--context",
        default="32768",
        help="context length, or a distribution LEN:FRACTION,... e.g. 4096:0.7,131072:0.3 (serve)",
    )
    p.add_argument("--prefix-hit", type=float, default=0.0, help="fraction of prompt tokens the prefix cache serves")
    p.add_argument("--global-tokens", type=int, default=4 * 2**20, help="tokens per optimizer step (train)")
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length (train)")
    p.add_argument("--micro-tokens", type=int, default=4096, help="tokens per GPU per micro-batch (train)")
    p.add_argument("--no-checkpointing", action="store_true", help="train without activation checkpointing")
    p.add_argument(
        "--loads",
        help="expert loads: a training run directory (expert_loads.json), a JSON of counts, or a directory of runs "
        "(a k3 ablate grid: one row per run, the straggler's time and share of the step)",
    )
    p.add_argument(
        "--zipf",
        type=float,
        default=0.5,
        help="without --loads: expert popularity rank^-s (0 = uniform; serving default 0.5, assumed; "
        "training uses uniform, what Quantile Balancing holds, unless --loads)",
    )
    p.add_argument("--tp", type=int, help="attention tensor-parallel degree (default: searched)")
    p.add_argument("--replicas", type=int, help="extra expert slots per GPU per layer for replicas (default: searched)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON, with every layer's placement")
    p.add_argument(
        "--placement",
        metavar="FILE",
        help="write the serving plan's expert placement to FILE (JSON), for k3 serve --ep GPUS --placement FILE",
    )
    p.add_argument(
        "--calibration",
        help="measured runs the --report sets its predictions beside (a JSON written by "
        "benchmarks/plan_calibration.py; default: the one shipped with k3)",
    )
    p.add_argument(
        "--report",
        help="write DIR/report.md: the plan on 64 and 128 GPUs, layouts compared, "
        "predicted vs measured, the simulated balance check (with --loads RUNS: DIR/straggler-WORKLOAD-GPUS.md and "
        ".json, the per-run table)",
    )


def _contexts(text: str) -> tuple:
    try:
        if ":" not in text:
            return ((int(text), 1.0),)
        return tuple((int(c), float(f)) for c, f in (part.split(":") for part in text.split(",")))
    except ValueError:
        raise ValueError(f"--context={text!r}: give LENGTH or LENGTH:FRACTION,... (e.g. 4096:0.7,131072:0.3)") from None


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from k3.plan.cost import model_shape
    from k3.plan.loads import read_loads, zipf_shares
    from k3.plan.plan import plan_serving, summary
    from k3.plan.runs import is_runs_dir

    config = from_hf_config(json.loads(Path(args.config).read_text())) if args.config else get_preset(args.preset)
    if args.calibration and not (args.report and args.workload == "serve"):
        raise ValueError("--calibration applies to the serving --report only")
    if args.placement and (args.workload != "serve" or (args.loads and is_runs_dir(args.loads))):
        raise ValueError("--placement writes one serving plan's placement: not with --workload train or a runs --loads")
    if args.report:  # read (and check) what the report compares with before planning anything
        from k3.plan import calibration

        measured = calibration.load(args.calibration)
    if config.moe is None or not config.moe_layers:
        raise ValueError(f"{config.name} has no MoE layers: nothing to place")
    c = cluster(
        args.profile,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        hbm_gib=args.hbm_gib,
        hbm_bytes_per_s=args.hbm_tbps and args.hbm_tbps * 1e12,
        intra_bytes_per_s=args.intra_gbps and args.intra_gbps * 1e9,
        inter_bytes_per_s=args.inter_gbps and args.inter_gbps * 1e9,
        intra_latency_s=args.intra_latency_us and args.intra_latency_us * 1e-6,
        inter_latency_s=args.inter_latency_us and args.inter_latency_us * 1e-6,
    )
    shape = model_shape(config)
    work = _work(args)
    if args.loads and is_runs_dir(args.loads):
        return _runs(args, config, c, work)
    if args.loads:
        shares = read_loads(args.loads, shape.moe_layers, shape.experts).numpy()
    elif args.workload == "train":
        shares = np.full((shape.moe_layers, shape.experts), 1 / shape.experts)
    else:
        shares = zipf_shares(shape.moe_layers, shape.experts, shape.top_k, args.zipf).numpy()
    plan = _plan(args, config, c, work, shares)
    if args.workload == "serve" and args.report:
        from k3.plan.report import write_report

        plans = {
            g: plan_serving(config, cluster(gpus=g, hbm_gib=c.hbm_gib), args.precision, work, shares, placements=False)
            for g in (64, 128)
        }
        path = write_report(config, shares, work, Path(args.report), plans, args.zipf, measured)
        print(f"report: {path}")
    # training keeps bf16 master weights and optimizer state: --precision (experts' storage) is a serving choice
    precision = {"precision": args.precision} if args.workload == "serve" else {}
    plan = {"model": config.name, "workload": args.workload, **precision, **plan}
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        _print(summary(plan), c)
    if args.placement and plan["fits"]:
        from k3.distributed.placement import ExpertPlacement, write_placement

        layers = [p["gpu_experts"] for p in plan["placement"]]
        path = write_placement(args.placement, ExpertPlacement(shape.experts, layers, config.name))
        print(f"placement: {path} (k3 serve --ep {c.gpus} --placement {path})", file=sys.stderr)
    elif args.placement:
        print(f"placement: {args.placement} not written (the model does not fit)", file=sys.stderr)
    return 0 if plan["fits"] else 1


def _work(args: argparse.Namespace) -> Training | Serving:
    from k3.plan.plan import Serving, Training

    if args.workload == "train":
        return Training(args.global_tokens, args.seq_len, args.micro_tokens, not args.no_checkpointing)
    return Serving(args.concurrency, _contexts(args.context), args.prefix_hit)


def _plan(args: argparse.Namespace, config, c, work: Training | Serving, shares, placements: bool = True) -> dict:
    """The training or serving plan of ``work`` under expert shares [MoE layers, experts]."""
    from k3.plan.plan import Training, plan_serving, plan_training

    if isinstance(work, Training):
        return plan_training(config, c, work, shares)
    return plan_serving(
        config, c, args.precision, work, shares, tp=args.tp, replicas=args.replicas, placements=placements
    )


def _runs(args: argparse.Namespace, config, c, work: Training | Serving) -> int:
    """--loads over a directory of runs: the per-run straggler table (k3.plan.runs)."""
    from k3.plan.cost import model_shape
    from k3.plan.runs import plan_runs, runs_markdown
    from k3.plan.stragglers import step_stragglers

    shape = model_shape(config)
    plan_one = lambda shares: _plan(args, config, c, work, shares, placements=False)  # noqa: E731
    per_step = None
    if args.workload == "train":  # training micro-batches' counts say nothing of a decode step's
        per_step = lambda loads: step_stragglers(loads, c.gpus, "placed", c.per_node)  # noqa: E731
    rows = plan_runs(args.loads, shape.moe_layers, shape.experts, plan_one, per_step)
    what = "training step" if args.workload == "train" else f"decode step, {args.precision} experts"
    title = f"Straggler of {config.name} on {c.gpus} GPUs ({c.hbm_gib:g} GiB each), {what}, under each run's loads"
    command = "k3 " + shlex.join(args.argv)
    md = runs_markdown(rows, title, command, str(work))
    meta = {"model": config.name, "workload": args.workload, "gpus": c.gpus, "hbm_gib": c.hbm_gib, "work": vars(work)}
    result = json.dumps({"meta": meta, "command": command, "rows": rows}, indent=1)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"straggler-{args.workload}-{c.gpus}"
        stem.with_suffix(".json").write_text(result + "\n")
        stem.with_suffix(".md").write_text(md)
        print(f"report: {stem}.md", file=sys.stderr)
    print(result if args.json else md.rstrip("\n"))
    return 0


def _print(plan: dict, c) -> None:
    print(
        f"{plan['model']} on {c.gpus} GPUs ({c.nodes} nodes of {c.per_node}, {c.hbm_gib:g} GiB each), "
        f"{plan['workload']}" + (f", {plan['precision']} experts" if "precision" in plan else "")
    )
    print("layout: " + ", ".join(f"{k} {v}" for k, v in plan["layout"].items()))
    print(
        "memory per GPU (GiB): "
        + ", ".join(f"{k} {v:.1f}" for k, v in plan["memory_gib"].items() if isinstance(v, float))
    )
    if not plan["fits"]:
        short = -plan["memory_gib"]["headroom"]
        print(f"does not fit: {plan.get('why') or f'short by {short:.1f} GiB per GPU'}")
        return
    load = plan["load"]
    print(
        f"expert load max / mean per GPU: {load['max_over_mean_before']['mean']:.3f} in contiguous blocks -> "
        f"{load['max_over_mean_after']['mean']:.3f} placed (worst layer {load['max_over_mean_after']['worst']:.3f})"
    )
    step = plan.get("decode") or plan["step"]
    terms = ", ".join(f"{k[:-2]} {v * 1e3:.2f}" for k, v in step.items() if k.endswith("_s") and k != "tokens_per_s")
    print(f"{'decode' if 'decode' in plan else 'training'} step (ms): {terms}")
    from k3.plan.plan import ALL_TO_ALL_CALIBRATED, without_all_to_all

    if not ALL_TO_ALL_CALIBRATED:
        straggler, rest = without_all_to_all(step)
        print(
            "all-to-all: uncalibrated (the measured 2-GPU all-to-all is far slower than this model's; docs/plan.md); "
            f"without it the step is {rest * 1e3:.2f} ms, its straggler {straggler * 1e3:.2f} ms"
        )
    print(f"tokens/s: {step['tokens_per_s']:,.0f}" + (f", MFU {step['mfu']:.3f}" if "mfu" in step else ""))
