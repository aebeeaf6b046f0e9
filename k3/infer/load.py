"""Load a checkpoint for inference: ``load_for_inference(ckpt, device, dtype) -> (model, tokenizer, path)``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from k3.convert.checkpoint import from_pretrained
from k3.convert.checkpoint import resolve_checkpoint
from k3.data.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` -> cuda when available else cpu; ``cuda[:N]`` without a GPU is one ValueError."""
    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"--device={name!r} must be auto, cpu or cuda[:N]")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={name} but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"--dtype={name!r} must be one of {', '.join(DTYPES)}")
    return DTYPES[name]


def find_tokenizer(checkpoint: Path, given: str | os.PathLike) -> Path:
    """``tokenizer.json`` beside the checkpoint's config.json, else in the run directory that was given."""
    for directory in (checkpoint, Path(given)):
        if (directory / "tokenizer.json").is_file():
            return directory / "tokenizer.json"
    raise FileNotFoundError(f"no tokenizer.json in {checkpoint}: inference needs the tokenizer the model was "
                            "trained with; copy its tokenizer.json (and tokenizer_config.json) next to config.json")


def load_for_inference(ckpt: str | os.PathLike, device: str | torch.device = "auto",
                       dtype: str | torch.dtype = "float32"):
    """A checkpoint directory or a training run directory (its latest checkpoint) ->
    ``(model in eval mode on device, Tokenizer, checkpoint path)``. One clear error for a missing checkpoint,
    a missing tokenizer or a tokenizer whose ids do not fit the model's vocabulary."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    path = resolve_checkpoint(ckpt)
    tokenizer = Tokenizer.load(find_tokenizer(path, ckpt))
    model = from_pretrained(path, dtype=dt, device=dev).eval()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                         f"{model.config.vocab_size}: they do not belong together")
    return model, tokenizer, path
