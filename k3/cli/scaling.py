"""``k3 scaling``: fit L(C) per architecture and the compute multiplier over a baseline (with a plot).

``k3 scaling --runs DIR --out DIR`` fits the training runs found under DIR (any directory holding
``train_config.json`` + ``metrics.jsonl``); ``k3 scaling --sweep NAME --out DIR`` first trains the sweep's
sizes x architectures into ``OUT/runs`` (resumable), then fits them; ``--from-results`` refits the runs that
``OUT/scaling.json`` records. Runs of one arm and size at several learning rates or tokens per parameter (a sweep
with ``lrs`` / ``ratios``) get the design report instead (:mod:`k3.audit.scaling_design`: ``OUT/design.md``,
``design.json``, ``design.png``; ``--from-results`` reads ``OUT/design.json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3.audit.sweeps import SWEEPS, get_sweep, run_sweep  # (--sweep's choices are its SWEEPS)
from k3.cli.ablate import add_run_flags
from k3.cli.threads import set_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--runs", default=None, help="directory of training runs to fit (searched recursively)")
    src.add_argument("--sweep", default=None, choices=sorted(SWEEPS), help="train this sweep into OUT/runs, then fit")
    src.add_argument(
        "--from-results",
        action="store_true",
        help="refit the runs recorded in OUT/scaling.json or OUT/design.json (compute and loss per run; no run "
        "directories needed)",
    )
    p.add_argument("--out", required=True, help="output directory (scaling.md, scaling.json, scaling.png)")
    p.add_argument(
        "--group-by",
        default=None,
        metavar="FIELD",
        help="dotted field of summary.json / train_config.json naming the architecture (default: "
        "summary label, else overrides.name, else preset)",
    )
    p.add_argument(
        "--baseline", default=None, help="architecture the others are compared with (default: 'baseline' if present)"
    )
    p.add_argument("--irreducible", action="store_true", help="fit L = E + a C^-b instead of L = a C^-b")
    p.add_argument("--metric", default="val_loss", help="metrics.jsonl field used as the loss")
    p.add_argument(
        "--bootstrap",
        type=int,
        default=1000,
        help="bootstrap resamples for the 90%% intervals of architectures with >= 20 runs (with fewer: "
        "t-intervals from the fits' covariance)",
    )
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument(
        "--shared-lr",
        type=float,
        default=None,
        help="runs at several learning rates: the rate every arm shares in the comparison with each arm at its best "
        "(default: the sweep's lr with --sweep, the recorded one with --from-results)",
    )
    p.add_argument("--data", default=None, help="--sweep: training data as for k3 train (default: stdlib)")
    p.add_argument("--device", default="auto", help="--sweep: auto, cpu or cuda[:N]")
    p.add_argument("--progress", action="store_true", help="--sweep: per-run progress bars")
    add_run_flags(p)


def run(args: argparse.Namespace) -> int:
    from k3.audit.scaling import analyse, load_runs, write_outputs
    from k3.audit.scaling_design import analyse_design, is_design, write_design_outputs

    set_threads(args.threads)
    if args.bootstrap < 1:
        raise ValueError(f"--bootstrap={args.bootstrap} must be a positive integer")
    out = Path(args.out)
    runs_dir = Path(args.runs) if args.runs else out / "runs"
    sweep = get_sweep(args.sweep) if args.sweep else None
    if sweep:
        run_sweep(
            sweep,
            out,
            data=args.data,
            device=args.device,
            progress=args.progress,
            jobs=args.jobs,
            warm_first=args.warm_first,
        )
    shared_lr = args.shared_lr if args.shared_lr is not None else (sweep.train.get("lr") if sweep else None)
    if args.from_results:
        design = out / "design.json"
        if design.is_file():
            recorded = json.loads(design.read_text())
            runs = recorded["runs"]
            shared_lr = recorded.get("shared_lr") if shared_lr is None else shared_lr
        elif (out / "scaling.json").is_file():
            runs = json.loads((out / "scaling.json").read_text())["runs"]
        else:
            raise FileNotFoundError(f"{out}: no scaling.json or design.json to refit")
    else:
        runs = load_runs(runs_dir, args.group_by, args.metric)
    if sweep and not sweep.ratios:  # runs of this sweep trained before their summaries recorded the ratio
        runs = [
            r if r.get("tokens_per_param") is not None else {**r, "tokens_per_param": sweep.tokens_per_param}
            for r in runs
        ]
    if is_design(runs):
        rates = {r.get("lr") for r in runs}
        if shared_lr is None and len(rates) == 1:  # several ratios at one rate
            shared_lr = rates.pop()
        if shared_lr is None:
            raise ValueError("the runs use several learning rates per arm and size: pass --shared-lr")
        result = analyse_design(runs, shared_lr, args.baseline or "baseline")
        path = write_design_outputs(result, out)
        for c in result["cells"]:
            losses = ", ".join(f"{lr:g}: {v['mean']:.4f}" for lr, v in c["lrs"].items())
            print(f"{c['label']} w{c['width']} l{c['layers']}: {losses}; best {c['best_lr']:g}")
        for ch in result["choices"]:
            for label, m in ch["result"]["multipliers"].items():
                if m["overlap"]:
                    print(f"{label}, {ch['name']}: compute multiplier {m['multiplier']:.3f} at loss {m['at_loss']:.3f}")
        print(f"report: {path}")
        return 0
    result = analyse(runs, args.baseline, args.irreducible, args.bootstrap, args.seed)
    path = write_outputs(result, out)
    for label, f in result["fits"].items():
        print(
            f"{label:<16} b = {f['b']:.4f}  a = {f['a']:.4g}"
            + (f"  E = {f['e']:.3f}" if f["irreducible"] else "")
            + f"  ({f['runs']} runs, {f['sizes']} sizes)"
        )
    for label, why in result["skipped"].items():
        print(f"{label:<16} not fitted: {why}")
    for label, m in result["multipliers"].items():
        if not m["overlap"]:
            print(f"{label} vs {m['baseline']}: no compute multiplier (their losses do not overlap)")
            continue
        iv, how = m["interval"], m["interval_detail"]
        iv_s = f" ({how['level']} interval {iv[0]:.3f} .. {iv[1]:.3f}, {how['method']})" if iv[0] is not None else ""
        print(f"{label} vs {m['baseline']}: compute multiplier {m['multiplier']:.3f}{iv_s} at loss {m['at_loss']:.3f}")
    print(f"report: {path}")
    return 0
