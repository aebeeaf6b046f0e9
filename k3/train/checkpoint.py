"""Training-run checkpoints: one directory per saved step plus a pointer to the latest.

    RUN/checkpoints/step-000040/   config.json, model*.safetensors, k3_checksums.json (HF layout, router
                                   biases included as buffers), tokenizer.json, trainer_state.pt
    RUN/checkpoints/latest         the name of the newest complete step directory

Each step directory is written with ``atomic_directory`` and the pointer is replaced atomically after it,
so an interruption at any point leaves the previous checkpoint loadable and ``latest`` naming it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from k3.convert.atomic import atomic_directory, atomic_write_text
from k3.convert.checkpoint import write_pretrained

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, trainer_state: dict, keep: int = 3) -> Path:
    """Write RUN/checkpoints/step-NNNNNN atomically, point ``latest`` at it, keep the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    target = root / f"step-{step:06d}"
    with atomic_directory(target) as tmp:
        write_pretrained(model, tmp)
        tokenizer.save(tmp)
        torch.save(trainer_state, tmp / STATE_FILE)
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


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The step directory ``latest`` names, or None when the run has no checkpoint yet."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a training run directory (its latest checkpoint)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is not None:
            return found
    raise FileNotFoundError(f"{path} is neither a checkpoint directory (config.json) nor a training run with "
                            "checkpoints/latest")
