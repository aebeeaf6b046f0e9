"""``k3 bench NAME [--out DIR] [--quick] [--cases ...]``: GPU benchmarks (decode, kernels, model, slice); tables +
JSON/markdown."""

from __future__ import annotations

import argparse
import importlib

NAMES = ("decode", "kernels", "model", "slice", "serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=NAMES)
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="fewer cases")
    p.add_argument(
        "--cases",
        default=None,
        help="model: comma-separated subset of train,train_ac,train_accum,peer,floor,attn_res,attn_res_compiled,"
        "prefill (default all); decode: targets (only the performance targets' compiled rows, "
        "no transformers peer)",
    )
    p.add_argument("--ckpt", default=None, help="serve: the checkpoint to serve (default: a random --preset one)")
    p.add_argument(
        "--preset",
        default=None,
        help="serve: comma-separated presets served with random weights (default small-1b, tiny on CPU; e.g. "
        "small-1b,kimi-linear-48b: one results file)",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        help="serve: comma-separated client counts (default 1,8,32,64 on a GPU, 1,16,64 for kimi-linear-48b; 1,4 "
        "on a CPU)",
    )
    p.add_argument("--server-args", default="", help="serve: extra k3 serve flags, space-separated")


def run(args: argparse.Namespace) -> int:
    import torch

    if args.name == "serve":  # the whole server under load: on a CPU too
        from k3.bench import serve

        gpu = torch.cuda.is_available()
        try:
            levels = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None
        except ValueError:
            raise ValueError(f"--concurrency={args.concurrency!r} must be comma-separated integers") from None
        if levels and min(levels) < 1:
            raise ValueError(f"--concurrency={args.concurrency!r}: each must be >= 1")
        serve.run(
            out_dir=args.out,
            quick=args.quick,
            ckpt=args.ckpt,
            presets=tuple((args.preset or ("small-1b" if gpu else "tiny")).split(",")),
            device="cuda" if gpu else "cpu",
            concurrency=levels if levels or gpu else (1, 4),
            cases=((256, 128), (32, 512)) if gpu else ((64, 16),),
            server_args=tuple(args.server_args.split()),
        )
        return 0
    kwargs = {}
    if args.cases is not None:
        if args.name == "decode":
            if args.cases != "targets":
                raise ValueError(f"k3 bench decode --cases takes targets, not {args.cases!r}")
            kwargs["targets"] = True
        elif args.name == "model":
            kwargs["cases"] = args.cases.split(",")
        else:
            raise ValueError("--cases applies to k3 bench model and decode only")
    if not torch.cuda.is_available():
        raise ValueError("k3 bench needs a CUDA GPU")
    from k3.ops import backend
    from k3.ops.kernel_plan import plan_report

    backend.set_backend("fast")  # benchmarks measure the fast paths, and fail where one cannot run
    print(plan_report("cuda", args.verbose), flush=True)
    importlib.import_module(f"k3.bench.{args.name}").run(out_dir=args.out, quick=args.quick, **kwargs)
    return 0
