"""Streamed loading of HF-layout checkpoints (docs/architecture.md#checkpoints): ``from_pretrained``.

The model is built on the meta device, every shard's header is read and checked against it first (names, shapes),
then the shards are read ``workers`` at a time (default one per core, at most 8), each front to back with its
SHA-256 computed on the same bytes on a thread of its own (file reads and hashlib release the GIL). Onto the CPU
each tensor is read straight into its final storage; onto a GPU the file goes through three reused pinned buffers
per worker (all together <= 1 GiB), copied out on a side stream while the next chunk is read. Tensors that are
cast, split or dequantised on the way are read whole into host buffers, at most a shard's worth at once
(``_Budget``): host memory while loading onto a GPU stays within one shard + 1 GiB; onto the CPU, near the model
itself. A bad shard (checksum, truncated, wrong shapes, non-finite values) stops the other workers and fails with
one error before the model is returned. Packed MXFP4 experts are dequantised (``packed="dequantize"``, on the
weight's device) or kept packed for inference (``packed="keep"``). ``load_eager`` is the plain all-in-memory
loader, for comparisons.
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

from k3.config import K3Config
from k3.convert.adapters import is_adapter_dir, not_a_model
from k3.convert.names import from_files, map_tensor, vision_layout
from k3.quant.packed import PACKED, SCALE, map_packed_pairs, read_quantization, unpack_weight, use_packed_experts

from k3.convert.checkpoint import (
    CHECKSUMS,
    INDEX,
    SINGLE,
    StreamHasher,
    _sha256,
    _weight_files,
    check_state,
    expected_checksums,
    read_config,
    read_config_json,
    read_tensors,
)


def _from_dcp(directory: Path, config):
    """The model of a distributed training checkpoint (DCP shards + config.json), gathered into this process (DCP
    checks its own metadata; there are no checksum files to verify). The model is built on the meta device and
    given uninitialised CPU storage, which the load overwrites whole (DCP raises on any tensor the checkpoint
    lacks, and the model has no tensors outside its state dict): no random init is computed and thrown away."""
    from k3.convert.dcp import load_into_single
    from k3.model.decoder import K3ForCausalLM
    from k3.model.multimodal import K3ForConditionalGeneration

    with torch.device("meta"):
        model = (K3ForConditionalGeneration if config.vision is not None else K3ForCausalLM)(config)
    model.to_empty(device="cpu")
    load_into_single(directory, model)
    return model


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
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_CHUNK = 64 << 20  # bytes per read
_MAX_HEADER = 100 << 20
_MAX_WORKERS = 8  # shards read at once by default, at most
_STAGING_BYTES = 1 << 30  # pinned host buffers for the copies to GPUs, all workers together
_STAGE_BUFFERS = 3  # per worker: one being read into while the others are hashed and copied out


@dataclass
class _Entry:
    """One tensor of a safetensors file: its name, dtype, shape and absolute byte range."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> tuple[list[_Entry], int]:
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
        entries.append(_Entry(name, dtype, shape, base + start, base + end))
    entries.sort(key=lambda e: e.start)
    for prev, e in zip(entries, entries[1:]):
        if e.start < prev.end:
            raise bad(f"tensors {prev.name!r} and {e.name!r} overlap")
    return entries, base


def _device_of(device) -> callable:
    """name -> torch.device: one device, or a map of module prefix -> device (the longest prefix wins; "" is
    everything else)."""
    if not isinstance(device, dict):
        dev = torch.device(device)
        return lambda name: dev
    table = sorted(((k, torch.device(v)) for k, v in device.items()), key=lambda kv: -len(kv[0]))

    def lookup(name: str) -> torch.device:
        for prefix, dev in table:
            if prefix == "" or name == prefix or name.startswith(prefix + "."):
                return dev
        raise ValueError(
            f"device map {sorted(device)} places no module prefix of {name!r}; add an entry "
            'for it or a default under ""'
        )

    return lookup


