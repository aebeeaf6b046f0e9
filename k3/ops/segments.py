"""Packed variable-length segments as a value (:class:`Segments`), and segments <-> right-padded batches for the
reference ops.

Reading offsets on the host is a device-to-host copy that waits for the GPU. So the offsets travel as one
immutable :class:`Segments`: the offsets tensor on the device together with their values on the host, and what the
ops derive from them (lengths, fla's CPU offsets, int32 offsets, the conv's boundary tables), each made once per
value. The model makes one per forward (``K3ForCausalLM.forward``, from a tensor or from the Segments the trainer
made of its batch) and hands that one object to every layer, so the layers of a forward share what is derived and
none reads the offsets back.

The rule at the boundary: every function that takes ``cu_seqlens`` (the ops, the layers, the model) accepts a
:class:`Segments` or an int tensor, and one that reads the offsets on the host converts once, on entry, with
:func:`as_segments`; what it calls gets the Segments. A tensor on the CPU converts without a sync; a tensor on a
device is read back once (a sync), so callers that care pass a Segments (or offsets on the CPU). Int index lists
that ops also read on the host (cache slots, key lengths) travel the same way as :class:`HostInts`
(:func:`host_values`, :func:`device_values`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor on ``device`` without a host sync: on CUDA through pinned memory and an asynchronous copy (a
    plain copy from pageable memory waits for the device to catch up). Other moves are plain ``.to``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _on(t: Tensor, device: torch.device | str | None) -> bool:
    """Whether ``t`` already lives on ``device`` (None: anywhere; a device without an index: any of its type)."""
    if device is None:
        return True
    device = torch.device(device)
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


@dataclass(frozen=True, eq=False)
class HostInts:
    """An int tensor on its device (what kernels index with) and the same values on the host (what Python reads):
    cache slots and key lengths that both a kernel and a host loop use."""

    tensor: Tensor
    host: tuple[int, ...]

    @classmethod
    def from_host(cls, values: Sequence[int], device: torch.device | str, dtype=torch.int64) -> HostInts:
        """From host values, copied to ``device`` without a sync."""
        values = tuple(int(v) for v in values)
        return cls(to_device(torch.tensor(values, dtype=dtype), device), values)


def host_values(x: Tensor | HostInts) -> tuple[int, ...]:
    """The values of an int tensor on the host: a :class:`HostInts`' own copy, else read (on a device: a sync)."""
    return x.host if isinstance(x, HostInts) else tuple(x.tolist())


def device_values(x: Tensor | HostInts) -> Tensor:
    """The tensor of an int tensor or a :class:`HostInts`."""
    return x.tensor if isinstance(x, HostInts) else x


