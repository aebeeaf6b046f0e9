"""``k3 scaling``: fit L(C) per architecture and the compute multiplier over a baseline (with a plot).

``k3 scaling --runs DIR --out DIR`` fits the training runs found under DIR (any directory holding
``train_config.json`` + ``metrics.jsonl``); ``k3 scaling --sweep NAME --out DIR`` first trains the sweep's
sizes x architectures into ``OUT/runs`` (resumable), then fits them; ``--from-results`` refits the runs that
``OUT/scaling.json`` records.
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
        help="refit the runs recorded in OUT/scaling.json (compute and loss per run; no run directories needed)",
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
    p.add_argument("--data", default=None, help="--sweep: training data as for k3 train (default: stdlib)")
    p.add_argument("--device", default="auto", help="--sweep: auto, cpu or cuda[:N]")
    p.add_argument("--progress", action="store_true", help="--sweep: per-run progress bars")
    add_run_flags(p)


def run(args: argparse.Namespace) -> int:
    from k3.audit.scaling import analyse, load_runs, write_outputs

    set_threads(args.threads)
    if args.bootstrap < 1:
        raise ValueError(f"--bootstrap={args.bootstrap} must be a positive integer")
    out = Path(args.out)
    runs_dir = Path(args.runs) if args.runs else out / "runs"
    if args.sweep:
        run_sweep(
            get_sweep(args.sweep),
            out,
            data=args.data,
            device=args.device,
            progress=args.progress,
            jobs=args.jobs,
            warm_first=args.warm_first,
        )
    if args.from_results:
        if not (out / "scaling.json").is_file():
            raise FileNotFoundError(f"{out}: no scaling.json to refit")
        runs = json.loads((out / "scaling.json").read_text())["runs"]
    else:
        runs = load_runs(runs_dir, args.group_by, args.metric)
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
