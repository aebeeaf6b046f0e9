"""The device mesh: ``world = dp x cp`` ranks; expert parallelism carves ``ep`` out of the data-parallel ranks.

Mesh dimensions (``init_device_mesh`` shape ``(dp // ep, ep, cp)``):
  ``dp_rep`` - data-parallel replicas of each expert shard;  ``ep`` - ranks that split the routed experts (they
  see different tokens, so they are data-parallel for everything else too);  ``cp`` - ranks that split every
  sequence into contiguous pieces.
Flattened: ``dp`` = (dp_rep, ep) - the ranks holding different data; ``dp_cp`` = every rank - what dense
gradients, losses and router statistics are reduced over.
Rank layout (row-major over the shape): rank = (dp_rep * ep + ep_rank) * cp + cp_rank, so a CP group is ``cp``
consecutive ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp

    def validate(self, world: int | None = None) -> None:
        for name in ("dp", "ep", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name}={v!r} must be a positive integer")
        if self.dp % self.ep:
            raise ValueError(
                f"--ep={self.ep} must divide --dp={self.dp} (expert-parallel ranks are data-parallel ranks too)"
            )
        if world is not None and world != self.world:
            raise ValueError(
                f"--dp {self.dp} x --cp {self.cp} = {self.world} ranks, but the world has {world} "
                "processes (torchrun --nproc-per-node)"
            )


NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() and os.environ.get("K3_DIST_DEVICE", "auto") != "cpu" else "cpu"


def init_distributed(dims: ParallelDims, device: str | None = None) -> "Meshes":
    """Initialise the default process group if needed (nccl on CUDA, gloo on CPU; NVLink multicast off) and
    build the mesh. Call under torchrun (or with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set)."""
    device = device or device_type()
    if device == "cuda":
        for k, v in NO_MULTICAST_ENV.items():
            os.environ.setdefault(k, v)
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    dims.validate(dist.get_world_size())
    return build_mesh(dims, device)


@dataclass(frozen=True)
class Meshes:
    """The root mesh and the 1-D meshes the parallelisms use (``group()`` gives each one's process group)."""

    root: DeviceMesh
    dims: ParallelDims
    dp: DeviceMesh  # flattened (dp_rep, ep): ranks with different data
    ep: DeviceMesh
    cp: DeviceMesh
    dp_cp: DeviceMesh  # every rank

    @property
    def device_type(self) -> str:
        return self.root.device_type


def build_mesh(dims: ParallelDims, device: str = "cpu") -> Meshes:
    """The 3-D mesh (dp_rep, ep, cp) with its flattened ``dp`` and ``dp_cp`` dimensions (process group needed)."""
    dims.validate(dist.get_world_size())
    root = init_device_mesh(device, (dims.dp // dims.ep, dims.ep, dims.cp), mesh_dim_names=("dp_rep", "ep", "cp"))
    dp = root["dp_rep", "ep"]._flatten("dp")
    dp_cp = root["dp_rep", "ep", "cp"]._flatten("dp_cp")
    return Meshes(root, dims, dp, root["ep"], root["cp"], dp_cp)
