"""``k3 convert --from DIR --to DIR [--format k3|kimi_linear|k3-release] [--dtype ...] [--quantize mxfp4 ...]``.

Reads any checkpoint ``k3.from_pretrained`` reads (ours, the K3 release layout, transformers' Kimi-Linear in
runtime or original names, packed MXFP4 experts, dequantised) and writes it atomically in the chosen format
(``k3-release``: the multimodal release layout, a ``kimi_k3`` wrapper config, text under ``language_model.``, the
release's vision names); ``--quantize mxfp4`` packs the routed experts (k3.quant.packed)."""

from __future__ import annotations

import argparse
import logging

import torch

from k3.config.hf import FORMATS
from k3.convert.checkpoint import DEFAULT_SHARD_BYTES, save_pretrained
from k3.convert.load import from_pretrained
from k3.ops.mx import MODES as MX_MODES

log = logging.getLogger("k3.convert")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint between the k3, kimi_linear and k3-release layouts")
    p.add_argument("--from", dest="src", required=True, help="source checkpoint directory")
    p.add_argument("--to", dest="dst", required=True, help="target directory (replaced atomically)")
    p.add_argument("--format", choices=FORMATS, default="k3")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto", help="auto: the source's own")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1e9)
    p.add_argument(
        "--quantize",
        choices=["mxfp4"],
        default=None,
        help="write the routed experts packed (compressed-tensors mxfp4-pack-quantized)",
    )
    p.add_argument("--scale-mode", choices=MX_MODES, default="floor", help="MX scale rule for --quantize")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = from_pretrained(args.src, dtype=DTYPES.get(args.dtype))
    save_pretrained(
        model,
        args.dst,
        fmt=args.format,
        max_shard_bytes=int(args.max_shard_gb * 1e9),
        quantize=args.quantize,
        scale_mode=args.scale_mode,
    )
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
