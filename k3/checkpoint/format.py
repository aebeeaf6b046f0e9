"""HF-layout checkpoints: ``config.json`` + safetensors (sharded with ``model.safetensors.index.json``).

Saving is atomic (``atomic_directory``) and records a SHA-256 per weight file in ``k3_checksums.json``. A
config.json naming ``KimiK3ForCausalLM`` (K3's features in format ``k3``; k3.config.hf) or the multimodal release's
``KimiK3ForConditionalGeneration`` also gets ``auto_map`` and the transformers code that runs it (k3.checkpoint.hf_code,
checksummed too), for ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` (text only: images go
through k3).
``quantize="mxfp4"`` packs the routed experts (compressed-tensors ``mxfp4-pack-quantized``, k3.quant.packed);
loading dequantises them (``packed="dequantize"``) or keeps them packed for inference (``packed="keep"``).
Loading refuses, with one clear message, a missing or malformed config, missing shards, a truncated or
corrupted safetensors file (bad header, or a checksum mismatch when checksums are present), a malformed
``k3_checksums.json`` or one that leaves a weight file out (verification is never skipped silently), non-finite
values, shard names outside the directory, non-float tensors, missing / unexpected tensors and shape mismatches.

Loading streams (k3.checkpoint.load). Writing streams too: one shard at a time is gathered on the host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from k3.checkpoint import hf_code
from k3.checkpoint.names import to_files
from k3.config import K3Config
from k3.config.hf import KIMI_K3, KIMI_K3_RELEASE, from_hf_config, to_hf_config
from k3.fs import atomic_directory, normal_mode
from k3.quant.packed import pack_expert_tensors, quantization_config
from k3.quant.qat import qat_settings

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CHECKSUMS = "k3_checksums.json"
TRAINER_STATE = "trainer_state.pt"  # a training checkpoint's optimizer / data / RNG state (k3.checkpoint.run)
DEFAULT_SHARD_BYTES = 5 * 10**9
# What a tokenizer needs beside config.json (k3.data.tokenizer reads tokenizer.json and tokenizer_config.json;
# the others are the HF names a release ships), copied along by k3 convert so its output can be served.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tiktoken.model",
    "tokenizer.model",
)
log = logging.getLogger("k3.checkpoint")
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


class StreamHasher:
    """The SHA-256 of one file, computed on its own thread in the order its bytes are fed, while reading goes on
    (hashlib releases the GIL on large buffers). ``feed`` returns a ticket; ``wait(ticket)`` returns once those
    bytes are hashed, so that their buffer may be refilled. Without a hash object nothing is done."""

    def __init__(self, h):
        self.h, self.fed, self.done = h, 0, 0
        self.cond, self.queue, self.thread = threading.Condition(), queue.SimpleQueue(), None
        if h is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while (data := self.queue.get()) is not None:
            self.h.update(data)
            with self.cond:
                self.done += 1
                self.cond.notify_all()

    def feed(self, data) -> int:
        if self.h is not None:
            self.fed += 1
            self.queue.put(data)
        return self.fed

    def wait(self, ticket: int) -> None:
        with self.cond:
            while self.done < ticket:
                self.cond.wait()

    def close(self) -> str | None:
        """Hash what was fed and stop the thread (again: a no-op); the hex digest (None without a hash object)."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None
        return None if self.h is None else self.h.hexdigest()


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
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be a positive number of bytes")
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
    # transformers runs it through the code it carries (hf_code); the multimodal release, its text part
    if config["architectures"] in ([KIMI_K3[1]], [KIMI_K3_RELEASE[1]]):
        config["auto_map"] = dict(hf_code.AUTO_MAP)
        for fname in hf_code.FILES:
            shutil.copyfile(hf_code.source(fname), directory / fname)
            normal_mode(directory / fname)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    summed = names + [f for f in hf_code.FILES if "auto_map" in config]
    (directory / CHECKSUMS).write_text(json.dumps({"sha256": {f: _sha256(directory / f) for f in summed}}, indent=2))
    return names


