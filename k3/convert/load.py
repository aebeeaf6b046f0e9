"""Streamed loading of HF-layout checkpoints (docs/architecture.md#checkpoints): ``from_pretrained``.

The model is built on the meta device, every shard's header is read and checked against it first (names, shapes),
then each tensor is read straight into its final dtype and device, shard by shard, its SHA-256 computed on the same
bytes; a bad shard fails before the model is returned. Host memory while loading onto a GPU stays near one tensor;
onto the CPU, near the model itself. Packed MXFP4 experts are dequantised (``packed="dequantize"``) or kept packed
for inference (``packed="keep"``). ``load_eager`` is the plain all-in-memory loader, for comparisons.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from k3.config import K3Config
from k3.convert.names import from_files, map_tensor, vision_layout
from k3.quant.packed import PACKED, SCALE, map_packed_pairs, read_quantization, unpack_weight, use_packed_experts

from k3.convert.checkpoint import (
    CHECKSUMS,
    INDEX,
    SINGLE,
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
_CHUNK = 64 << 20
_MAX_HEADER = 100 << 20


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


def _read_into(f, buf: Tensor, hasher, pool: ThreadPoolExecutor | None, path: Path) -> None:
    """Fill the flat uint8 CPU tensor ``buf`` from the file's current position; hash the bytes on ``pool``."""
    mv = memoryview(buf.numpy())
    pending = []
    for off in range(0, len(mv), _CHUNK):
        view = mv[off : off + _CHUNK]
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{path} is not a valid safetensors file (truncated or corrupted): it ends early")
            got += n
        if hasher is not None:
            pending.append(pool.submit(hasher.update, view))
    for fut in pending:
        fut.result()


def _skip(f, n: int, hasher) -> None:
    """Read (and hash) ``n`` bytes that hold no tensor."""
    while n > 0:
        block = f.read(min(n, _CHUNK))
        if not block:
            return
        if hasher is not None:
            hasher.update(block)
        n -= len(block)


def _load_shard(path: Path, entries: list[_Entry], base: int, place, hasher) -> None:
    """One pass over a shard: header, then every tensor in file order, each handed to ``place(entry, bytes)``
    (``place.buffer(entry)`` gives the flat uint8 CPU tensor to read into: the destination itself when it can)."""
    with ThreadPoolExecutor(1) as pool, open(path, "rb", buffering=0) as f:
        _skip(f, base, hasher)
        pos = base
        for e in entries:
            _skip(f, e.start - pos, hasher)
            buf = place.buffer(e)
            _read_into(f, buf, hasher, pool, path)
            place(e, buf)
            pos = e.end
        while True:  # trailing bytes, if any, belong to the file's checksum too
            block = f.read(_CHUNK)
            if not block:
                break
            if hasher is not None:
                hasher.update(block)


class _Placer:
    """Puts each file tensor (renamed, reshaped, dequantised) into the materialised model's storage."""

    def __init__(self, model, plan: LoadPlan, config: K3Config, packed: str, verify: bool):
        self.dest = model.state_dict()
        self.plan, self.config, self.verify = plan, config, verify
        self.dequantize = plan.quantized is not None and packed == "dequantize"
        self.halves: dict[str, dict[str, Tensor]] = {}
        self.fname = ""
        self.direct: dict[str, Tensor] = {}
        self.placed = 0

    def _targets(self, raw: str, t: Tensor) -> list[tuple[str, Tensor, Tensor]]:
        out = []
        for name, j, piece in map_tensor(raw, t, self.config, self.plan.layout):
            dest = self.dest[name] if j is None else self.dest[name][j]
            if tuple(piece.shape) != tuple(dest.shape):
                raise ValueError(f"{raw}: {tuple(piece.shape)} does not fit {name} {tuple(dest.shape)}")
            out.append((name, piece, dest))
        return out

    def buffer(self, e: _Entry) -> Tensor:
        """The destination's own bytes when the file tensor lands unchanged in one contiguous CPU slot."""
        nbytes = e.end - e.start
        if not (self.dequantize and e.name.endswith((PACKED, SCALE))):
            spec = torch.empty(e.shape, dtype=e.dtype, device="meta")
            targets = self._targets(e.name, spec)
            if len(targets) == 1:
                name, piece, dest = targets[0]
                if (
                    dest.device.type == "cpu"
                    and dest.dtype == e.dtype
                    and dest.is_contiguous()
                    and piece.is_contiguous()
                    and not name.endswith(".A_log")
                ):
                    flat = dest.reshape(-1).view(torch.uint8)
                    if flat.numel() == nbytes:
                        self.direct[e.name] = dest
                        return flat
        return torch.empty(nbytes, dtype=torch.uint8)

    def __call__(self, e: _Entry, buf: Tensor) -> None:
        dest = self.direct.pop(e.name, None)
        if dest is not None:
            self._check_finite(e.name, dest)
            self.placed += 1
            return
        t = buf.view(e.dtype).view(e.shape) if e.shape else buf.view(e.dtype).reshape(())
        if self.dequantize and e.name.endswith((PACKED, SCALE)):
            base, half = e.name.rsplit(".", 1)
            pair = self.halves.setdefault(base, {})
            pair[half] = t.view(torch.uint8) if t.dtype == _E8M0 else t
            if len(pair) < 2:
                return
            del self.halves[base]
            raw, t = f"{base}.weight", None
            dt = self.dest[map_tensor(raw, torch.empty(0, device="meta"), self.config, self.plan.layout)[0][0]].dtype
            t = unpack_weight(pair[PACKED], pair[SCALE], dt)
            e = _Entry(raw, t.dtype, tuple(t.shape), 0, 0)
        for name, piece, dest in self._targets(e.name, t):
            if piece.dtype == _E8M0 and dest.dtype == torch.uint8:
                piece = piece.view(torch.uint8)
            dest.copy_(piece)
            self._check_finite(e.name, dest)
        self.placed += 1

    def _check_finite(self, raw: str, t: Tensor) -> None:
        # a non-finite element makes the sum non-finite; a finite sum is the cheap common case (an overflowing
        # sum of finite values falls back to the exact test)
        if (
            self.verify
            and t.is_floating_point()
            and not bool(torch.isfinite(t.sum(dtype=torch.float32)))
            and not bool(torch.isfinite(t).all())
        ):
            raise ValueError(
                f"{self.plan.directory / self.fname}: tensor {raw!r} holds non-finite values (NaN or "
                "inf); the checkpoint is corrupted or was saved from a diverged run"
            )


def from_pretrained(
    directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | dict = "cpu",
    verify: bool = True,
    packed: str = "dequantize",
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
    inference only)."""
    from k3.model.decoder import K3ForCausalLM

    if packed not in ("dequantize", "keep"):
        raise ValueError(f"packed={packed!r} must be 'dequantize' or 'keep'")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
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
    for fname in plan.files:
        path = directory / fname
        hasher = hashlib.sha256() if fname in expected else None
        place.fname = fname
        try:
            _load_shard(path, *plan.entries[fname], place, hasher)
        except ValueError:
            if hasher is not None and _sha256(path) != expected[fname]:
                raise ValueError(f"{path} is corrupted: its SHA-256 differs from {CHECKSUMS}") from None
            raise
        if hasher is not None and hasher.hexdigest() != expected[fname]:
            raise ValueError(f"{path} is corrupted: its SHA-256 differs from {CHECKSUMS}")
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
