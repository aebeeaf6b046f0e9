"""HF-layout checkpoints: ``config.json`` + safetensors (sharded with ``model.safetensors.index.json``).

Saving is atomic (``atomic_directory``) and records a SHA-256 per weight file in ``k3_checksums.json``.
``quantize="mxfp4"`` packs the routed experts (compressed-tensors ``mxfp4-pack-quantized``, k3.quant.packed);
loading dequantises them (``packed="dequantize"``) or keeps them packed for inference (``packed="keep"``).
Loading refuses, with one clear message, a missing or malformed config, missing shards, a truncated or
corrupted safetensors file (bad header, or a checksum mismatch when checksums are present), non-finite
values, shard names outside the directory, non-float tensors, missing / unexpected tensors and shape mismatches.

Loading streams (k3.convert.load). Writing streams too: one shard at a time is gathered on the host.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from k3.config import K3Config
from k3.config.hf import from_hf_config, to_hf_config
from k3.convert.atomic import atomic_directory, normal_mode
from k3.convert.names import to_files
from k3.quant.packed import pack_expert_tensors, quantization_config
from k3.quant.qat import qat_settings

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CHECKSUMS = "k3_checksums.json"
DEFAULT_SHARD_BYTES = 5 * 10**9
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _file_tensors(model, fmt: str, quantize: str | None, mode: str) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint tensors of ``model`` one state-dict entry at a time, on the host (packed if asked)."""
    layout = "release" if fmt == "k3-release" else "k3"
    for name, t in model.state_dict().items():
        files = to_files({name: t.detach()}, model.config, layout)
        if quantize == "mxfp4":
            files = pack_expert_tensors(files, mode)
        for fname, ft in files.items():
            yield fname, ft.cpu()


def write_pretrained(
    model,
    directory: str | os.PathLike,
    fmt: str = "k3",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    quantize: str | None = None,
    scale_mode: str | None = None,
) -> list[str]:
    """Write config.json and the weights into an existing directory (not atomic; see ``save_pretrained``).
    Shards are written as they fill, so host memory holds one shard (a GPU model is never copied whole)."""
    if quantize not in (None, "mxfp4"):
        raise ValueError(f"quantize={quantize!r} must be None or 'mxfp4'")
    directory = Path(directory)
    config = to_hf_config(model.config, fmt)
    state = model.state_dict()
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()} - {torch.float32}
    config["torch_dtype"] = _DTYPE_NAMES.get(next(iter(dtypes)), "float32") if len(dtypes) == 1 else "float32"
    mode = None
    if quantize == "mxfp4":
        qat = qat_settings(model)
        mode = scale_mode or (qat.mode if qat is not None else "floor")
    if quantize == "mxfp4" or any(k.endswith(("_packed", "_scale")) for k in state):  # also: a model kept packed
        config["quantization_config"] = quantization_config()
    del state
    parts: list[str] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, Tensor] = {}
    size = total = 0

    def flush() -> None:
        part = directory / f".part-{len(parts)}.safetensors"
        save_file(shard, part, metadata={"format": "pt"})
        parts.append(part.name)

    for name, t in _file_tensors(model, fmt, quantize, mode):
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t
        weight_map[name] = len(parts)
        size += nbytes
        total += nbytes
    flush()
    shard = {}
    names = (
        [SINGLE]
        if len(parts) == 1
        else [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    )
    for part, fname in zip(parts, names):
        os.replace(directory / part, directory / fname)
        normal_mode(directory / fname)  # safetensors writes through a 0600 temp file
    if len(parts) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
        (directory / INDEX).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / CHECKSUMS).write_text(json.dumps({"sha256": {f: _sha256(directory / f) for f in names}}, indent=2))
    return names


def add_checksums(directory: str | os.PathLike, names: list[str]) -> None:
    """Record the SHA-256 of more files of ``directory`` (e.g. a training state) in its ``k3_checksums.json``."""
    directory = Path(directory)
    path = directory / CHECKSUMS
    sums = json.loads(path.read_text()) if path.is_file() else {"sha256": {}}
    sums["sha256"].update({f: _sha256(directory / f) for f in names})
    path.write_text(json.dumps(sums, indent=2))


def verify_checksum(directory: str | os.PathLike, name: str) -> None:
    """Refuse ``directory/name`` unless ``k3_checksums.json`` lists it with a matching SHA-256."""
    directory = Path(directory)
    path = directory / CHECKSUMS
    try:
        expected = json.loads(path.read_text())["sha256"][name]
    except FileNotFoundError:
        raise ValueError(f"{directory / name} is not covered by checksums: {path} is missing") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{directory / name} is not covered by checksums: {path} has no valid entry for it") from None
    if _sha256(directory / name) != expected:
        raise ValueError(f"{directory / name} is corrupted: its SHA-256 differs from {CHECKSUMS}")