def read_checksums(directory: str | os.PathLike) -> dict[str, str] | None:
    """``k3_checksums.json`` of ``directory`` as {file name: SHA-256 hex digest}, or None when there is none; one
    ValueError naming the file when it is not ``{"sha256": {name: digest, ...}}`` (so a damaged file never
    turns verification off)."""
    path = Path(directory) / CHECKSUMS
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint's checksums cannot be read") from None
    sums = raw.get("sha256") if isinstance(raw, dict) else None
    if not isinstance(sums, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)
        for k, v in sums.items()
    ):
        raise ValueError(
            f'{path} is malformed: it must hold {{"sha256": {{file name: SHA-256 hex digest}}}}; the '
            "checkpoint cannot be verified"
        )
    return sums


def expected_checksums(directory: str | os.PathLike, files: list[str]) -> dict[str, str]:
    """The recorded SHA-256 of each of ``files`` ({} when the directory has no ``k3_checksums.json``); a
    checksums file that leaves one of them out is refused, not taken as leave to skip it."""
    sums = read_checksums(directory)
    if sums is None:
        return {}
    missing = [f for f in files if f not in sums]
    if missing:
        raise ValueError(f"{Path(directory) / CHECKSUMS} does not list {', '.join(missing)}; it cannot be verified")
    return {f: sums[f] for f in files}


def add_checksums(directory: str | os.PathLike, names: list[str]) -> None:
    """Record the SHA-256 of more files of ``directory`` (e.g. a training state) in its ``k3_checksums.json``."""
    directory = Path(directory)
    sums = read_checksums(directory) or {}
    sums.update({f: _sha256(directory / f) for f in names})
    (directory / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=2))


def verify_checksum(directory: str | os.PathLike, name: str) -> None:
    """Refuse ``directory/name`` unless ``k3_checksums.json`` lists it with a matching SHA-256."""
    directory = Path(directory)
    if read_checksums(directory) is None:
        raise ValueError(f"{directory / name} is not covered by checksums: {directory / CHECKSUMS} is missing")
    expected = expected_checksums(directory, [name])[name]
    if _sha256(directory / name) != expected:
        raise ValueError(f"{directory / name} is corrupted: its SHA-256 differs from {CHECKSUMS}")


def verify_files(directory: str | os.PathLike) -> None:
    """Check a k3 checkpoint without loading it: config.json, every weight file present, and every file that
    ``k3_checksums.json`` lists (the weights among them) matching its SHA-256; one ValueError / FileNotFoundError
    naming the first problem."""
    directory = Path(directory)
    read_config(directory)
    weight_map = _weight_files(directory)
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
    sums = read_checksums(directory)
    if sums is None:
        raise ValueError(f"{directory} has no {CHECKSUMS}: it cannot be verified")
    expected_checksums(directory, files)
    for name, digest in sorted(sums.items()):
        _inside(directory, name, CHECKSUMS)
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} (listed in {CHECKSUMS}) is missing")
        if _sha256(directory / name) != digest:
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


def copy_tokenizer(source: str | os.PathLike, directory: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files (``TOKENIZER_FILES``) of checkpoint ``source`` into ``directory``; returns their
    names, and warns when there are none (the copy then cannot be served or sampled)."""
    source, directory = Path(source), Path(directory)
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
    for name in names:
        shutil.copyfile(source / name, directory / name)
        normal_mode(directory / name)
    if "tokenizer.json" not in names:
        log.warning("%s has no tokenizer.json: copy the model's tokenizer next to the output's config.json", source)
    return names


def read_config_json(directory: str | os.PathLike) -> dict:
    """A checkpoint's ``config.json`` as a dict; one error naming the file when it is missing, not JSON, or JSON
    that is not an object."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    return raw


def read_config(directory: str | os.PathLike) -> K3Config:
    return from_hf_config(read_config_json(directory))


def _inside(directory: Path, fname: str, listed_in: str = INDEX) -> None:
    """Refuse a file name that could read a file outside the checkpoint (``..``, absolute, a link out)."""
    root = directory.resolve()
    if (
        not isinstance(fname, str)
        or Path(fname).is_absolute()
        or ".." in Path(fname).parts
        or not (root / fname).resolve().is_relative_to(root)
    ):
        raise ValueError(f"{directory / listed_in} names {fname!r}, which is outside the checkpoint directory")


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
    if verify:
        for fname, digest in expected_checksums(directory, files).items():
            if _sha256(directory / fname) != digest:
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
