"""Load a checkpoint for inference: ``load_for_inference(ckpt, device, dtype) -> (model, tokenizer, path)``.

The weights are streamed (k3.checkpoint.load.from_pretrained, docs/architecture.md#checkpoints) straight into
their dtype and device; the load time and memory (host RSS peak, GPU memory) are logged and can be printed.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch

from k3.checkpoint.format import resolve_checkpoint
from k3.checkpoint.load import from_pretrained
from k3.data.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)  # auto: the checkpoint's own dtype
log = logging.getLogger("k3.infer")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def load_line(stats: dict) -> str:
    """One human line for the stats :func:`load_for_inference` fills."""
    line = (
        f"loaded {stats['params'] / 1e6:.1f}M parameters ({stats['bytes'] / 2**30:.2f} GiB, {stats['dtype']}) "
        f"in {stats['seconds']:.2f}s ({stats['bytes'] / 1e9 / max(stats['seconds'], 1e-9):.2f} GB/s) on "
        f"{stats['device']}; host RSS peak {stats['host_rss_peak'] / 2**30:.2f} GiB"
    )
    if "gpu_bytes" in stats:
        line += f", GPU memory {stats['gpu_bytes'] / 2**30:.2f} GiB (peak {stats['gpu_peak'] / 2**30:.2f} GiB)"
    return line


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


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype, or None for ``auto`` / None (keep the checkpoint's)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"--dtype={name!r} must be one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def find_tokenizer(checkpoint: Path, given: str | os.PathLike) -> Path:
    """``tokenizer.json`` beside the checkpoint's config.json, else in the run directory that was given."""
    for directory in (checkpoint, Path(given)):
        if (directory / "tokenizer.json").is_file():
            return directory / "tokenizer.json"
    raise FileNotFoundError(
        f"no tokenizer.json in {checkpoint}: inference needs the tokenizer the model was "
        "trained with; copy its tokenizer.json (and tokenizer_config.json) next to config.json"
    )


def load_tokenizer(ckpt: str | os.PathLike) -> tuple[Tokenizer, Path]:
    """The tokenizer of a checkpoint directory or training run directory (its latest checkpoint), without the
    model: ``(Tokenizer, checkpoint path)``."""
    path = resolve_checkpoint(ckpt)
    return Tokenizer.load(find_tokenizer(path, ckpt)), path


def load_for_inference(
    ckpt: str | os.PathLike,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = "auto",
    stats: dict | None = None,
    packed: str = "auto",
    experts: dict[int, list[int]] | None = None,
    checksum_part: tuple[int, int] = (0, 1),
):
    """A checkpoint directory or a training run directory (its latest checkpoint) ->
    ``(model in eval mode on device, Tokenizer, checkpoint path)``. One clear error for a missing checkpoint,
    a missing tokenizer or a tokenizer whose ids do not fit the model's vocabulary. ``dtype="auto"`` keeps the
    checkpoint's; ``stats`` (a dict) receives the load time and memory (see :func:`load_line`). Packed MXFP4
    experts stay packed (``packed="auto"``, or ``"keep"``, which refuses a checkpoint without them: only the
    experts a batch selects are dequantised, k3.ops.moe.mxfp4) or are dequantised once at load
    (``packed="dequantize"``). ``experts`` and ``checksum_part``: this process's part of an expert-parallel model
    (k3.checkpoint.load.from_pretrained)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    tokenizer, path = load_tokenizer(ckpt)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    model = from_pretrained(
        path, dtype=dt, device=dev, packed=packed, experts=experts, checksum_part=checksum_part
    ).eval()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    tensors = list(model.parameters()) + list(model.buffers())
    info = {
        "seconds": time.perf_counter() - t0,
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "device": str(dev),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "host_rss_peak": peak_rss_bytes(),
    }
    if dev.type == "cuda":
        info["gpu_bytes"], info["gpu_peak"] = torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)
    log.info("%s: %s", path, load_line(info))
    if stats is not None:
        stats.update(info)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
            f"{model.config.vocab_size}: they do not belong together"
        )
    return model, tokenizer, path
