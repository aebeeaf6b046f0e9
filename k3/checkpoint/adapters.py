"""LoRA adapter checkpoints: the adapters of a ``k3 train --lora`` run, saved apart from their base model.

    DIR/adapter_model.safetensors   ``MODULE.lora_A`` [rank, in] / ``MODULE.lora_B`` [out, rank] and the router
                                    biases ``...gate.e_score_correction_bias`` [E], fp32 (k3.model.lora)
    DIR/adapter_config.json         format, rank, alpha, targets, the base checkpoint and its fingerprint
    DIR/config.json                 the base model's config (what the adapters fit)
    DIR/k3_checksums.json           SHA-256 of the files above (and of a training state beside them)

The base is named by its path and identified by :func:`base_fingerprint` (its config.json and checksums, or the
names and sizes of its weight files when it has no checksums), so adapters are never applied to another model:
resuming the run and ``k3 convert --merge-lora`` refuse a base whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.checkpoint.format import (
    CHECKSUMS,
    add_checksums,
    read_checksums,
    read_config,
    resolve_checkpoint,
    verify_checksum,
)
from k3.config.hf import to_hf_config
from k3.fs import normal_mode
from k3.model.lora import lora_state_dict

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FORMAT = "k3-lora"


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def resolve_adapters(path: str | os.PathLike) -> Path:
    """An adapter directory, or a ``--lora`` run directory (its latest checkpoint); one error when it is neither."""
    found = Path(path) if is_adapter_dir(path) else resolve_checkpoint(path)
    if not is_adapter_dir(found):
        raise ValueError(f"{path} holds no LoRA adapters ({found} has no {ADAPTER_CONFIG}): not a --lora run")
    return found


def not_a_model(directory: str | os.PathLike) -> ValueError:
    """The error for loading an adapter directory as a model."""
    return ValueError(
        f"{directory} holds LoRA adapters, not a model: merge them into their base first, with k3 convert --from "
        f"BASE --merge-lora {directory} --to DIR"
    )


def base_fingerprint(ckpt: str | os.PathLike) -> str:
    """A SHA-256 naming a base checkpoint's contents without reading its weights: of its config.json and its
    ``k3_checksums.json`` (which hold every weight file's SHA-256), or where it has none, of the names and sizes
    of its safetensors files."""
    ckpt = Path(ckpt)
    h = hashlib.sha256((ckpt / "config.json").read_bytes())
    if (ckpt / CHECKSUMS).is_file():
        h.update(json.dumps(read_checksums(ckpt), sort_keys=True).encode())
    else:
        for f in sorted(ckpt.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def write_adapters(model, directory: str | os.PathLike, meta: dict) -> None:
    """Write ``model``'s adapters, ``meta`` (rank, alpha, targets, base, base_fingerprint) and the base config into
    an existing directory (not atomic: call inside ``atomic_directory``), with their checksums."""
    directory = Path(directory)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in lora_state_dict(model).items()}
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    normal_mode(directory / ADAPTER_WEIGHTS)
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"format": FORMAT, **meta}, indent=2))
    (directory / "config.json").write_text(json.dumps(to_hf_config(model.config), indent=2))
    add_checksums(directory, [ADAPTER_WEIGHTS, ADAPTER_CONFIG, "config.json"])


def read_adapter_config(directory: str | os.PathLike) -> dict:
    """``adapter_config.json`` checked against its checksum and its fields; one ValueError naming the problem."""
    directory = Path(directory)
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} holds no LoRA adapters")
    verify_checksum(directory, ADAPTER_CONFIG)
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    ok = (
        isinstance(meta, dict)
        and meta.get("format") == FORMAT
        and isinstance(meta.get("rank"), int)
        and meta["rank"] >= 1
        and isinstance(meta.get("alpha"), (int, float))
        and meta["alpha"] > 0
        and isinstance(meta.get("targets"), list)
        and all(isinstance(t, str) for t in meta["targets"])
        and isinstance(meta.get("base_fingerprint"), str)
    )
    if not ok:
        raise ValueError(f"{path} is not a {FORMAT} adapter config (format, rank, alpha, targets, base_fingerprint)")
    return meta


def read_adapters(directory: str | os.PathLike) -> tuple[dict, dict]:
    """(adapter config, adapter tensors) of an adapter directory, both verified against ``k3_checksums.json``."""
    directory = Path(directory)
    meta = read_adapter_config(directory)
    verify_checksum(directory, ADAPTER_WEIGHTS)
    try:
        tensors = load_file(directory / ADAPTER_WEIGHTS)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{directory / ADAPTER_WEIGHTS} is not a valid safetensors file: {e}") from None
    return meta, tensors


def verify_adapters(directory: str | os.PathLike) -> None:
    """Check an adapter directory without loading it: its config.json reads, and every file ``k3_checksums.json``
    lists (the adapters among them) matches; one ValueError / FileNotFoundError naming the first problem."""
    directory = Path(directory)
    read_config(directory)
    sums = read_checksums(directory)
    if sums is None or ADAPTER_WEIGHTS not in sums:
        raise ValueError(f"{directory / CHECKSUMS} does not cover {ADAPTER_WEIGHTS}; the adapters cannot be verified")
    read_adapter_config(directory)
    for name in sorted(sums):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} (listed in {CHECKSUMS}) is missing")
        verify_checksum(directory, name)


def check_base(meta: dict, base: str | os.PathLike, adapters: str | os.PathLike) -> None:
    """Refuse (one ValueError) a base checkpoint whose fingerprint is not the one the adapters were trained on."""
    if base_fingerprint(base) != meta["base_fingerprint"]:
        raise ValueError(
            f"the LoRA adapters in {adapters} were trained on {meta.get('base', 'another checkpoint')}, and {base} "
            "is not that checkpoint (its config or weights differ); give the base they were trained on"
        )
