"""Fine-tuning released or trained checkpoints: where ``k3 train --init-from CKPT`` starts from.

``--init-from`` names a checkpoint directory (k3's own, the K3 release layout, transformers' Kimi-Linear; packed
MXFP4 experts are dequantised to the training dtype) or a k3 run directory (its latest checkpoint). The weights are
read by :func:`k3.convert.load.from_pretrained` (streamed, checksummed), the model's config and the tokenizer are the
checkpoint's (no BPE is trained, and flags that would change either are refused: k3.train.config), and the
optimizer starts fresh: a new run, not a resume.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from k3.convert.checkpoint import resolve_checkpoint
from k3.convert.load import from_pretrained
from k3.data.tokenizer import Tokenizer
from k3.infer.load import load_tokenizer

log = logging.getLogger("k3.train")


def init_checkpoint(path: str) -> Path:
    """The checkpoint directory ``--init-from path`` names (a run directory: its latest checkpoint); one error
    naming ``path`` when it is neither."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"--init-from {path}: no such directory")
    try:
        return resolve_checkpoint(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--init-from {path}: {e}") from None


def init_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of ``--init-from path``: ``tokenizer.json`` beside the checkpoint, else in the run directory
    given; it needs an EOS token (documents and conversations are packed with it)."""
    tokenizer, ckpt = load_tokenizer(path)
    if tokenizer.eos_id is None:
        raise ValueError(
            f"--init-from {path}: the tokenizer of {ckpt} has no EOS token; training packs documents with one"
        )
    return tokenizer


def init_model(ckpt: Path, tokenizer: Tokenizer, device: torch.device):
    """The checkpoint's model in fp32 (the training dtype: the weights are the optimizer's masters; autocast
    runs the GPU forward in bf16) on ``device``, checked against the tokenizer."""
    model = from_pretrained(ckpt, dtype=torch.float32, device=device)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"--init-from {ckpt}: the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
            f"{model.config.vocab_size}: they do not belong together"
        )
    log.info(
        "initialised from %s (%s): weights, config and tokenizer; the optimizer starts fresh", ckpt, model.config.name
    )
    return model
