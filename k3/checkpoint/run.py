"""Training-run checkpoints: one directory per saved step plus a pointer to the latest.

    RUN/checkpoints/step-000040/   config.json, model*.safetensors, k3_checksums.json (HF layout, router
                                   biases included as buffers), tokenizer.json, trainer_state.pt
                                   (a --lora run: adapter_model.safetensors, adapter_config.json and config.json
                                   instead of the weights, k3.checkpoint.adapters)
    RUN/checkpoints/latest         the name of the newest complete step directory
    RUN/.lock                      held (``flock``) by the process training in RUN; holds its pid

Each step directory is written with ``atomic_directory`` and the pointer is replaced atomically after it,
so an interruption at any point leaves the previous checkpoint loadable and ``latest`` naming it. A kill between
the two (the run's first checkpoint complete, no ``latest`` yet) or a damaged step directory is what
:func:`resume_checkpoint` gets past: it resumes from the newest step directory that is complete and verifies.
``trainer_state.pt`` holds tensors and plain data only (read with ``torch.load(weights_only=True)``, so a run
directory from elsewhere cannot run code) and is covered by ``k3_checksums.json`` like the weights.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from k3.checkpoint.adapters import is_adapter_dir, verify_adapters
from k3.checkpoint.format import (
    TRAINER_STATE,
    add_checksums,
    expected_checksums,
    read_config,
    verify_checksum,
    verify_files,
    write_pretrained,
)
from k3.fs import atomic_directory, atomic_write_text, make_directory

log = logging.getLogger("k3.checkpoint")

STATE_FILE = TRAINER_STATE
LOCK_FILE = ".lock"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STRAY = re.compile(r"^\.(step-\d+|latest)\.(tmp|old)-")


def rng_state() -> dict:
    """The RNG states as tensors and plain types (numpy's key array as an int64 tensor), so they load with
    ``weights_only=True``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_trainer_state(ckpt: Path) -> dict:
    """``ckpt/trainer_state.pt`` after its checksum is verified, read as tensors and plain data only."""
    path = Path(ckpt) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {ckpt} is not a training checkpoint")
    verify_checksum(ckpt, STATE_FILE)
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} holds more than tensors and plain data, refused: {first}") from None


class RunLock:
    """An exclusive ``flock`` on RUN/.lock, so two processes never train into one run directory at once. The
    file holds the holder's pid for the error message; the lock goes with the process (a kill releases it)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.file = None

    @property
    def held(self) -> bool:
        return self.file is not None

    def acquire(self) -> None:
        if self.file is not None:
            return
        make_directory(self.path.parent)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ValueError(
                f"{self.path.parent} is in use by another k3 train (pid {holder}); wait for it to "
                "finish or stop it, or pass another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


def clean_stray(run_dir: Path) -> list[Path]:
    """Remove what an interrupted checkpoint write leaves in RUN/checkpoints (``.step-N.tmp-*`` directories,
    ``.latest.tmp-*`` files); call it holding the run lock, so no write in progress is removed."""
    root = Path(run_dir) / "checkpoints"
    removed = [p for p in root.iterdir() if _STRAY.match(p.name)] if root.is_dir() else []
    for p in removed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if removed:
        log.warning(
            "removed %d leftover(s) of an interrupted checkpoint write: %s",
            len(removed),
            ", ".join(p.name for p in removed),
        )
    return removed


def verify_step(ckpt: Path) -> None:
    """Refuse (one ValueError / FileNotFoundError naming the problem) a step directory that is not a complete
    training checkpoint: tokenizer.json, config.json, the weights and ``trainer_state.pt`` all present, the last
    three matching their SHA-256 in ``k3_checksums.json``; a multi-process run's DCP directory needs its
    ``.metadata``, config.json and tokenizer.json (DCP checks its own shards when it loads)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt} does not exist")
    if not (ckpt / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{ckpt / 'tokenizer.json'} is missing")
    if (ckpt / ".metadata").is_file():
        read_config(ckpt)
        return
    if not (ckpt / STATE_FILE).is_file():
        raise FileNotFoundError(f"{ckpt / STATE_FILE} is missing")
    if is_adapter_dir(ckpt):  # a --lora run's step: its adapters, not the (frozen) base
        verify_adapters(ckpt)
    else:
        verify_files(ckpt)
    expected_checksums(ckpt, [STATE_FILE])


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``--resume`` continues from: the step directory ``latest`` names if it passes
    :func:`verify_step` (its files are hashed once more here); otherwise (``latest`` missing, or naming a step
    directory that is gone, incomplete or damaged) the newest step directory that passes, each one passed over
    with a warning saying why. None when the run has no checkpoint at all; one ValueError when none is complete."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    name = pointer.read_text().strip() if pointer.is_file() else None
    if name is not None and not _STEP_DIR.match(name):
        log.warning("%s holds %r, not a step directory's name", pointer, name[:80])
    named = root / name if name is not None and _STEP_DIR.match(name) else None
    listing = root.iterdir() if root.is_dir() else ()
    steps = sorted((p for p in listing if p.is_dir() and _STEP_DIR.match(p.name)), reverse=True)
    candidates = ([named] if named is not None else []) + [p for p in steps if p != named]
    problems = []
    for step in candidates:
        try:
            verify_step(step)
        except (ValueError, FileNotFoundError) as e:
            log.warning("not resuming from %s, which is missing, incomplete or damaged: %s", step.name, e)
            problems.append(f"{step.name}: {e}")
            continue
        if step != named:
            log.warning("%s names no complete checkpoint; resuming from %s, the newest complete one", pointer, step)
        return step
    if problems:
        raise ValueError(f"{root} holds no complete checkpoint to resume from ({'; '.join(problems)})")
    return None


def save_checkpoint(
    run_dir: Path, step: int, model, tokenizer, trainer_state: dict, keep: int = 3, write=write_pretrained
) -> Path:
    """Write RUN/checkpoints/step-NNNNNN atomically, point ``latest`` at it, keep the newest ``keep``. ``write``
    puts the model's files into the directory: the whole model (default), or a --lora run's adapters."""
    root = Path(run_dir) / "checkpoints"
    target = root / f"step-{step:06d}"
    with atomic_directory(target) as tmp:
        write(model, tmp)
        tokenizer.save(tmp)
        torch.save(trainer_state, tmp / STATE_FILE)
        add_checksums(tmp, [STATE_FILE])
    return publish_checkpoint(target, keep)


def publish_checkpoint(target: Path, keep: int) -> Path:
    """Point ``checkpoints/latest`` at the complete step directory ``target`` and delete all but the newest
    ``keep`` step directories beside it (keep <= 0: delete none)."""
    root = target.parent
    atomic_write_text(root / "latest", target.name)
    steps = sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return target
