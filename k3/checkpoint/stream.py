"""Streamed, parallel reading of safetensors shards (k3.checkpoint.load builds the model they fill).

Every shard's header is parsed and checked first (:func:`read_header`); then :func:`load_shards` reads the shards
``workers`` at a time (default one per core, at most 8), each front to back with its SHA-256 computed on the same
bytes on a thread of its own (file reads and hashlib release the GIL). Onto the CPU each tensor is read straight
into its final storage; onto a GPU the file goes through three reused pinned buffers per worker (all together
<= 1 GiB), copied out on a side stream while the next chunk is read. Tensors that are cast, split or dequantised on
the way are read whole into host buffers, at most a shard's worth at once (``_Budget``). A bad shard (checksum,
truncated, non-finite values) stops the other workers and fails with one error.

What goes where is the caller's *placer* (k3.checkpoint.load's): ``place.wanted(entry)`` (False: the tensor is not
kept, its bytes are read only to be hashed, else skipped), ``place.direct(entry)`` (the destination its bytes land
in unchanged, or None), ``place(path, entry, host_bytes)`` (place a tensor read whole), ``place.check_finite(path,
name, tensor)``, ``place.verify`` and ``place.dest`` (the destination tensors). A shard that is not hashed and holds
no wanted tensor is not opened at all, so a process that keeps part of a model reads only that part.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from k3.checkpoint.format import CHECKSUMS, StreamHasher, _sha256

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    _ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
E8M0 = getattr(torch, "float8_e8m0fnu", None)
_CHUNK = 64 << 20  # bytes per read
_MAX_HEADER = 100 << 20
_MAX_WORKERS = 8  # shards read at once by default, at most
_STAGING_BYTES = 1 << 30  # pinned host buffers for the copies to GPUs, all workers together
_STAGE_BUFFERS = 3  # per worker: one being read into while the others are hashed and copied out
_SKIP_BLOCK = 2 << 20  # bytes per read of data that is only hashed (two in flight per shard)


@dataclass
class Entry:
    """One tensor of a safetensors file: its name, dtype, shape and absolute byte range."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> tuple[list[Entry], int]:
    """A safetensors file's tensors (sorted by offset) and where its data begins; one ValueError naming the file
    for anything malformed (short header, bad JSON, unknown dtype, a byte range that does not fit)."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{path} is not a valid safetensors file (truncated or corrupted): {why}")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise bad(f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    base, entries = 8 + n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed or unsupported entry {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or end - start != numel * dtype.itemsize or start < 0 or base + end > size:
            raise bad(
                f"tensor {name!r}: bytes {start}..{end} do not hold {list(shape)} {info['dtype']} inside "
                f"the file's {size - base} data bytes"
            )
        entries.append(Entry(name, dtype, shape, base + start, base + end))
    entries.sort(key=lambda e: e.start)
    for prev, e in zip(entries, entries[1:]):
        if e.start < prev.end:
            raise bad(f"tensors {prev.name!r} and {e.name!r} overlap")
    return entries, base


def default_workers(n_files: int) -> int:
    """Shards read at once by default: one per CPU core, at most ``_MAX_WORKERS`` and the number of shards."""
    return max(1, min(n_files, os.cpu_count() or 1, _MAX_WORKERS))


class _Cancelled(Exception):
    """Another shard failed: this one stops where it is."""


def _truncated(path: Path) -> ValueError:
    return ValueError(f"{path} is not a valid safetensors file (truncated or corrupted): it ends early")


class _Budget:
    """Host bytes of the tensors read whole before being placed (cast, split, dequantised), all shards together:
    at most ``limit`` at once, except that a tensor larger than ``limit`` goes through alone."""

    def __init__(self, limit: int):
        self.limit, self.used, self.peak, self.cond = limit, 0, 0, threading.Condition()

    def take(self, n: int, cancel: threading.Event) -> int:
        with self.cond:
            while self.used and self.used + n > self.limit:
                if cancel.is_set():
                    raise _Cancelled
                self.cond.wait(0.05)
            self.used += n
            self.peak = max(self.peak, self.used)
        return n

    def give(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


class _Stage:
    """One worker's host buffers for copies to GPUs (pinned there), filled in turn: a buffer is refilled only once
    the copies out of it are done (CUDA events) and it is hashed, so reading, hashing and copying overlap."""

    def __init__(self, count: int, size: int, pin: bool):
        self.bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
        self.views = [memoryview(b.numpy()) for b in self.bufs]
        self.waits: list[tuple[list, int]] = [([], 0)] * count
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.used: set = set()
        self.turn = 0

    def stream(self, device: torch.device):
        """The side stream that copies into ``device``, marked as used by the chunk being dispatched."""
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        self.used.add(device)
        return self.streams[device]

    def take(self, hasher: StreamHasher) -> int:
        k = self.turn % len(self.bufs)
        self.turn += 1
        events, ticket = self.waits[k]
        for ev in events:
            ev.synchronize()
        hasher.wait(ticket)
        self.used = set()
        return k

    def release(self, k: int, ticket: int) -> None:
        events = []
        for device in self.used:
            events.append(torch.cuda.Event())
            events[-1].record(self.streams[device])
        self.waits[k] = (events, ticket)

    def drain(self) -> None:
        """Wait for every copy out of the buffers (the hashes: ``StreamHasher.close``)."""
        for s in self.streams.values():
            s.synchronize()
        self.waits = [([], 0)] * len(self.bufs)


def _stage_size(workers: int) -> int:
    """Bytes per staging buffer: a power of two (the pinned allocator rounds up to one) at most ``_CHUNK``, so that
    all workers' buffers together stay within ``_STAGING_BYTES``."""
    fit = max(1, _STAGING_BYTES // (_STAGE_BUFFERS * workers))
    return min(_CHUNK, 1 << (fit.bit_length() - 1))


class _Skipper:
    """Moves a shard's read position past bytes that hold nothing to keep (header, gaps, tensors not wanted, the
    tail): read into two reused buffers and hashed when the file is hashed (at most two blocks in flight), else
    seeked over (the header check has made sure the file holds them)."""

    def __init__(self, f, hasher: StreamHasher, path: Path):
        self.f, self.hasher, self.path = f, hasher, path
        self.views: list[memoryview] = []
        self.tickets, self.turn = [0, 0], 0

    def __call__(self, n: int) -> None:
        if n <= 0:
            return
        if self.hasher.h is None:
            self.f.seek(n, os.SEEK_CUR)
            return
        if not self.views:  # pages are touched only as far as they are filled
            self.views = [memoryview(bytearray(_SKIP_BLOCK)) for _ in range(2)]
        while n > 0:
            k = self.turn % 2
            self.turn += 1
            self.hasher.wait(self.tickets[k])
            view = self.views[k][: min(n, _SKIP_BLOCK)]
            if _fill(self.f, view) < len(view):
                raise _truncated(self.path)
            self.tickets[k] = self.hasher.feed(view)
            n -= len(view)


def _fill(f, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; the number of bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _read_shard(f, path: Path, entries: list[Entry], place, hasher: StreamHasher, budget: _Budget, cancel) -> None:
    """Onto the CPU: each tensor in file order, read straight into its destination when it lands there unchanged,
    else into a host buffer (under ``budget``) and then placed; what is not kept (header, gaps, tensors not
    wanted, the tail) is read and hashed when the file is hashed, else seeked over."""
    skip, pos = _Skipper(f, hasher, path), 0
    for e in entries:
        if cancel.is_set():
            raise _Cancelled
        if not place.wanted(e):
            continue  # its bytes go with the next gap
        skip(e.start - pos)
        nbytes, dest = e.end - e.start, place.direct(e)
        dest = dest if dest is not None and dest.device.type == "cpu" else None
        held = 0 if dest is not None else budget.take(nbytes, cancel)
        try:
            buf = dest.reshape(-1).view(torch.uint8) if dest is not None else torch.empty(nbytes, dtype=torch.uint8)
            mv, ticket = memoryview(buf.numpy()), 0
            for off in range(0, nbytes, _CHUNK):
                view = mv[off : off + _CHUNK]
                if _fill(f, view) < len(view):
                    raise _truncated(path)
                ticket = hasher.feed(view)
            if dest is not None:
                place.check_finite(path, e.name, dest)
            else:
                place(path, e, buf)
                hasher.wait(ticket)  # the buffer is freed next
        finally:
            budget.give(held)
        pos = e.end
    skip(path.stat().st_size - pos)  # trailing bytes are checksummed too


def _stream_shard(f, path: Path, entries: list[Entry], place, hasher: StreamHasher, budget: _Budget, cancel, stage):
    """Onto GPUs: the whole file read in chunks into ``stage``'s buffers, each chunk hashed and its tensors' slices
    copied out, asynchronously into the destination when the tensor lands there unchanged, else into a host
    buffer (under ``budget``) placed once whole. Finiteness of the direct tensors is checked at the end. A file
    that is not hashed is read only from each wanted tensor on (seeked to), and no further than the last."""
    pos, i, cur, flags = 0, 0, None, []  # cur: (entry, flat destination bytes, dest or None, budget held)
    try:
        while True:  # to the end of the file: trailing bytes belong to its checksum too
            if cancel.is_set():
                raise _Cancelled
            if hasher.h is None and cur is None:
                while i < len(entries) and not place.wanted(entries[i]):
                    i += 1
                if i == len(entries):
                    break
                if entries[i].start > pos:
                    f.seek(entries[i].start)
                    pos = entries[i].start
            k = stage.take(hasher)
            buf, n = stage.bufs[k], _fill(f, stage.views[k])
            ticket = hasher.feed(stage.views[k][:n])
            end = pos + n
            while i < len(entries) and (entries[i].start < end or entries[i].end <= end):
                e = entries[i]
                if cur is None and not place.wanted(e):
                    if e.end > end:
                        break
                    i += 1
                    continue
                if cur is None:
                    dest = place.direct(e)
                    held = 0 if dest is not None else budget.take(e.end - e.start, cancel)
                    flat = torch.empty(e.end - e.start, dtype=torch.uint8) if dest is None else None
                    cur = (e, dest.reshape(-1).view(torch.uint8) if dest is not None else flat, dest, held)
                lo, hi = max(e.start, pos), min(e.end, end)
                if hi > lo:
                    out, src = cur[1][lo - e.start : hi - e.start], buf[lo - pos : hi - pos]
                    if out.device.type == "cuda":
                        with torch.cuda.stream(stage.stream(out.device)):
                            out.copy_(src, non_blocking=True)
                    else:
                        out.copy_(src)
                if e.end > end:
                    break
                _, flat, dest, held = cur
                cur = None
                if dest is None:
                    place(path, e, flat)
                    budget.give(held)
                elif dest.device.type == "cuda":
                    if place.verify and dest.is_floating_point():
                        with torch.cuda.stream(stage.stream(dest.device)):
                            flags.append((e.name, dest, all_finite(dest)))
                else:
                    place.check_finite(path, e.name, dest)
                i += 1
            stage.release(k, ticket)
            pos = end
            if n < len(buf):
                break
    finally:
        if cur is not None:
            budget.give(cur[3])
        stage.drain()
    if i < len(entries):
        raise _truncated(path)
    by_device: dict[torch.device, list] = {}
    for item in flags:
        by_device.setdefault(item[1].device, []).append(item)
    for items in by_device.values():  # one host sync per device; the exact test only on a failure
        if not bool(torch.stack([flag for _, _, flag in items]).all()):
            for name, dest, _ in items:
                place.check_finite(path, name, dest)


_EXPONENT = {  # a floating dtype -> (the int dtype of its width, its exponent bits): all ones is NaN or inf
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}
_FINITE_STEP = 1 << 18  # elements per host check (its scratch stays in cache)


def all_finite(t: Tensor) -> Tensor:
    """On a GPU: a 0-d bool, every element of the floating tensor ``t`` finite (min and max carry any NaN or inf
    and, unlike a sum, cannot overflow); no host sync."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    try:
        lo, hi = torch.aminmax(t.reshape(-1))
    except (RuntimeError, NotImplementedError):  # float8: no min / max kernels
        return torch.isfinite(t).all()
    return torch.isfinite(lo) & torch.isfinite(hi)


def host_finite(t: Tensor) -> bool:
    """Every element of the floating CPU tensor ``t`` finite: no element's exponent bits all ones, tested with
    numpy on the calling thread in cache-sized steps (a torch reduction would start its thread pool from each
    worker at once, and a float32 sum of bf16 runs below 0.5 GB/s)."""
    if t.dtype not in _EXPONENT or not t.is_contiguous():
        return bool(torch.isfinite(t).all())
    ints, mask = _EXPONENT[t.dtype]
    bits = t.reshape(-1).view(ints).numpy()
    scratch = np.empty(min(len(bits), _FINITE_STEP), dtype=bits.dtype)
    for off in range(0, len(bits), _FINITE_STEP):
        part = scratch[: min(_FINITE_STEP, len(bits) - off)]
        np.bitwise_and(bits[off : off + _FINITE_STEP], mask, out=part)
        if part.max() == mask:
            return False
    return True


def _load_shard(path: Path, entries: list[Entry], place, expected: str | None, budget, cancel, stages):
    """Read, hash and place one shard (``stages``: a queue of staging buffer sets when loading onto GPUs, one
    taken per shard, else None); one ValueError naming the file when it is corrupted or truncated."""
    hasher = StreamHasher(hashlib.sha256() if expected is not None else None)
    stage = stages.get() if stages is not None else None
    try:
        with open(path, "rb", buffering=0) as f:
            if stage is None:
                _read_shard(f, path, entries, place, hasher, budget, cancel)
            else:
                _stream_shard(f, path, entries, place, hasher, budget, cancel, stage)
    except ValueError:
        hasher.close()  # stop reading it before reading it again
        if expected is not None and _sha256(path) != expected:  # a bad byte explains the bad data: say so
            raise ValueError(f"{path} is corrupted: its SHA-256 differs from {CHECKSUMS}") from None
        raise
    finally:
        digest = hasher.close()
        if stage is not None:
            stages.put(stage)
    if expected is not None and digest != expected:
        raise ValueError(f"{path} is corrupted: its SHA-256 differs from {CHECKSUMS}")


def load_shards(
    directory: Path, files: list[str], entries: dict[str, list[Entry]], place, expected: dict[str, str], workers: int
) -> None:
    """The shards ``files`` of ``directory`` (``entries``: each one's header), ``workers`` at a time, those named in
    ``expected`` checked against their SHA-256; a shard holding no wanted tensor and not to be checked is not opened.
    On a failure the others stop and the first failing file's error is raised (after every worker has stopped, so
    nothing writes into the model afterwards)."""
    files = [f for f in files if f in expected or any(place.wanted(e) for e in entries[f])]
    if not files:
        return
    workers = max(1, min(workers, len(files)))
    budget = _Budget(max((directory / f).stat().st_size for f in files))
    stages = None
    if _staged(place):
        stages = queue.SimpleQueue()
        pin = torch.cuda.is_available()
        for _ in range(workers):
            stages.put(_Stage(_STAGE_BUFFERS, _stage_size(workers), pin))
    cancel = threading.Event()

    def one(fname: str) -> None:
        if cancel.is_set():
            raise _Cancelled
        try:
            _load_shard(directory / fname, entries[fname], place, expected.get(fname), budget, cancel, stages)
        except BaseException:
            cancel.set()
            raise

    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="k3-load") as pool:
            futures = [pool.submit(one, fname) for fname in files]
        errors = [fut.exception() for fut in futures]
        for err in errors:
            if err is not None and not isinstance(err, _Cancelled):
                raise err
    finally:
        while stages is not None and not stages.empty():  # give the pinned staging memory back
            stages.get()
        if stages is not None and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def _staged(place) -> bool:
    """Whether any tensor goes to a GPU (then every shard is read through the pinned staging buffers)."""
    return any(t.device.type == "cuda" for t in place.dest.values())
