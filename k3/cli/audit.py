"""``k3 audit (--preset NAME | --ckpt DIR | --figures-only) --out DIR [--context N] [--contexts 4096,...] [--measure]``.

Writes report.md, audit.json and PNG figures answering the auditability questions 1, 2, 5 (analytic), 6 and 7
(see docs/audit/README.md). Only the config is needed: a checkpoint's weights are never read. ``--figures-only``
redraws an existing audit's figures from its audit.json (nothing recomputed or re-measured).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from k3.config import PRESETS, get_preset


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"one of: {', '.join(PRESETS)}")
    src.add_argument("--ckpt", help="checkpoint or training run directory (its config.json only)")
    src.add_argument(
        "--figures-only",
        action="store_true",
        help="redraw the figures of the audit in --out from its audit.json (report and measurements kept)",
    )
    p.add_argument("--out", required=True, help="output directory (report.md, audit.json, *.png)")
    p.add_argument("--context", type=int, default=4096, help="context for the per-token FLOPs (default 4096)")
    p.add_argument(
        "--contexts",
        default="4096,32768,131072,1048576",
        help="comma-separated contexts for the cache and decode-bytes tables",
    )
    p.add_argument("--zipf", default="0.5,1.0", help="comma-separated Zipf exponents of the skewed routing model")
    p.add_argument(
        "--measure",
        action="store_true",
        help="also time prefill/decode, prefix caching and AttnRes modes on this CPU (small model)",
    )


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be comma-separated positive integers") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag}={text!r} must be comma-separated positive integers")
    return values


def _float_list(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be comma-separated positive numbers") from None
    if not values or any(not 0 < v <= 4 for v in values):
        raise ValueError(f"{flag}={text!r} must be comma-separated numbers in (0, 4]")
    return values


def run(args: argparse.Namespace) -> int:
    if args.figures_only:
        from k3.audit.report import redraw_figures

        figures = redraw_figures(args.out)
        print(f"redrew {len(figures)} figures in {args.out} from its audit.json: {', '.join(figures)}")
        return 0
    if args.context <= 0:
        raise ValueError(f"--context={args.context} must be positive")
    contexts = _int_list(args.contexts, "--contexts")
    zipf = _float_list(args.zipf, "--zipf")
    if args.preset is not None:
        config, source = get_preset(args.preset), f"preset `{args.preset}`"
    else:
        from k3.checkpoint.format import read_config
        from k3.checkpoint.format import resolve_checkpoint

        path = resolve_checkpoint(args.ckpt)
        config, source = read_config(path), f"checkpoint `{path}` (config.json only)"
    from k3.audit.format import human, human_bytes
    from k3.audit.report import run_audit

    command = "k3 " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["audit"] else ""
    a = run_audit(
        config,
        args.out,
        source=source,
        command=command,
        context=args.context,
        contexts=contexts,
        measure=args.measure,
        zipf=zipf,
    )
    print(
        f"audit of {a['preset']} -> {args.out}/report.md ({len(a['figures'])} figures) "
        f"in {a['timings']['total_s']:.1f} s"
    )
    print(
        f"parameters: total {human(a['params_total'])}, activated {human(a['params_activated'])} per token "
        f"(input embedding excluded)"
    )
    if a["spec_check"]:
        bad = [c["figure"] for c in a["spec_check"] if not c["ok"]]
        print(
            "published-figures check: "
            + ("all figures within tolerance" if not bad else "OUT OF TOLERANCE: " + ", ".join(bad))
        )
    if a["expert_stream"]:
        hits = {r["batch"]: r["distinct_per_layer"] for r in a["expert_stream"]["rows"]}
        print("distinct experts per layer at B=1,4,16,64: " + ", ".join(f"{hits[b]:.0f}" for b in (1, 4, 16, 64)))
    x = a["long_context"]["crossovers"]
    if x:
        print(
            f"KDA state = MLA latents at {x['layer_state_vs_latent']:,.0f} tokens per layer; hybrid cache < full-MLA "
            f"above {x['hybrid_vs_full_mla']:,.0f} tokens"
        )
    t = a["long_context"]["table"]
    print(
        f"cache per sequence at {t['context'][-1]:,} tokens: hybrid {human_bytes(t['hybrid'][-1])}, full-MLA "
        f"{human_bytes(t['full_mla'][-1])}, full-MHA {human_bytes(t['full_mha'][-1])}"
    )
    return 0
