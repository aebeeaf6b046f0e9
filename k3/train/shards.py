"""DTensor parameters (FSDP2 shards, expert-parallel stacks; see k3.distributed) as the optimiser sees them: this
rank's local view of a parameter or its state, and whole matrices for Newton-Schulz.

Newton-Schulz needs whole matrices: a ``muon_expert`` stack sharded only along its expert dim (EP, or FSDP's
Shard(0)) holds whole expert matrices locally; any other sharded matrix has its update gathered
(:func:`_full`), orthogonalised whole, and each rank keeps its own shard (:func:`_shard_like`). Plain tensors
pass through unchanged, so the single-device arithmetic is untouched.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.cache
def _dtensor_type():
    """torch.distributed.tensor.DTensor, imported on first use (None on builds without torch.distributed)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_shard(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: in-place updates reach the DTensor); plain tensors unchanged."""
    return t.to_local() if _is_dtensor(t) else t


def _sharded_only_on_dim0(p: Tensor) -> bool:
    """Every shard of the DTensor p holds whole slices along dim 0 (for an expert stack: whole expert matrices)."""
    from torch.distributed.tensor import Replicate, Shard

    return all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in p.placements)


def _full(local: Tensor, like: Tensor) -> Tensor:
    """The whole tensor of which ``local`` is this rank's shard, sharded like the DTensor ``like`` (all-gather)."""
    cls = _dtensor_type()
    return cls.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    ).full_tensor()


def _shard_like(full: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of ``full`` (identical on every rank) under the placements of ``like`` (no communication)."""
    from torch.distributed.tensor import Replicate

    cls, mesh = _dtensor_type(), like.device_mesh
    replicated = cls.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()
