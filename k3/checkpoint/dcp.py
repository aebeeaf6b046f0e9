"""Training checkpoints with torch.distributed.checkpoint (DCP): sharded, atomic, resharding on load.

Layout of a checkpoint directory:
  ``.metadata``, ``__*_*.distcp``   DCP: {"model": model state, "optim": optimizer state}, keyed by parameter
                                    names (FQNs), every tensor with its GLOBAL shape; each rank writes its shards
                                    (replicas are written once)
  ``extra.pt``                      ``extra`` (step, data position, configs, ...) as given by rank 0 (torch.save;
                                    read back with ``weights_only=True``: tensors and plain data only)

Saving is atomic at the directory level: every rank writes into one temp directory beside the target, and after
a barrier rank 0 swaps it in (k3.fs: fsync, then renameat2 exchange), so ``path`` is either the old
checkpoint or the complete new one. All ranks must see the same filesystem.

Resharding: the state is described by global shapes, so a checkpoint saved with any (dp, ep) loads with any other
(FSDP shards and EP expert shards are re-cut on load), and into a plain single-device model (and K3Muon) with
:func:`load_into_single` - the same parameter names, since FSDP2 and EP keep them.

The optimiser must be built from the same param groups (``param_groups_for``) on the model as prepared for the
run (after ``apply_expert_parallel`` / ``apply_fsdp``); its state is created (zeros, a step at lr 0) before loading
if it has none.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from k3.fs import atomic_directory

EXTRA_FILE = "extra.pt"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _write(tmp: Path, model: nn.Module, optimizer, extra: dict | None) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    if _rank() == 0:
        torch.save(dict(extra or {}), tmp / EXTRA_FILE)
    _barrier()  # every shard is on disk before rank 0 swaps the directory in


def save(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict | None = None
) -> Path:
    """Save model + optimizer (sharded, DCP) and ``extra`` (rank 0's) atomically to directory ``path``; every
    rank calls it. Returns ``path``."""
    path = Path(path)
    if _rank() == 0:
        with atomic_directory(path) as tmp:
            if _distributed():
                dist.broadcast_object_list([str(tmp)], src=0)
            _write(tmp, model, optimizer, extra)
    else:
        name = [None]
        dist.broadcast_object_list(name, src=0)
        _write(Path(name[0]), model, optimizer, extra)
    _barrier()  # the new checkpoint is in place when save returns, on every rank
    return path


def load(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, no_dist: bool = False
) -> dict:
    """Load a :func:`save` checkpoint into ``model`` (and ``optimizer``) as they are laid out now (any dp / ep,
    or none); returns ``extra``. Every rank calls it (``no_dist=True``: this process alone, see
    :func:`load_into_single`)."""
    path = Path(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path} is not a DCP checkpoint (no .metadata)")
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        _dcp_load({"model": model_sd}, path, no_dist)
        set_model_state_dict(model, model_sd)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # creates the optimizer state if it has none
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path, no_dist)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return read_extra(path)


def read_extra(path: str | os.PathLike) -> dict:
    """A checkpoint's ``extra`` as tensors and plain data only (``weights_only``): loading a checkpoint from
    elsewhere cannot run code. Anything else in the file is refused with one ValueError."""
    file = Path(path) / EXTRA_FILE
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{file} holds more than tensors and plain data; refused ({first})") from None


def _dcp_load(state: dict, path: Path, no_dist: bool) -> None:
    """dcp.load, its failures (a CheckpointException, which is a BaseException carrying every rank's traceback)
    turned into one ValueError naming the first: a missing tensor or a shape that does not match."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    except CheckpointException as e:
        rank, (exc, _) = next(iter(e.failures.items()))
        raise ValueError(f"{path} does not match the model (rank {rank}): {type(exc).__name__}: {exc}") from None


def load_into_single(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint saved on any number of ranks into a plain single-device model (K3ForCausalLM with no
    FSDP / EP) and optionally its K3Muon (built with ``param_groups_for``), in this process only (no process
    group needed, none used if one exists). Returns ``extra``."""
    with warnings.catch_warnings():  # DCP's notice that it loads in one process: what was asked for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return load(path, model, optimizer, no_dist=True)
