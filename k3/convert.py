"""``k3 convert``: read any checkpoint k3 loads, optionally fold LoRA adapters into it, write it in a chosen format
(optionally with the routed experts packed as MXFP4), atomically, with the source's tokenizer files.

:func:`convert` does it; what ``--to DIR`` may be is checked before anything is loaded, because the output is
written atomically (k3.fs.atomic_directory: built beside DIR, swapped in, the previous DIR removed), so these
checks decide what a conversion may delete:

- refused outright: ``/``, the home directory, the current directory and any directory above one of them; a DIR
  that is, is inside or holds ``--from`` (symbolic links resolved); a symbolic link; an existing file, or a path
  under one;
- an empty or missing DIR is written;
- a non-empty DIR is replaced only with ``--force``, and only when it is a k3 checkpoint (config.json, weights,
  ``k3_checksums.json``) holding nothing but checkpoint files (the tokenizer's and the transformers code too);
  anything else in it is refused even with ``--force``, so nothing but the old checkpoint is ever removed.
  :func:`check_replaceable` runs again just before the swap.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from k3.checkpoint import hf_code
from k3.checkpoint.adapters import check_base, read_adapters, resolve_adapters
from k3.checkpoint.format import (
    CHECKSUMS,
    DEFAULT_SHARD_BYTES,
    INDEX,
    SINGLE,
    TOKENIZER_FILES,
    TRAINER_STATE,
    copy_tokenizer,
    read_checksums,
    read_config_json,
    resolve_checkpoint,
    write_pretrained,
)
from k3.checkpoint.load import from_pretrained
from k3.fs import atomic_directory
from k3.model.lora import apply_lora, load_lora_state_dict, merge_lora

_FILES = {"config.json", SINGLE, INDEX, CHECKSUMS, TRAINER_STATE, *TOKENIZER_FILES, *hf_code.FILES}
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
log = logging.getLogger("k3.convert")


def _foreign(directory: Path) -> list[str]:
    """The entries of ``directory`` that a k3 checkpoint does not hold (sorted; directories end in ``/``)."""
    out = []
    for p in directory.iterdir():
        if p.is_symlink() or not p.is_file():
            out.append(p.name + ("/" if p.is_dir() and not p.is_symlink() else ""))
        elif p.name not in _FILES and not _SHARD.match(p.name):
            out.append(p.name)
    return sorted(out)


def _not_checkpoint(directory: Path) -> str | None:
    """Why ``directory`` is not a k3 checkpoint that may be replaced whole, or None when it is one."""
    foreign = _foreign(directory)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        return f"it holds {', '.join(foreign[:5])}{more}, which no checkpoint holds"
    try:
        read_config_json(directory)
        if read_checksums(directory) is None:
            raise ValueError(f"no {CHECKSUMS}")
    except (ValueError, FileNotFoundError) as e:
        return f"it is not a k3 checkpoint ({e})"
    if not (directory / SINGLE).is_file() and not (directory / INDEX).is_file():
        return f"it is not a k3 checkpoint (neither {SINGLE} nor {INDEX})"
    return None


def check_replaceable(directory: Path) -> None:
    """Refuse to replace a non-empty ``directory`` that is not a k3 checkpoint of checkpoint files only."""
    if directory.is_dir() and any(directory.iterdir()):
        why = _not_checkpoint(directory)
        if why is not None:
            raise ValueError(
                f"--to {directory} is not empty and {why}: refused, even with --force (give a new or empty directory)"
            )


def _protected() -> list[tuple[str, Path]]:
    out = [("the root directory", Path("/"))]
    for what, where in (("the home directory", Path.home), ("the current directory", Path.cwd)):
        try:
            out.append((what, where().resolve()))
        except (OSError, RuntimeError):  # no home known, or the current directory was removed
            pass
    return out


def check_destination(source: str | os.PathLike, target: str | os.PathLike, force: bool) -> None:
    """One ValueError when converting ``source`` into ``target`` could delete anything but an old checkpoint
    (the rules in the module docstring)."""
    given = Path(target)
    if given.is_symlink():
        raise ValueError(f"--to {target} is a symbolic link; give the directory it points to")
    if given.exists() and not given.is_dir():
        raise ValueError(f"--to {target} is an existing file, not a directory")
    dst, src = given.resolve(), Path(source).resolve()
    blocker = next((p for p in dst.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"--to {target}: {blocker} is a file, not a directory")
    for what, path in _protected():
        if path.is_relative_to(dst):
            raise ValueError(f"--to {target} is {dst}, which is or holds {what}: refused (give a directory of its own)")
    if dst == src:
        raise ValueError(f"--to {target} is the --from directory itself; write the conversion to another directory")
    if dst.is_relative_to(src):
        raise ValueError(f"--to {target} is inside --from {source}; write the conversion outside it")
    if src.is_relative_to(dst):
        raise ValueError(f"--to {target} holds --from {source}; replacing it would delete the source")
    if dst.is_dir() and any(dst.iterdir()):
        check_replaceable(dst)
        if not force:
            raise ValueError(f"--to {target} already holds a checkpoint; pass --force to replace it")


def convert(
    source: str | os.PathLike,
    target: str | os.PathLike,
    fmt: str = "k3",
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    quantize: str | None = None,
    scale_mode: str | None = None,
    adapters: str | os.PathLike | None = None,
    force: bool = False,
) -> dict:
    """Convert checkpoint ``source`` (or a training run's latest) into ``target``, written atomically in ``fmt``
    (k3.config.hf.FORMATS), ``dtype`` (None: the source's), ``quantize="mxfp4"`` packing the routed experts with
    ``scale_mode``; ``adapters``: LoRA adapters (a ``--lora`` run or an adapter directory) folded into ``source``,
    which must be the base they were trained on. Every check (destinations, adapters, base) runs before the model is
    loaded. Returns ``{"checkpoint": the source read, "parameters": count, "adapters": the adapter directory read,
    "lora": its adapter config}`` (the last two None without ``adapters``)."""
    src = resolve_checkpoint(source)  # a run directory: its latest checkpoint
    check_destination(source, target, force)  # --to kept apart from the directory given ...
    if src != Path(source):
        log.info("--from %s: its latest checkpoint, %s", source, src)
        check_destination(src, target, force)  # ... and from the checkpoint read
    meta = found = None
    if adapters is not None:
        found = resolve_adapters(adapters)
        check_destination(found, target, force)  # --to never replaces the adapters it reads
        meta, tensors = read_adapters(found)
        check_base(meta, src, found)
    model = from_pretrained(src, dtype=dtype, packed="dequantize")  # written again from high-precision weights
    if meta is not None:
        apply_lora(model, meta["rank"], meta["alpha"], meta["targets"])
        load_lora_state_dict(model, tensors)
        merge_lora(model)  # in fp32, stored in the base's dtype (or ``dtype``)
    with atomic_directory(target, check_old=check_replaceable) as tmp:
        write_pretrained(model, tmp, fmt, max_shard_bytes, quantize, scale_mode)
        # the tokenizer beside the checkpoint, else the run directory's (as k3 generate and k3 serve find it)
        copy_tokenizer(src if (src / "tokenizer.json").is_file() else source, tmp)
    n = sum(p.numel() for p in model.parameters())
    return {"checkpoint": src, "parameters": n, "adapters": found, "lora": meta}
