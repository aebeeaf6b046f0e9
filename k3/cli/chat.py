"""``k3 chat --ckpt DIR``: a multi-turn chat REPL over stdin; replies stream to stdout.

Each line read is one user message. ``/reset`` clears the history (the ``--system`` message stays), ``/exit``
or end of input quits, Ctrl-C stops a reply being generated. When the conversation outgrows the context, the
oldest turns are dropped. A line that is not valid UTF-8 is answered with one line on stderr and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from k3.cli.generate import (
    add_model_args,
    add_sampling_args,
    add_threads_arg,
    load,
    sampling_from_args,
    stats_line,
    stream,
    utf8_text,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--system", default=None, help="a system message at the start of every conversation")
    add_sampling_args(p, max_tokens=256)
    add_threads_arg(p)
    p.add_argument("--stats", action="store_true", help="print a stats line to stderr after each reply")


class _Tee:
    """Writes through to ``out`` and keeps what was written."""

    def __init__(self, out):
        self.out, self.parts = out, []

    def write(self, s: str) -> None:
        self.parts.append(s)
        self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def read_line(stdin) -> str | None:
    """The next line of ``stdin`` without its newline, None at the end of input; one ValueError for a line that
    is not valid UTF-8. Read as bytes where stdin has them, so the terminal's or locale's decoding settings do
    not decide what a bad byte does."""
    buffer = getattr(stdin, "buffer", None)
    raw = buffer.readline() if buffer is not None else stdin.readline()
    if not raw:
        return None
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"that line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start})") from None
    return utf8_text(raw, "that line").rstrip("\n")


def fit(history: list[dict], tokenizer, room: int):
    """Render ``history``, dropping the oldest non-system turns until the prompt leaves ``room`` tokens of the
    context; None when even the newest message alone does not fit."""
    from k3.data.chat import render_chat

    history = list(history)
    while True:
        rendered = render_chat(history, tokenizer)
        if len(rendered.token_ids) <= room:
            return rendered, history
        drop = next((i for i, m in enumerate(history) if m["role"] != "system"), None)
        if drop is None or drop == len(history) - 1:
            return None, history
        del history[drop]


def run(args: argparse.Namespace) -> int:
    from k3.data.chat import chat_format
    from k3.infer.engine import Engine
    from k3.infer.load import load_line

    base = sampling_from_args(args)
    system = [{"role": "system", "content": utf8_text(args.system, "--system")}] if args.system else []
    load_stats: dict = {}
    model, tokenizer, path = load(args, load_stats)
    print(load_line(load_stats), file=sys.stderr)
    engine = Engine(model, tokenizer, max_batch=1)
    interactive = sys.stdin.isatty()
    history = list(system)
    if interactive:
        print(
            f"k3 chat: {path} ({chat_format(tokenizer)} chat format); /reset clears the history, /exit or Ctrl-D quits",
            file=sys.stderr,
        )
    while True:
        if interactive:
            print("you> ", end="", flush=True, file=sys.stderr)
        try:
            text = read_line(sys.stdin)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        except ValueError as e:
            print(f"[{e}; skipped]", file=sys.stderr)
            continue
        if text is None:
            break
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            history = list(system)
            print("[history cleared]", file=sys.stderr)
            continue
        if not text.strip():
            continue
        rendered, trimmed = fit(
            history + [{"role": "user", "content": text}], tokenizer, engine.max_context - base.max_tokens
        )
        if rendered is None:
            print(
                f"[that message does not fit the {engine.max_context}-token context with --max-tokens "
                f"{base.max_tokens}]",
                file=sys.stderr,
            )
            continue
        params = dataclasses.replace(
            base, stop=base.stop + rendered.stop, stop_token_ids=base.stop_token_ids + rendered.stop_token_ids
        )

        out = _Tee(sys.stdout)
        s = stream(engine, rendered.token_ids, params, out)
        print(flush=True)
        if args.stats:
            print(stats_line(s), file=sys.stderr)
        history = trimmed + [{"role": "assistant", "content": "".join(out.parts).strip()}]
    return 0
