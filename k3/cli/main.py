"""The ``k3`` command line. Each subcommand lives in its own module under ``k3.cli``: ``add_arguments(parser)``
defines its flags from light modules only, ``run(args)`` imports what the command needs (torch, the trainer, the
engine) when it runs. ``k3 --help`` imports no subcommand module, and a command's module is imported only when
that command is named, so asking for help costs a fraction of a second."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> one line of help (the module is k3.cli.NAME), in the order ``k3 --help`` lists them
COMMANDS = {
    "train": "train a model (default: small preset on the stdlib corpus), then sample",
    "info": "layer schedule and parameter / FLOP / cache accounting of a preset; --kernels: the kernel plan",
    "plan": "place a model on a cluster: layout, memory per GPU, expert placement, step time",
    "audit": "audit report (block recipe, parameters by path, router, long context, AttnRes)",
    "ablate": "run an ablation grid (variants x seeds, MQAR recall) and write its report",
    "scaling": "fit loss-vs-compute power laws per architecture; compute multipliers",
    "convert": "convert a checkpoint between the k3, kimi_linear and k3-release layouts",
    "serve": "serve a checkpoint over an OpenAI-compatible HTTP API",
    "generate": "continue a prompt (streams to stdout)",
    "chat": "chat with a checkpoint on the terminal (/reset, /exit)",
    "bench": "GPU benchmarks: decode, kernels, model, slice, serve (writes benchmarks/results/)",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``k3`` parser with every command's flags, or (``command`` given) only that command's, so that parsing
    one command line imports one subcommand module."""
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 in PyTorch: train, serve and audit.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (and the full kernel plan)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        if command is None or name == command:
            module = importlib.import_module(f"k3.cli.{name}")
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The command a command line names: its first word that is not an option (``k3 -v train ...``: train)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_of(argv) or "")
    args = parser.parse_args(argv)
    args.argv = argv  # the command line, for results that record it
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the system refused a read or write (a full disk, permissions): one line, status 1
        where = f"{e.filename}: " if e.filename else ""
        print(f"k3 {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
