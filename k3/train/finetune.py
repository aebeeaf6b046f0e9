"""Fine-tuning released or trained checkpoints: where ``k3 train --init-from CKPT`` starts from.

``--init-from`` names a checkpoint directory (k3's own, the K3 release layout, transformers' Kimi-Linear; packed
MXFP4 experts are dequantised to the training dtype) or a k3 run directory (its latest checkpoint). The weights are
read by :func:`k3.checkpoint.load.from_pretrained` (streamed, checksummed), the model's config and the tokenizer are the
checkpoint's (no BPE is trained, and flags that would change either are refused: k3.train.config), and the
optimizer starts fresh: a new run, not a resume.

``--lora RANK`` freezes the checkpoint's weights and trains low-rank adapters (k3.model.lora; why our own module
and not peft: docs/decisions.md). The run's checkpoints hold the adapters and the name and fingerprint of their
base (k3.checkpoint.adapters); a resume reads the base again from ``--init-from``, refusing one that changed, and
``k3 convert --merge-lora`` folds them into a checkpoint. The balancer (QB by default) keeps updating the router's
bias under LoRA and under full fine-tuning, as in pretraining; a LoRA checkpoint saves the biases beside the
adapters (docs/decisions.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from k3.checkpoint.adapters import base_fingerprint, check_base, read_adapters, write_adapters
from k3.checkpoint.format import resolve_checkpoint
from k3.checkpoint.load import from_pretrained
from k3.data.tokenizer import Tokenizer
from k3.infer.load import load_tokenizer
from k3.model.lora import apply_lora, load_lora_state_dict, lora_targets

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
    model = from_pretrained(ckpt, dtype=torch.float32, device=device, packed="dequantize")  # trained: high precision
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"--init-from {ckpt}: the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
            f"{model.config.vocab_size}: they do not belong together"
        )
    log.info(
        "initialised from %s (%s): weights, config and tokenizer; the optimizer starts fresh", ckpt, model.config.name
    )
    return model


def adapt(model, cfg, base: Path, resume_from: Path | None):
    """Apply ``cfg``'s LoRA to ``model`` (the base read from ``base``); on resume, load the adapters of
    ``resume_from`` after checking they were trained on this base. Returns ``write(model, directory)``, which
    writes a step's adapter files (for k3.checkpoint.run.save_checkpoint)."""
    alpha = float(cfg.lora_alpha if cfg.lora_alpha is not None else cfg.lora)
    targets = lora_targets(model, cfg.lora_shared_experts)
    apply_lora(model, cfg.lora, alpha, targets)
    meta = {
        "rank": cfg.lora,
        "alpha": alpha,
        "shared_experts": cfg.lora_shared_experts,
        "targets": targets,
        "base": str(base.resolve()),
        "base_fingerprint": base_fingerprint(base),
    }
    if resume_from is not None:
        saved, tensors = read_adapters(resume_from)
        check_base(saved, base, resume_from)
        load_lora_state_dict(model, {k: v.to(next(model.parameters()).device) for k, v in tensors.items()})
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "LoRA rank %d (alpha %g) on %d linear maps: %.2fM trainable parameters, %.2f%% of the model",
        cfg.lora,
        alpha,
        len(targets),
        trained / 1e6,
        100 * trained / sum(p.numel() for p in model.parameters()),
    )
    return lambda m, directory: write_adapters(m, directory, meta)
