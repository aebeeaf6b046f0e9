"""``k3 convert --from DIR --to DIR [--format k3|kimi_linear|k3-release] [--dtype ...] [--quantize mxfp4 ...]``.

Reads any checkpoint ``k3.from_pretrained`` reads (ours, the K3 release layout, transformers' Kimi-Linear in
runtime or original names, packed MXFP4 experts, dequantised) and writes it atomically in the chosen format
(``k3-release``: the multimodal release layout, a ``kimi_k3`` wrapper config, text under ``language_model.``, the
release's vision names), with the source's tokenizer files, so the output can be served as it is; ``--quantize
mxfp4`` packs the routed experts (k3.quant.packed). ``--from`` may be a training run directory: its latest
checkpoint is converted. What ``--to`` may be (and what ``--force`` allows to be replaced) is checked first, by
k3.convert, against the directory given and the checkpoint it resolves to. ``--merge-lora ADAPTERS``
folds a ``k3 train --lora`` run's adapters into ``--from``, their base (refused unless it is the checkpoint they were
trained on, k3.checkpoint.adapters). The conversion itself is k3.convert.convert; this module parses and reports."""

from __future__ import annotations

import argparse
import logging
import math

from k3.cli.generate import DTYPE_CHOICES
from k3.config.hf import FORMATS
from k3.train.config import MX_MODES

log = logging.getLogger("k3.convert")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from", dest="src", required=True, help="source checkpoint directory, or training run directory (latest)"
    )
    p.add_argument("--to", dest="dst", required=True, help="target directory: new or empty (written atomically)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a --to that already holds a k3 checkpoint (never a directory holding anything else)",
    )
    p.add_argument("--format", choices=FORMATS, default="k3")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: the source's own")
    p.add_argument("--max-shard-gb", type=float, default=None, help="GB per weight file at most (default 5)")
    p.add_argument(
        "--quantize",
        choices=["mxfp4"],
        default=None,
        help="write the routed experts packed (compressed-tensors mxfp4-pack-quantized)",
    )
    p.add_argument(
        "--scale-mode", choices=MX_MODES, default="floor", help="MX scale rule for --quantize: floor (OCP) or rceil"
    )
    p.add_argument(
        "--merge-lora",
        metavar="ADAPTERS",
        default=None,
        help="fold the LoRA adapters of a k3 train --lora run (its latest checkpoint) or adapter directory into "
        "--from, the base they were trained on (checked), and write the merged model",
    )


def run(args: argparse.Namespace) -> int:
    from k3.checkpoint.format import DEFAULT_SHARD_BYTES
    from k3.convert import convert
    from k3.infer.load import resolve_dtype

    if args.max_shard_gb is None:
        shard_bytes = DEFAULT_SHARD_BYTES
    else:
        shard_bytes = int(args.max_shard_gb * 1e9) if math.isfinite(args.max_shard_gb) else 0
    if shard_bytes < 1:
        raise ValueError(f"--max-shard-gb={args.max_shard_gb} must be a positive number of GB per weight file")
    done = convert(
        args.src,
        args.dst,
        args.format,
        resolve_dtype(args.dtype),
        shard_bytes,
        args.quantize,
        args.scale_mode,
        args.merge_lora or None,
        args.force,
    )
    lora = done["lora"]
    log.info(
        "wrote %s (%s format, %s%s%s, %.1fM parameters)",
        args.dst,
        args.format,
        args.dtype,
        f", routed experts {args.quantize} ({args.scale_mode} scales)" if args.quantize else "",
        f", LoRA rank {lora['rank']} of {done['adapters']} merged" if lora else "",
        done["parameters"] / 1e6,
    )
    return 0