def save_pretrained(
    model,
    directory: str | os.PathLike,
    fmt: str = "k3",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    quantize: str | None = None,
    scale_mode: str | None = None,
) -> Path:
    """Atomically (re)write ``directory`` with the model's config.json and safetensors weights.

    quantize="mxfp4": routed experts written packed (MXFP4, ``scale_mode`` "floor" or "rceil"; default: the
    model's QAT scale mode when QAT is on, else "floor"), plus ``quantization_config`` in config.json."""
    with atomic_directory(directory) as tmp:
        write_pretrained(model, tmp, fmt, max_shard_bytes, quantize, scale_mode)
    return Path(directory)


def read_config(directory: str | os.PathLike) -> K3Config:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return from_hf_config(raw)


def _inside(directory: Path, fname: str) -> None:
    """Refuse a shard name that could read a file outside the checkpoint (``..``, absolute, a link out)."""
    root = directory.resolve()
    if (
        not isinstance(fname, str)
        or Path(fname).is_absolute()
        or ".." in Path(fname).parts
        or not (root / fname).resolve().is_relative_to(root)
    ):
        raise ValueError(f"{directory / INDEX} names {fname!r}, which is outside the checkpoint directory")


def _weight_files(directory: Path) -> dict[str, str | None]:
    """file name -> None, or tensor name -> file name when sharded."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is malformed: {e}") from None
        for fname in files:
            _inside(directory, fname)
        for fname in files:
            if not (directory / fname).is_file():
                raise FileNotFoundError(f"{directory / fname} (listed in {INDEX}) is missing")
        return weight_map
    if not (directory / SINGLE).is_file():
        raise FileNotFoundError(f"{directory} has neither {SINGLE} nor {INDEX}")
    return {}


def read_tensors(directory: str | os.PathLike, verify: bool = True) -> dict[str, Tensor]:
    """Every tensor of a checkpoint directory, with integrity checks."""
    directory = Path(directory)
    weight_map = _weight_files(directory)
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
    sums = directory / CHECKSUMS
    if verify and sums.is_file():
        expected = json.loads(sums.read_text()).get("sha256", {})
        for fname in files:
            if fname in expected and _sha256(directory / fname) != expected[fname]:
                raise ValueError(f"{directory / fname} is corrupted: its SHA-256 differs from {CHECKSUMS}")
    tensors: dict[str, Tensor] = {}
    for fname in files:
        try:
            with safe_open(directory / fname, framework="pt") as f:
                for key in f.keys():
                    if weight_map and weight_map.get(key) != fname:
                        raise ValueError(f"{directory / fname} holds {key!r}, which {INDEX} does not map to it")
                    t = f.get_tensor(key)
                    if verify and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        raise ValueError(
                            f"{directory / fname}: tensor {key!r} holds non-finite values (NaN or "
                            "inf); the checkpoint is corrupted or was saved from a diverged run"
                        )
                    tensors[key] = t
        except SafetensorError as e:
            raise ValueError(
                f"{directory / fname} is not a valid safetensors file (truncated or corrupted): {e}"
            ) from None
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise ValueError(f"tensors listed in {INDEX} are absent from their files: {missing[:8]}")
    return tensors


def check_state(state: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """Compare a loaded state dict with a model's (names, shapes, floating dtypes); one ValueError with all problems."""
    problems = []
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {missing[:8]}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {unexpected[:8]}")
    bad_shape = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if bad_shape:
        problems.append("shape mismatch: " + "; ".join(bad_shape[:8]))
    bad_dtype = [
        f"{k}: {t.dtype}"
        for k, t in state.items()
        if k in expected and not t.is_floating_point() and expected[k].is_floating_point()
    ]
    if bad_dtype:
        problems.append("non-floating tensors: " + "; ".join(bad_dtype[:8]))
    bad_int = [
        f"{k}: checkpoint {t.dtype} vs model {expected[k].dtype}"
        for k, t in state.items()
        if k in expected and not expected[k].is_floating_point() and t.dtype != expected[k].dtype
    ]
    if bad_int:
        problems.append("dtype mismatch: " + "; ".join(bad_int[:8]))
    if problems:
        raise ValueError("checkpoint does not match the model: " + " | ".join(problems))


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
    raise FileNotFoundError(
        f"{path} is neither a checkpoint directory (config.json) nor a training run with checkpoints/latest"
    )