@dataclass(frozen=True, eq=False)
class Segments:
    """The offsets of N packed segments, ``0 = c_0 < ... < c_N`` (FlashAttention's ``cu_seqlens``): ``offsets``
    [N+1] (int32 or int64) on the device and ``host``, the same values on the host. Immutable: what is derived is
    made once per object (so the layers of a forward, handed the same object, share it); other offsets are another
    Segments.

    ``shard``: None, or the context-parallel shard these segments are one rank's slice of
    (:class:`k3.distributed.context_parallel.CPShard`: documents may continue on other ranks); the KDA and MLA
    layers then run its ``kda`` / ``mla`` forms instead of their own."""

    offsets: Tensor
    host: tuple[int, ...]
    shard: Any = None
    _derived: dict = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_host(
        cls, values: Sequence[int], device: torch.device | str = "cpu", dtype=torch.int64, shard: Any = None
    ) -> Segments:
        """From host offsets, copied to ``device`` without a sync."""
        values = tuple(int(v) for v in values)
        return cls(to_device(torch.tensor(values, dtype=dtype), device), values, shard)

    def to(self, device: torch.device | str) -> Segments:
        """The same segments with their offsets on ``device`` (no sync; itself when they are there already)."""
        return self if _on(self.offsets, device) else replace(self, offsets=to_device(self.offsets, device))

    @property
    def count(self) -> int:
        """N, the number of segments."""
        return len(self.host) - 1

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.host[:-1], self.host[1:]))

    @cached_property
    def max_length(self) -> int:
        return max(self.lengths)

    @cached_property
    def cpu(self) -> Tensor:
        """The offsets as a CPU int64 tensor, one object per Segments. fla caches what it derives from its
        arguments by their identity (``tensor_cache``), so with the same objects every layer of a forward reuses
        the chunk indices it built (and copied to the device) for the first; passed as fla's ``cu_seqlens_cpu``,
        it also spares fla reading the offsets back from the device (a host sync)."""
        return torch.tensor(self.host, dtype=torch.int64)

    @cached_property
    def int32(self) -> Tensor:
        """The offsets as int32 on their device (what FlashAttention's varlen kernels take)."""
        return self.offsets.to(torch.int32)

    def derived(self, key, build: Callable[[], Any]):
        """``build()`` (something computed from the offsets), made once per ``key`` and kept with these segments."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def check(self, total: int) -> tuple[int, ...]:
        """The N lengths, after checking that the offsets run from 0 to ``total`` and strictly increase (one
        ValueError otherwise)."""
        cu = self.host
        if len(cu) < 2:
            raise ValueError("cu_seqlens must have at least 2 entries")
        if cu[0] != 0 or cu[-1] != total:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={total}, got {cu[0]} .. {cu[-1]}")
        if min(self.lengths) <= 0:
            raise ValueError("cu_seqlens must be strictly increasing")
        return self.lengths


def as_segments(cu_seqlens: Segments | Tensor | None, device: torch.device | str | None = None) -> Segments | None:
    """``cu_seqlens`` as :class:`Segments` with the offsets on ``device`` (None: where they are): a Segments as it
    is (moved if need be, no sync); a 1-D int tensor read on the host (no sync on the CPU; one read, a sync, on a
    device) and moved without a sync; None stays None."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, Segments):
        return cu_seqlens if device is None else cu_seqlens.to(device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be a 1-D integer tensor with at least 2 entries")
    host = tuple(cu_seqlens.tolist())
    return Segments(cu_seqlens if _on(cu_seqlens, device) else to_device(cu_seqlens, device), host)


def pack_segments(x: Tensor, cu_seqlens: Segments | None, multiple: int = 1) -> Tensor:
    """Gather sequences into a right-padded batch.

    Args:
        x: [B, T, ...] time-major tensor.
        cu_seqlens: None (each batch row is a sequence) or N segments of T (needs B == 1).
        multiple: the padded length is rounded up to a multiple of this.

    Returns:
        [N, Tpad, ...] with zeros at padded positions (zeros in q, k, v, g, beta are identity
        steps of the KDA recurrence: no decay, no write).
    """
    B, T = x.shape[:2]
    if cu_seqlens is None:
        Tpad = -(-T // multiple) * multiple
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, Tpad - T))
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
    lengths = cu_seqlens.check(T)
    Tpad = -(-max(lengths) // multiple) * multiple
    if min(lengths) == Tpad:  # equal lengths needing no padding (e.g. one token each): a view, no gather
        return x[0].reshape(len(lengths), Tpad, *x.shape[2:])
    starts = cu_seqlens.offsets[:-1].to(device=x.device, dtype=torch.long)
    lens = torch.tensor(lengths, device=x.device)
    pos = torch.arange(Tpad, device=x.device)
    valid = pos[None, :] < lens[:, None]  # [N, Tpad]
    index = torch.where(valid, starts[:, None] + pos[None, :], 0)
    gathered = x[0][index]  # [N, Tpad, ...]
    valid = valid.view(valid.shape + (1,) * (x.dim() - 2))
    return torch.where(valid, gathered, torch.zeros((), dtype=x.dtype, device=x.device))


def unpack_segments(y: Tensor, cu_seqlens: Segments | None, T: int) -> Tensor:
    """Inverse of :func:`pack_segments`: [N, Tpad, ...] -> [B, T, ...], dropping padded positions."""
    if cu_seqlens is None:
        return y[:, :T]
    lengths = cu_seqlens.check(T)
    if min(lengths) == max(lengths) == y.shape[1]:
        return y.reshape(1, T, *y.shape[2:])
    pos = torch.arange(y.shape[1], device=y.device)
    valid = pos[None, :] < torch.tensor(lengths, device=y.device)[:, None]
    return y[valid].unsqueeze(0)  # row-major boolean indexing keeps segment order
