"""Streamed loading of HF-layout checkpoints (docs/architecture.md#checkpoints): ``from_pretrained``.

The model is built on the meta device, every shard's header is read and checked against it first (names, shapes),
then the model gets empty storage in its final dtype and device and the shards are read into it, several at once,
each hashed on the bytes as they are read (k3.checkpoint.stream): host memory while loading onto a GPU stays within
one shard + 1 GiB; onto the CPU, near the model itself. A bad shard (checksum, truncated, wrong shapes, non-finite
values) fails with one error before the model is returned. Packed MXFP4 experts are dequantised
(``packed="dequantize"``, on the weight's device) or kept packed for inference (``packed="keep"``); the default,
``packed="auto"``, keeps what the checkpoint holds (packed when its config.json has a packed ``quantization_config``,
else high precision), so training passes ``"dequantize"``. A process that
serves part of the experts (expert parallelism) loads only those (``experts=``): the others are never held.
``load_eager`` is the plain all-in-memory loader, for comparisons.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from k3.checkpoint.adapters import is_adapter_dir, not_a_model
from k3.checkpoint.format import (
    INDEX,
    SINGLE,
    _weight_files,
    check_state,
    expected_checksums,
    read_config,
    read_config_json,
    read_tensors,
)
from k3.checkpoint.names import from_files, map_tensor, vision_layout
from k3.checkpoint.stream import E8M0, Entry, all_finite, default_workers, host_finite, load_shards, read_header
from k3.config import K3Config
from k3.model.moe import keep_experts, moe_layers
from k3.quant.packed import PACKED, SCALE, map_packed_pairs, read_quantization, unpack_weight, use_packed_experts

__all__ = ["PACKED_MODES", "LoadPlan", "default_workers", "from_pretrained", "load_eager", "plan_load", "read_header"]
log = logging.getLogger("k3.checkpoint")
PACKED_MODES = ("auto", "keep", "dequantize")  # from_pretrained's packed=, and k3 generate / chat / serve --packed


def _from_dcp(directory: Path, config):
    """The model of a distributed training checkpoint (DCP shards + config.json), gathered into this process (DCP
    checks its own metadata; there are no checksum files to verify). The model is built on the meta device and
    given uninitialised CPU storage, which the load overwrites whole (DCP raises on any tensor the checkpoint
    lacks, and the model has no tensors outside its state dict): no random init is computed and thrown away."""
    from k3.checkpoint.dcp import load_into_single
    from k3.model.decoder import K3ForCausalLM
    from k3.model.multimodal import K3ForConditionalGeneration

    with torch.device("meta"):
        model = (K3ForConditionalGeneration if config.vision is not None else K3ForCausalLM)(config)
    model.to_empty(device="cpu")
    load_into_single(directory, model)
    return model


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
        if t.is_floating_point() and t.dtype != E8M0 and not name.endswith(FP32_NAMES):
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
    entries: dict[str, tuple[list[Entry], int]]
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
            specs[e.name] = torch.empty(e.shape, dtype=torch.uint8 if e.dtype == E8M0 else e.dtype, device="meta")
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


class _Placer:
    """Puts each file tensor (renamed, reshaped, dequantised) into the materialised model's storage; shared by the
    shard workers (the halves of a packed pair may come from two shards). ``local``: for each expert stack that
    keeps part of its experts (its module name), global expert -> slot in the stack; the other experts' tensors
    are not wanted."""

    def __init__(self, model, plan: LoadPlan, config: K3Config, packed: str, verify: bool, local: dict | None = None):
        self.dest = model.state_dict()
        self.plan, self.config, self.verify = plan, config, verify
        self.dequantize = plan.quantized is not None and packed == "dequantize"
        self.halves: dict[str, dict[str, Tensor]] = {}
        self.lock = threading.Lock()
        self.local: dict[str, dict[int, int]] = local or {}
        self._wanted: dict[str, bool] = {}

    def _pieces(self, raw: str, t: Tensor) -> list[tuple[str, int | None, Tensor]]:
        """map_tensor's pieces of a file tensor that this model keeps, expert indices made slots of its stacks."""
        out = []
        for name, j, piece in map_tensor(raw, t, self.config, self.plan.layout):
            keep = self.local.get(name.rsplit(".", 1)[0])
            if keep is not None:
                if j is None:  # a whole [E, ...] stack in one file tensor: the rows kept, in the stack's order
                    piece = piece[list(keep)]
                elif j in keep:
                    j = keep[j]
                else:
                    continue
            out.append((name, j, piece))
        return out

    def wanted(self, e: Entry) -> bool:
        """Whether any piece of the file tensor ``e`` is kept (an expert of a partial stack may not be)."""
        if e.name not in self._wanted:
            self._wanted[e.name] = bool(self._pieces(e.name, torch.empty(e.shape, dtype=e.dtype, device="meta")))
        return self._wanted[e.name]

    def _dest(self, raw: str, name: str, j: int | None, piece: Tensor) -> Tensor:
        dest = self.dest[name] if j is None else self.dest[name][j]
        if tuple(piece.shape) != tuple(dest.shape):
            raise ValueError(f"{raw}: {tuple(piece.shape)} does not fit {name} {tuple(dest.shape)}")
        return dest

    def _targets(self, raw: str, t: Tensor) -> list[tuple[str, Tensor, Tensor]]:
        return [(name, piece, self._dest(raw, name, j, piece)) for name, j, piece in self._pieces(raw, t)]

    def direct(self, e: Entry) -> Tensor | None:
        """The destination, when the file tensor's bytes land unchanged in one contiguous slot of it (same dtype,
        no split, no padding, not rows cut from a whole stack), so that they can be read or copied straight there;
        else None."""
        if self.dequantize and e.name.endswith((PACKED, SCALE)):
            return None
        pieces = self._pieces(e.name, torch.empty(e.shape, dtype=e.dtype, device="meta"))
        if len(pieces) != 1:
            return None
        name, j, piece = pieces[0]
        dest = self._dest(e.name, name, j, piece)
        if j is None and name.rsplit(".", 1)[0] in self.local:
            return None
        ok = dest.dtype == e.dtype and dest.is_contiguous() and piece.is_contiguous() and not name.endswith(".A_log")
        return dest if ok and dest.numel() * dest.element_size() == e.end - e.start else None

    def __call__(self, path: Path, e: Entry, buf: Tensor) -> None:
        """Place a tensor read whole into the host buffer ``buf`` (cast, split, dequantised on the way)."""
        t = buf.view(e.dtype).view(e.shape) if e.shape else buf.view(e.dtype).reshape(())
        if self.dequantize and e.name.endswith((PACKED, SCALE)):
            base, half = e.name.rsplit(".", 1)
            raw = f"{base}.weight"
            dest = self.dest[map_tensor(raw, torch.empty(0, device="meta"), self.config, self.plan.layout)[0][0]]
            # the half waits (for its other half) and is dequantised where the weight goes: on a GPU, not the host
            t = (t.view(torch.uint8) if t.dtype == E8M0 else t).to(dest.device)
            with self.lock:
                pair = self.halves.setdefault(base, {})
                pair[half] = t
                if len(pair) < 2:
                    return
                del self.halves[base]
            t = unpack_weight(pair[PACKED], pair[SCALE], dest.dtype)
            e = Entry(raw, t.dtype, tuple(t.shape), 0, 0)
        for name, piece, dest in self._targets(e.name, t):
            if piece.dtype == E8M0 and dest.dtype == torch.uint8:
                piece = piece.view(torch.uint8)
            dest.copy_(piece)
            self.check_finite(path, e.name, dest)

    def check_finite(self, path: Path, raw: str, t: Tensor) -> None:
        if not (self.verify and t.is_floating_point()):
            return
        if not (host_finite(t) if t.device.type == "cpu" else bool(all_finite(t))):
            raise ValueError(
                f"{path}: tensor {raw!r} holds non-finite values (NaN or inf); the checkpoint is corrupted or "
                "was saved from a diverged run"
            )


