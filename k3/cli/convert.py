"""``k3 convert --from DIR --to DIR [--format k3|kimi_linear|k3-release] [--dtype ...] [--quantize mxfp4 ...]``.

Reads any checkpoint ``k3.from_pretrained`` reads (ours, the K3 release layout, transformers' Kimi-Linear in
runtime or original names, packed MXFP4 experts, dequantised) and writes it atomically in the chosen format
(``k3-release``: the multimodal release layout, a ``kimi_k3`` wrapper config, text under ``language_model.``, the
release's vision names), with the source's tokenizer files, so the output can be served as it is; ``--quantize
mxfp4`` packs the routed experts (k3.quant.packed). What ``--to`` may be (and what ``--force`` allows to be
replaced) is checked first, by k3.convert.destination."""

from __future__ import annotations

import argparse
import logging
import math

import torch

from k3.config.hf import FORMATS
from k3.convert.atomic import atomic_directory
from k3.convert.checkpoint import DEFAULT_SHARD_BYTES, copy_tokenizer, write_pretrained
from k3.convert.destination import check_destination, check_replaceable
from k3.convert.load import from_pretrained
from k3.ops.mx import MODES as MX_MODES

log = logging.getLogger("k3.convert")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint between the k3, kimi_linear and k3-release layouts")
    p.add_argument("--from", dest="src", required=True, help="source checkpoint directory")
    p.add_argument("--to", dest="dst", required=True, help="target directory: new or empty (written atomically)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a --to that already holds a k3 checkpoint (never a directory holding anything else)",
    )
    p.add_argument("--format", choices=FORMATS, default="k3")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto", help="auto: the source's own")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1e9, help="GB per weight file at most")
    p.add_argument(
        "--quantize",
        choices=["mxfp4"],
        default=None,
        help="write the routed experts packed (compressed-tensors mxfp4-pack-quantized)",
    )
    p.add_argument("--scale-mode", choices=MX_MODES, default="floor", help="MX scale rule for --quantize")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    shard_bytes = int(args.max_shard_gb * 1e9) if math.isfinite(args.max_shard_gb) else 0
    if shard_bytes < 1:
        raise ValueError(f"--max-shard-gb={args.max_shard_gb} must be a positive number of GB per weight file")
    check_destination(args.src, args.dst, args.force)
    model = from_pretrained(args.src, dtype=DTYPES.get(args.dtype))
    with atomic_directory(args.dst, check_old=check_replaceable) as tmp:
        write_pretrained(model, tmp, args.format, shard_bytes, args.quantize, args.scale_mode)
        copy_tokenizer(args.src, tmp)
    n = sum(p.numel() for p in model.parameters())
    log.info(
        "wrote %s (%s format, %s%s, %.1fM parameters)",
        args.dst,
        args.format,
        args.dtype,
        f", routed experts {args.quantize} ({args.scale_mode} scales)" if args.quantize else "",
        n / 1e6,
    )
    return 0
