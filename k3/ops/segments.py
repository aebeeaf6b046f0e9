"""Variable-length segments (cu_seqlens) <-> right-padded batches, shared by the reference ops.

Reading ``cu_seqlens`` on the host is a device-to-host copy that waits for the GPU. The model reads it once per
forward and attaches the host copy to the tensor (:func:`attach_host`); :func:`host_list` then answers from it,
so the ops below need no further synchronisation. Offsets that start on the host go to the device with
:func:`offsets_to`, which keeps their host copy and does not wait for the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attach_host(t: torch.Tensor, values: list[int] | None = None) -> torch.Tensor:
    """Attach a host copy of an int tensor's values (read now if not given) and return the tensor."""
    t._k3_host = t.tolist() if values is None else list(values)
    return t


def host_list(t: torch.Tensor) -> list[int]:
    """The values of an int tensor as a list, from its attached host copy when it has one (no sync)."""
    values = getattr(t, "_k3_host", None)
    return t.tolist() if values is None else values


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: on CUDA through pinned memory and an asynchronous copy (a
    plain copy from pageable memory waits for the device to catch up). Other moves are plain ``.to``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def offsets_to(cu_seqlens: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``cu_seqlens`` on ``device`` (moved by :func:`to_device`) with its host copy attached: the one it carries or,
    on the CPU, its values (no sync either way; a device tensor without one is read back, a sync)."""
    return attach_host(to_device(cu_seqlens, device), host_list(cu_seqlens))


def derived(cu_seqlens: torch.Tensor, key, build):
    """``build()`` (something computed from the offsets), made once per ``key`` and kept on the tensor while its
    offsets stay the same (compared by value), so the layers of one forward share it."""
    offsets = tuple(host_list(cu_seqlens))
    cache = getattr(cu_seqlens, "_k3_derived", None)
    if cache is None or cache[0] != offsets:
        cache = cu_seqlens._k3_derived = (offsets, {})
    if key not in cache[1]:
        cache[1][key] = build()
    return cache[1][key]


def host_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` as a CPU int64 tensor, one object per offsets (see :func:`derived`). fla caches what it
    derives from its arguments by their identity (``tensor_cache``), so with the same objects every layer of a
    forward reuses the chunk indices it built (and copied to the device) for the first; passed as fla's
    ``cu_seqlens_cpu``, it also spares fla reading the offsets back from the device (a host sync)."""
    return derived(cu_seqlens, "host_offsets", lambda: torch.tensor(host_list(cu_seqlens), dtype=torch.int64))


def segment_lengths(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """Validate ``cu_seqlens`` ([N+1], 0 = c_0 < ... < c_N = T) and return the N lengths."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be a 1-D integer tensor with at least 2 entries")
    cu = host_list(cu_seqlens)
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu[0]} .. {cu[-1]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if min(lengths) <= 0:
        raise ValueError("cu_seqlens must be strictly increasing")
    return lengths


def pack_segments(x: torch.Tensor, cu_seqlens: torch.Tensor | None, multiple: int = 1) -> torch.Tensor:
    """Gather sequences into a right-padded batch.

    Args:
        x: [B, T, ...] time-major tensor.
        cu_seqlens: None (each batch row is a sequence) or [N+1] offsets into T (needs B == 1).
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
    lengths = segment_lengths(cu_seqlens, T)
    Tpad = -(-max(lengths) // multiple) * multiple
    if min(lengths) == Tpad:  # equal lengths needing no padding (e.g. one token each): a view, no gather
        return x[0].reshape(len(lengths), Tpad, *x.shape[2:])
    starts = cu_seqlens[:-1].to(device=x.device, dtype=torch.long)
    lens = torch.tensor(lengths, device=x.device)
    pos = torch.arange(Tpad, device=x.device)
    valid = pos[None, :] < lens[:, None]  # [N, Tpad]
    index = torch.where(valid, starts[:, None] + pos[None, :], 0)
    gathered = x[0][index]  # [N, Tpad, ...]
    valid = valid.view(valid.shape + (1,) * (x.dim() - 2))
    return torch.where(valid, gathered, torch.zeros((), dtype=x.dtype, device=x.device))


def unpack_segments(y: torch.Tensor, cu_seqlens: torch.Tensor | None, T: int) -> torch.Tensor:
    """Inverse of :func:`pack_segments`: [N, Tpad, ...] -> [B, T, ...], dropping padded positions."""
    if cu_seqlens is None:
        return y[:, :T]
    lengths = segment_lengths(cu_seqlens, T)
    if min(lengths) == max(lengths) == y.shape[1]:
        return y.reshape(1, T, *y.shape[2:])
    pos = torch.arange(y.shape[1], device=y.device)
    valid = pos[None, :] < torch.tensor(lengths, device=y.device)[:, None]
    return y[valid].unsqueeze(0)  # row-major boolean indexing keeps segment order
