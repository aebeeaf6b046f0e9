"""``k3 generate --ckpt DIR --prompt TEXT``: stream one continuation to stdout, a stats line to stderr."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from k3.cli.threads import single_stream_threads

if TYPE_CHECKING:
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

# k3.infer.load.DTYPE_CHOICES, copied so that building the parser imports no torch (tests/cli/test_help.py keeps the
# two equal)
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
PACKED_MODES = ("auto", "keep", "dequantize")  # k3.checkpoint.load.PACKED_MODES, copied alike


def add_model_args(p: argparse.ArgumentParser, ckpt_required: bool = True) -> None:
    p.add_argument("--ckpt", required=ckpt_required, help="checkpoint directory or training run directory (latest)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="auto: the checkpoint's own. On a CPU a request's logits agree with the request served alone within "
        "1e-5 of their largest in float32 (greedy and seeded tokens the same unless two candidates are that close) "
        "and within 1%% in bfloat16, where greedy tokens can change with the batch between candidates that close",
    )
    p.add_argument(
        "--packed",
        choices=PACKED_MODES,
        default="auto",
        help="packed MXFP4 experts: auto keeps them packed when the checkpoint has them (only the experts a batch "
        "selects are dequantised); keep refuses a checkpoint without them; dequantize dequantises them once at load",
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="tokens to generate at most (default %(default)s)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def utf8_text(text: str, what: str) -> str:
    """``text`` itself, or one ValueError naming ``what`` when it holds bytes that were not valid UTF-8 (Python
    keeps such bytes of argv or stdin as lone surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        found = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
        raise ValueError(f"{what} is not valid UTF-8 ({found} at character {e.start})") from None
    return text


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default on a CPU: 1, fastest for one stream's decode, unless OMP_NUM_THREADS is set)",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as validated SamplingParams (one ValueError naming a bad flag)."""
    from k3.infer.sampling import SamplingParams

    for s in args.stop:
        utf8_text(s, "--stop")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=list(args.stop),
    )
    params.validate()
    return params


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="the text to continue (empty: from the BOS token)")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image (repeatable; multimodal checkpoints): it goes where the prompt has a "
        "<|media_pad|> token, else before the text",
    )
    add_sampling_args(p, max_tokens=128)
    add_threads_arg(p)


def stream(engine: Engine, prompt: list[int], params: SamplingParams, out=None, images: list | None = None) -> dict:
    """Run one request, writing text deltas to ``out`` as they come; returns its last StepOutput's counts.
    Ctrl-C aborts the request (finish_reason "abort"); a request the engine failed raises one ValueError."""
    out = out or sys.stdout
    rid = engine.add(prompt, params, images=images)
    start, first, last = time.perf_counter(), None, None
    try:
        while engine.has_work():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                if o.error is not None:
                    raise ValueError(f"generation failed: {o.error}")
                first = first or time.perf_counter()
                last = o
                out.write(o.text)
                out.flush()
    except KeyboardInterrupt:
        engine.abort(rid)
        reason = "abort"
    else:
        reason = last.finish_reason
    elapsed = time.perf_counter() - start
    n = last.completion_tokens if last else 0
    ttft = first - start if first else None
    rate = (n - 1) / (elapsed - ttft) if ttft is not None and n > 1 and elapsed > ttft else None
    prompt_tokens = last.prompt_tokens if last else len(prompt)  # after media placeholders are expanded
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "finish_reason": reason,
        "seconds": elapsed,
        "first_token_s": ttft,
        "tokens_per_s": rate,
    }


def image_prompt(model, tokenizer, text: str, images: int) -> list[int]:
    """Token ids of ``text`` (an empty one: the BOS token, :meth:`~k3.data.tokenizer.Tokenizer.prompt_ids`); with
    images, the media placeholder token stands where the text writes it (``<|media_pad|>``), else one placeholder
    per image goes first."""
    if not images:
        return tokenizer.prompt_ids(text)
    if not hasattr(model, "vision_tower"):
        raise ValueError("--image needs a multimodal checkpoint (this one has no vision tower)")
    pad = model.config.vision.media_placeholder_token_id
    marker = tokenizer.hf.id_to_token(pad)
    parts = text.split(marker) if marker else [text]
    ids = tokenizer.encode(parts[0])  # other special-token strings in the text stay plain text
    for part in parts[1:]:
        ids += [pad] + tokenizer.encode(part)
    return ids if len(parts) > 1 else [pad] * images + ids


def stats_line(s: dict) -> str:
    rate = f", {s['tokens_per_s']:.1f} tok/s after the first" if s["tokens_per_s"] else ""
    ttft = f", first token {s['first_token_s'] * 1000:.0f} ms" if s["first_token_s"] is not None else ""
    return (
        f"[{s['prompt_tokens']} prompt + {s['completion_tokens']} generated tokens in {s['seconds']:.2f} s"
        f"{ttft}{rate}; finish: {s['finish_reason']}]"
    )


def load(args: argparse.Namespace, stats: dict):
    """(model, tokenizer, checkpoint path) for ``k3 generate`` / ``k3 chat``, torch's CPU threads set for one
    stream first (:func:`k3.cli.threads.single_stream_threads`)."""
    from k3.infer.load import load_for_inference, resolve_device

    single_stream_threads(args.threads, resolve_device(args.device))
    return load_for_inference(args.ckpt, args.device, args.dtype, stats=stats, packed=args.packed)


def run(args: argparse.Namespace) -> int:
    from k3.infer.engine import Engine
    from k3.infer.load import load_line

    params = sampling_from_args(args)
    utf8_text(args.prompt, "--prompt")
    load_stats: dict = {}
    model, tokenizer, _ = load(args, load_stats)
    print(load_line(load_stats), file=sys.stderr)
    engine = Engine(model, tokenizer, max_batch=1)
    prompt = image_prompt(model, tokenizer, args.prompt, len(args.image))
    s = stream(engine, prompt, params, images=args.image or None)
    print()
    print(stats_line(s), file=sys.stderr)
    return 130 if s["finish_reason"] == "abort" else 0