def _main_dtype(specs: dict[str, Tensor]) -> torch.dtype:
    """The floating dtype holding most bytes, not counting the fp32-kept tensors (router, A_log, dt_bias)."""
    from k3.model.decoder import FP32_NAMES

    count: dict[torch.dtype, int] = {}
    for name, t in specs.items():
        if t.is_floating_point() and t.dtype != _E8M0 and not name.endswith(FP32_NAMES):
            count[t.dtype] = count.get(t.dtype, 0) + t.numel() * t.element_size()
    return max(count, key=count.get) if count else torch.float32


def _dequantized_specs(specs: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Header specs with each packed pair ``X.weight_packed`` + ``X.weight_scale`` replaced by ``X.weight`` in
    ``dtype`` (shapes only; the pairs checked by k3.quant.packed.map_packed_pairs)."""
    return map_packed_pairs(
        specs, lambda packed, scale: torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=dtype, device="meta")
    )


@dataclass
class LoadPlan:
    """What a checkpoint holds, from its headers alone: files, their tensors, our state dict's shapes / dtypes."""

    directory: Path
    files: list[str]
    entries: dict[str, tuple[list[_Entry], int]]
    layout: str
    state: dict[str, Tensor]  # meta tensors, in our names, file dtypes (dequantised experts: ``dequant_dtype``)
    main_dtype: torch.dtype
    quantized: str | None


def plan_load(directory: str | os.PathLike, packed: str = "dequantize", dtype: torch.dtype | None = None) -> LoadPlan:
    """Read config-independent facts of a checkpoint from its headers (no tensor data) and map them to our names."""
    directory = Path(directory)
    config = read_config(directory)
    quantized = read_quantization(read_config_json(directory))
    weight_map = _weight_files(directory)
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
    entries, specs = {}, {}
    for fname in files:
        entries[fname] = read_header(directory / fname)
        for e in entries[fname][0]:
            if weight_map and weight_map.get(e.name) != fname:
                raise ValueError(f"{directory / fname} holds {e.name!r}, which {INDEX} does not map to it")
            if e.name in specs:
                raise ValueError(f"{directory}: tensor {e.name!r} is in more than one file")
            specs[e.name] = torch.empty(e.shape, dtype=torch.uint8 if e.dtype == _E8M0 else e.dtype, device="meta")
    missing = sorted(set(weight_map) - set(specs))
    if missing:
        raise ValueError(f"tensors listed in {INDEX} are absent from their files: {missing[:8]}")
    main = _main_dtype(specs)
    if quantized is not None and packed == "dequantize":
        specs = _dequantized_specs(specs, dtype or main)
    layout = vision_layout(specs)
    state = from_files(specs, config)
    return LoadPlan(directory, files, entries, layout, state, main, quantized)


def _target_dtype(name: str, spec: Tensor, model_t: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """Floating tensors: fp32 for the fp32-kept ones (router, its bias, A_log, dt_bias), else ``dtype`` or, when
    it is None, the file's; everything else (packed bytes): the model's own dtype."""
    from k3.model.decoder import FP32_NAMES

    if not (spec.is_floating_point() and model_t.is_floating_point()):
        return model_t.dtype
    if name.endswith(FP32_NAMES):
        return torch.float32
    return dtype or spec.dtype


def _materialise(model: torch.nn.Module, plan: LoadPlan, dtype: torch.dtype | None, device_of) -> None:
    """Give every meta parameter / buffer of ``model`` empty storage in its final dtype and device; buffers the
    checkpoint does not hold (non-persistent ones) must be real already and are moved / cast like the model."""
    from k3.model.decoder import FP32_NAMES

    model_dtype = dtype or plan.main_dtype
    for mod_name, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            table = getattr(module, kind)
            for key, t in list(table.items()):
                if t is None:
                    continue
                full = f"{mod_name}.{key}" if mod_name else key
                dev = device_of(full)
                if full in plan.state:
                    new = torch.empty(t.shape, dtype=_target_dtype(full, plan.state[full], t, dtype), device=dev)
                elif t.is_meta:
                    raise ValueError(
                        f"{full}: not in the checkpoint and has no value after building on the meta "
                        "device (a buffer without an initialiser)"
                    )
                else:
                    want = (
                        t.dtype
                        if not t.is_floating_point()
                        else (torch.float32 if full.endswith(FP32_NAMES) else model_dtype)
                    )
                    new = t.detach().to(device=dev, dtype=want)
                table[key] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if kind == "_parameters" else new


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


def _skip(f, n: int, hasher: StreamHasher, path: Path) -> None:
    """Read (and hash) ``n`` bytes that hold no tensor."""
    while n > 0:
        block = f.read(min(n, _CHUNK))
        if not block:
            raise _truncated(path)
        hasher.feed(block)
        n -= len(block)


def _fill(f, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; the number of bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _read_shard(f, path: Path, entries: list[_Entry], place, hasher: StreamHasher, budget: _Budget, cancel) -> None:
    """Onto the CPU: each tensor in file order, read straight into its destination when it lands there unchanged,
    else into a host buffer (under ``budget``) and then placed; header and gaps are read and hashed too."""
    pos = 0
    for e in entries:
        if cancel.is_set():
            raise _Cancelled
        _skip(f, e.start - pos, hasher, path)
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


def _stream_shard(f, path: Path, entries: list[_Entry], place, hasher: StreamHasher, budget: _Budget, cancel, stage):
    """Onto GPUs: the whole file read in chunks into ``stage``'s buffers, each chunk hashed and its tensors' slices
    copied out, asynchronously into the destination when the tensor lands there unchanged, else into a host
    buffer (under ``budget``) placed once whole. Finiteness of the direct tensors is checked at the end."""
    pos, i, cur, flags = 0, 0, None, []  # cur: (entry, flat destination bytes, dest or None, budget held)
    try:
        while True:  # to the end of the file: trailing bytes belong to its checksum too
            if cancel.is_set():
                raise _Cancelled
            k = stage.take(hasher)
            buf, n = stage.bufs[k], _fill(f, stage.views[k])
            ticket = hasher.feed(stage.views[k][:n])
            end = pos + n
            while i < len(entries) and (entries[i].start < end or entries[i].end <= end):
                e = entries[i]
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
                            flags.append((e.name, dest, _all_finite(dest)))
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


def _all_finite(t: Tensor) -> Tensor:
    """On a GPU: a 0-d bool, every element of the floating tensor ``t`` finite (min and max carry any NaN or inf
    and, unlike a sum, cannot overflow); no host sync."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    try:
        lo, hi = torch.aminmax(t.reshape(-1))
    except (RuntimeError, NotImplementedError):  # float8: no min / max kernels
        return torch.isfinite(t).all()
    return torch.isfinite(lo) & torch.isfinite(hi)


def _host_finite(t: Tensor) -> bool:
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


class _Placer:
    """Puts each file tensor (renamed, reshaped, dequantised) into the materialised model's storage; shared by the
    shard workers (the halves of a packed pair may come from two shards)."""

    def __init__(self, model, plan: LoadPlan, config: K3Config, packed: str, verify: bool):
        self.dest = model.state_dict()
        self.plan, self.config, self.verify = plan, config, verify
        self.dequantize = plan.quantized is not None and packed == "dequantize"
        self.halves: dict[str, dict[str, Tensor]] = {}
        self.lock = threading.Lock()

    def _targets(self, raw: str, t: Tensor) -> list[tuple[str, Tensor, Tensor]]:
        out = []
        for name, j, piece in map_tensor(raw, t, self.config, self.plan.layout):
            dest = self.dest[name] if j is None else self.dest[name][j]
            if tuple(piece.shape) != tuple(dest.shape):
                raise ValueError(f"{raw}: {tuple(piece.shape)} does not fit {name} {tuple(dest.shape)}")
            out.append((name, piece, dest))
        return out

    def direct(self, e: _Entry) -> Tensor | None:
        """The destination, when the file tensor's bytes land unchanged in one contiguous slot of it (same dtype,
        no split, no padding), so that they can be read or copied straight there; else None."""
        if self.dequantize and e.name.endswith((PACKED, SCALE)):
            return None
        targets = self._targets(e.name, torch.empty(e.shape, dtype=e.dtype, device="meta"))
        if len(targets) != 1:
            return None
        name, piece, dest = targets[0]
        ok = dest.dtype == e.dtype and dest.is_contiguous() and piece.is_contiguous() and not name.endswith(".A_log")
        return dest if ok and dest.numel() * dest.element_size() == e.end - e.start else None

    def __call__(self, path: Path, e: _Entry, buf: Tensor) -> None:
        """Place a tensor read whole into the host buffer ``buf`` (cast, split, dequantised on the way)."""
        t = buf.view(e.dtype).view(e.shape) if e.shape else buf.view(e.dtype).reshape(())
        if self.dequantize and e.name.endswith((PACKED, SCALE)):
            base, half = e.name.rsplit(".", 1)
            raw = f"{base}.weight"
            dest = self.dest[map_tensor(raw, torch.empty(0, device="meta"), self.config, self.plan.layout)[0][0]]
            # the half waits (for its other half) and is dequantised where the weight goes: on a GPU, not the host
            t = (t.view(torch.uint8) if t.dtype == _E8M0 else t).to(dest.device)
            with self.lock:
                pair = self.halves.setdefault(base, {})
                pair[half] = t
                if len(pair) < 2:
                    return
                del self.halves[base]
            t = unpack_weight(pair[PACKED], pair[SCALE], dest.dtype)
            e = _Entry(raw, t.dtype, tuple(t.shape), 0, 0)
        for name, piece, dest in self._targets(e.name, t):
            if piece.dtype == _E8M0 and dest.dtype == torch.uint8:
                piece = piece.view(torch.uint8)
            dest.copy_(piece)
            self.check_finite(path, e.name, dest)

    def check_finite(self, path: Path, raw: str, t: Tensor) -> None:
        if not (self.verify and t.is_floating_point()):
            return
        if not (_host_finite(t) if t.device.type == "cpu" else bool(_all_finite(t))):
            raise ValueError(
                f"{path}: tensor {raw!r} holds non-finite values (NaN or inf); the checkpoint is corrupted or "
                "was saved from a diverged run"
            )


def _load_shard(path: Path, entries: list[_Entry], place: _Placer, expected: str | None, budget, cancel, stages):
    """Read, hash and place one shard (``stages``: a queue of staging buffer sets when loading onto GPUs, one
    taken per shard, else None); one ValueError naming the file when it is corrupted or truncated."""
    hasher = StreamHasher(hashlib.sha256() if expected is not None else None)
    stage = stages.get() if stages is not None else None
    try:
        with open(path, "rb", buffering=0) as f:
            if stage is None:
                _read_shard(f, path, entries, place, hasher, budget, cancel)
                _skip(f, path.stat().st_size - f.tell(), hasher, path)  # trailing bytes are checksummed too
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


def _load_shards(directory: Path, plan: LoadPlan, place: _Placer, expected: dict[str, str], workers: int) -> None:
    """All shards, ``workers`` at a time; on a failure the others stop and the first failing file's error is
    raised (after every worker has stopped, so nothing writes into the model afterwards)."""
    workers = max(1, min(workers, len(plan.files)))
    budget = _Budget(max((directory / f).stat().st_size for f in plan.files))
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
            _load_shard(directory / fname, plan.entries[fname][0], place, expected.get(fname), budget, cancel, stages)
        except BaseException:
            cancel.set()
            raise

    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="k3-load") as pool:
            futures = [pool.submit(one, fname) for fname in plan.files]
        errors = [fut.exception() for fut in futures]
        for err in errors:
            if err is not None and not isinstance(err, _Cancelled):
                raise err
    finally:
        while stages is not None and not stages.empty():  # give the pinned staging memory back
            stages.get()
        if stages is not None and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def _staged(place: _Placer) -> bool:
    """Whether any tensor goes to a GPU (then every shard is read through the pinned staging buffers)."""
    return any(t.device.type == "cuda" for t in place.dest.values())


def from_pretrained(
    directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | dict = "cpu",
    verify: bool = True,
    packed: str = "dequantize",
    workers: int | None = None,
):
    """Load a checkpoint directory (ours, the K3 release layout, transformers' Kimi-Linear, or a multi-GPU
    training run's DCP checkpoint) as K3ForCausalLM (K3ForConditionalGeneration when it holds vision weights),
    streamed shard by shard into its final dtype and device.

    dtype: None keeps the checkpoint's (bf16 stays bf16); otherwise every floating tensor but the fp32-kept
    ones (router, its bias, A_log, dt_bias) is cast to it. device: "cpu", "cuda[:N]", or a map of module
    prefix -> device (e.g. ``{"model.layers.0": "cuda:0", "": "cuda:1"}``). verify: check each shard's SHA-256
    (``k3_checksums.json``) on the bytes as they are read, and that floating tensors are finite.
    Packed MXFP4 experts (``quantization_config.format`` mxfp4-pack-quantized): ``packed="dequantize"`` turns
    them into high-precision weights (``dtype``, default the checkpoint's; for training and inference),
    ``packed="keep"`` keeps the bytes in memory (k3.quant.packed.PackedExperts, dequantised on the fly;
    inference only). workers: shards read (and hashed) at once, default ``default_workers``; 1 reads them one
    after another."""
    from k3.model.decoder import K3ForCausalLM

    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers={workers!r} must be a positive number of shards read at once")
    if packed not in ("dequantize", "keep"):
        raise ValueError(f"packed={packed!r} must be 'dequantize' or 'keep'")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    if is_adapter_dir(directory):
        raise not_a_model(directory)
    config = read_config(directory)
    if (directory / ".metadata").is_file():  # a multi-GPU run's torch.distributed.checkpoint
        if packed == "keep":
            raise ValueError(
                f"packed='keep': {directory} is a distributed training checkpoint (high-precision "
                "experts); export packed experts first with k3 convert --quantize mxfp4"
            )
        if isinstance(device, dict):
            raise ValueError("a device map is not supported for a distributed training checkpoint; give one device")
        return _from_dcp(directory, config).cast(dtype or torch.float32).to(device)
    quantized = read_quantization(read_config_json(directory))
    if packed == "keep" and quantized is None:
        raise ValueError(
            f"packed='keep': {directory} has no packed experts (no quantization_config); write one "
            "with save_pretrained(..., quantize='mxfp4') or k3 convert --quantize mxfp4"
        )
    plan = plan_load(directory, packed, dtype)
    with torch.device("meta"):
        if config.vision is not None and any(k.startswith("vision_tower.") for k in plan.state):
            from k3.model.multimodal import K3ForConditionalGeneration

            model = K3ForConditionalGeneration(config)
        else:
            model = K3ForCausalLM(config)
        if quantized is not None and packed == "keep":
            use_packed_experts(model)
    check_state(plan.state, model.state_dict())
    _materialise(model, plan, dtype, _device_of(device))
    place = _Placer(model, plan, config, packed, verify)
    expected = expected_checksums(directory, plan.files) if verify else {}
    _load_shards(directory, plan, place, expected, default_workers(len(plan.files)) if workers is None else workers)
    if place.halves:
        raise ValueError(f"packed experts without their other half: {sorted(place.halves)[:8]}")
    return model


def load_eager(directory: str | os.PathLike, dtype: torch.dtype | None = None, verify: bool = True):
    """The plain reference loader: every tensor into one host dict, mapped, assigned, cast. For tests and
    comparisons (the streamed :func:`from_pretrained` is what to use)."""
    from k3.model.decoder import K3ForCausalLM
    from k3.quant.packed import unpack_expert_tensors

    directory = Path(directory)
    config = read_config(directory)
    tensors = read_tensors(directory, verify)
    if read_quantization(read_config_json(directory)) is not None:
        tensors = unpack_expert_tensors(tensors, dtype or torch.float32)
    state = from_files(tensors, config)
    with torch.device("meta"):
        if config.vision is not None and any(k.startswith("vision_tower.") for k in state):
            from k3.model.multimodal import K3ForConditionalGeneration

            model = K3ForConditionalGeneration(config)
        else:
            model = K3ForCausalLM(config)
    check_state(state, model.state_dict())
    model.load_state_dict(state, assign=True, strict=True)
    return model.cast(dtype) if dtype is not None else model