def from_pretrained(
    directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | dict = "cpu",
    verify: bool = True,
    packed: str = "auto",
    workers: int | None = None,
    experts: dict[int, list[int]] | None = None,
    checksum_part: tuple[int, int] = (0, 1),
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
    inference only; refused for a checkpoint without packed experts), ``packed="auto"`` (the default) keeps them
    when the checkpoint has them and loads a high-precision checkpoint as it is: a model to train on is loaded
    with ``"dequantize"``. workers: shards read (and hashed) at once, default ``default_workers``; 1 reads them one
    after another.

    experts: ``{decoder layer index: global expert ids}``: those MoE layers keep only these routed experts, in this
    order (k3.model.moe.keep_experts: the layers then need an expert dispatch, as k3.distributed.serve installs),
    plain or packed; the other experts' bytes are never held (read only to be hashed where their shard is
    checked, else skipped). checksum_part ``(i, n)``: with verify, only every n-th shard from the i-th (in name
    order) has its SHA-256 checked, so that n processes loading parts of one checkpoint share the checks; a shard
    this call neither checks nor keeps anything of is not opened. A DCP checkpoint is gathered whole, then cut."""
    from k3.model.decoder import K3ForCausalLM

    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers={workers!r} must be a positive number of shards read at once")
    if packed not in PACKED_MODES:
        raise ValueError(f"packed={packed!r} must be one of {', '.join(map(repr, PACKED_MODES))}")
    part, parts = checksum_part
    if not 0 <= part < parts:
        raise ValueError(f"checksum_part={checksum_part!r} must be (i, n) with 0 <= i < n")
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
        model = _from_dcp(directory, config)  # packed="auto": a training checkpoint's experts are high-precision
        if experts:
            log.warning("%s: a distributed training checkpoint is gathered whole before its experts are cut", directory)
            _keep(model, experts)
        return model.cast(dtype or torch.float32).to(device)
    quantized = read_quantization(read_config_json(directory))
    if packed == "auto":
        packed = "dequantize" if quantized is None else "keep"
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
    local = _keep(model, experts or {})
    for prefix, keep in local.items():  # the checkpoint's stacks as this model holds them
        for name in [n for n in plan.state if n.rsplit(".", 1)[0] == prefix]:
            t = plan.state[name]
            plan.state[name] = torch.empty((len(keep), *t.shape[1:]), dtype=t.dtype, device="meta")
    check_state(plan.state, model.state_dict())
    _materialise(model, plan, dtype, _device_of(device))
    place = _Placer(model, plan, config, packed, verify, local)
    expected = expected_checksums(directory, plan.files[part::parts]) if verify else {}
    workers = default_workers(len(plan.files)) if workers is None else workers
    load_shards(directory, plan.files, {f: plan.entries[f][0] for f in plan.files}, place, expected, workers)
    if place.halves:
        raise ValueError(f"packed experts without their other half: {sorted(place.halves)[:8]}")
    return model


def _keep(model, experts: dict[int, list[int]]) -> dict[str, dict[int, int]]:
    """Cut the expert banks of the MoE layers named in ``experts`` (k3.model.moe.keep_experts); for each, its
    stack's module name -> {global expert: slot}. One ValueError for a layer that is not a MoE layer."""
    layers = {m.layer_idx: m for m in moe_layers(model)}
    unknown = sorted(set(experts) - set(layers))
    if unknown:
        raise ValueError(f"experts given for layers {unknown}, which are not MoE layers (those: {sorted(layers)})")
    local = {}
    for idx, ids in experts.items():
        keep_experts(layers[idx], ids)
        kept = layers[idx].experts.expert_ids
        local[f"model.layers.{idx}.block_sparse_moe.experts"] = {g: i for i, g in enumerate(kept)}
    return local


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
