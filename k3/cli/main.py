"""The ``k3`` command line. Each subcommand lives in its own module under ``k3.cli``."""

from __future__ import annotations

import argparse
import logging
import sys

from k3.cli import ablate, audit, bench, chat, convert, generate, info, plan, scaling, serve, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 in PyTorch: train, serve and audit.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (train, info, plan, audit, ablate, scaling, convert, serve, generate, chat, bench):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for results that record it
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
