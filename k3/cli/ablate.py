"""``k3 ablate --grid NAME --out DIR``: run an ablation grid (resumable) and write its report.

Grids: ``smoke`` (tiny preset, every variant kind, 2 seeds, ~10 minutes on a 2-core CPU), ``default`` (small
preset, every variant and pair of removals, 2 seeds; meant for a GPU), ``micro`` (tests). Re-running the same
command skips finished runs and resumes interrupted ones; ``--report-only`` rewrites the report from the runs on
disk, ``--from-results`` from ``OUT/results.json`` alone; ``--jobs N`` trains N runs side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from k3.audit.grids import GRIDS, get_grid
from k3.cli.threads import set_threads

log = logging.getLogger("k3.ablate")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 1e-3,3e-3") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers")
    return values


def add_run_flags(p) -> None:
    """--jobs, --no-warm-first and --threads: how the training runs of a grid or a sweep share the machine."""
    p.add_argument(
        "--no-warm-first",
        dest="warm_first",
        action="store_false",
        help="with --jobs: start every worker at once instead of running the first run alone first (it "
        "fills the Triton compile / autotune caches; skip when they are warm)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained side by side in worker processes (default 1; e.g. 6 on one GPU: small "
        "models leave it mostly idle); the first run goes alone to fill the kernel caches",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's; 1 is best for tiny models on a busy machine)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", default="smoke", choices=sorted(GRIDS), help="which grid (default smoke)")
    p.add_argument("--out", default=None, help="output directory (default runs/ablate-GRID)")
    p.add_argument("--data", default=None, help="training data as for k3 train (default: the stdlib sources)")
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants instead of the grid's (k3 ablate --list names them; compose with +)",
    )
    p.add_argument("--seeds", type=_int_list, default=None, help="comma-separated seeds instead of the grid's")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run instead of the grid's")
    p.add_argument(
        "--lrs", type=_float_list, default=None, help="learning rates to sweep per variant (first seed), e.g. 1e-3,3e-3"
    )
    p.add_argument(
        "--match", choices=("tokens", "flops"), default=None, help="same tokens, or full's training FLOPs per variant"
    )
    p.add_argument("--no-mqar", dest="mqar", action="store_false", help="skip the MQAR recall runs")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--progress", action="store_true", help="per-run progress bars (only with --jobs 1)")
    add_run_flags(p)
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write the report from the finished runs on disk, listing the missing ones",
    )
    p.add_argument(
        "--from-results",
        action="store_true",
        help="train and read no runs: recompute the statistics and rewrite the report in --out from its "
        "results.json and grid.json (for a report whose runs are not on disk)",
    )
    p.add_argument("--list", action="store_true", help="print the grids and variants and exit")


def run(args: argparse.Namespace) -> int:
    from k3.audit.ablate import TRANSFORMS, rerender_from_results, run_grid

    set_threads(args.threads)
    if args.list:
        for name, g in GRIDS.items():
            print(
                f"{name}: {g.description}\n  preset {g.preset}, seeds {list(g.seeds)}, {g.train.get('steps')} steps, "
                f"variants: {', '.join(g.variants)}"
            )
        print("variants:")
        for name, t in TRANSFORMS.items():
            print(f"  {name}: {t.description}")
        return 0
    if args.from_results:
        if not args.out:
            raise ValueError("--from-results needs --out: the report's directory")
        rerender_from_results(args.out)
        print(f"report: {Path(args.out) / 'report.md'}")
        return 0
    grid = get_grid(args.grid)
    train = dict(grid.train)
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps={args.steps} must be a positive integer")
        train["steps"] = args.steps
        train["eval_every"] = min(train.get("eval_every", 20), args.steps)
    grid = dataclasses.replace(grid, train=train)
    if args.variants:
        grid = dataclasses.replace(grid, variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()))
    if args.seeds:
        grid = dataclasses.replace(grid, seeds=args.seeds)
    if args.lrs:
        grid = dataclasses.replace(grid, lrs=args.lrs)
    if args.match:
        grid = dataclasses.replace(grid, match=args.match)
    out = Path(args.out or f"runs/ablate-{grid.name}")
    result = run_grid(
        grid,
        out,
        data=args.data,
        device=args.device,
        progress=args.progress,
        mqar=args.mqar,
        jobs=args.jobs,
        report_only=args.report_only,
        warm_first=args.warm_first,
    )
    for row in result["variants"]:
        std = row["val_loss_std"]
        print(
            f"{row['variant']:<24} val loss {row['val_loss_mean']:.4f}"
            + (f" ± {std:.4f}" if std else "")
            + (f"  MaxVio {row['maxvio_mean']:.2f}" if row["maxvio_mean"] is not None else "")
        )
    print(f"report: {out / 'report.md'}  ({result['wall_s_this_invocation']:.0f}s)")
    return 0
