"""``k3 convert --from DIR --to DIR [--format k3|kimi_linear] [--dtype ...] [--quantize mxfp4 [--scale-mode M]]``.

Reads any checkpoint ``k3.from_pretrained`` reads (ours, the K3 release layout, transformers' Kimi-Linear in
runtime or original names, packed MXFP4 experts, dequantised) and writes it atomically in the chosen format;
``--quantize mxfp4`` packs the routed experts (k3.quant.packed).
"""

from __future__ import annotations

import argparse
import logging

import torch

from k3.config.hf import FORMATS
from k3.convert.checkpoint import DEFAULT_SHARD_BYTES, from_pretrained, save_pretrained
from k3.quant.mx import MODES as MX_MODES

log = logging.getLogger("k3.convert")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint between k3 and kimi_linear layouts")
    p.add_argument("--from", dest="src", required=True, help="source checkpoint directory")
    p.add_argument("--to", dest="dst", required=True, help="target directory (replaced atomically)")
    p.add_argument("--format", choices=FORMATS, default="k3")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1e9)
    p.add_argument("--quantize", choices=["mxfp4"], default=None,
                   help="write the routed experts packed (compressed-tensors mxfp4-pack-quantized)")
    p.add_argument("--scale-mode", choices=MX_MODES, default="floor", help="MX scale rule for --quantize")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = from_pretrained(args.src, dtype=DTYPES[args.dtype])
    save_pretrained(model, args.dst, fmt=args.format, max_shard_bytes=int(args.max_shard_gb * 1e9),
                    quantize=args.quantize, scale_mode=args.scale_mode)
    n = sum(p.numel() for p in model.parameters())
    log.info("wrote %s (%s format, %s%s, %.1fM parameters)", args.dst, args.format, args.dtype,
             f", routed experts {args.quantize} ({args.scale_mode} scales)" if args.quantize else "", n / 1e6)
    return 0
