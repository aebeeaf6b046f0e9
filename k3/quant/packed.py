"""Packed MXFP4 expert checkpoints in the compressed-tensors ``mxfp4-pack-quantized`` layout (docs/architecture.md#mx).

Only the routed experts are packed; in the files each expert matrix W [out, in] becomes

    ...block_sparse_moe.experts.J.w{1,2,3}.weight_packed  uint8 [out, in / 2]   two E2M1 codes per byte,
                                                                                 low nibble = even column
    ...block_sparse_moe.experts.J.w{1,2,3}.weight_scale   uint8 [out, in / 32]  E8M0, 2^(s - 127), 0xFF NaN

and W[o, i] = e2m1(code[o, i]) * 2^(scale[o, i // 32] - 127). Everything else stays in the checkpoint dtype.
``config.json`` gets the ``quantization_config`` of :func:`quantization_config`.

Assumptions (not checked against compressed-tensors' source here): the tensor suffixes ``weight_packed`` /
``weight_scale`` (as in its nvfp4 / mxfp4 pack-quantized compressors), scales stored as plain uint8 exponents,
and the ``quantization_config`` keys below (``scale_dtype`` written as the string "uint8"). The reader
depends only on ``quant_method``, ``format`` and the weights' ``num_bits`` / ``type`` / ``group_size``.

In memory, :class:`PackedExperts` keeps the packed bytes (``from_pretrained(..., packed="keep")``); the MoE
forward runs k3.ops.moe.mxfp4.moe_experts_packed on them, which dequantises only the experts a batch selects
(docs/architecture.md#mx). It is for inference (no parameters to train).
"""

from __future__ import annotations

import logging
from typing import Callable
import re

import torch
from torch import Tensor, nn

from k3.ops.mx import MXFP4_ELEM, MXFP4_GROUP, pack_fp4, quantize, unpack_weight

log = logging.getLogger("k3.quant")

FORMAT = "mxfp4-pack-quantized"
ELEM, GROUP = MXFP4_ELEM, MXFP4_GROUP
PACKED, SCALE = "weight_packed", "weight_scale"
EXPERT_TARGET = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"
IGNORE = [
    "lm_head",
    r"re:.*self_attn\..*",
    r"re:.*shared_experts\..*",
    r"re:.*block_sparse_moe\.gate$",
    r"re:.*routed_expert_(down|up)_proj$",
    r"re:.*\.mlp\..*",
    r"re:.*vision_tower.*",
    r"re:.*mm_projector.*",
]
_EXPERT_WEIGHT = re.compile(r"^(.*\.block_sparse_moe\.experts\.\d+\.w[123])\.weight$")


def quantization_config() -> dict:
    """The ``config.json`` ``quantization_config`` of a packed K3 checkpoint (routed experts only)."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": "group",
        "group_size": GROUP,
        "dynamic": False,
        "scale_dtype": "uint8",
        "zp_dtype": None,
        "actorder": None,
        "block_structure": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": [EXPERT_TARGET],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": FORMAT,
            }
        },
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def read_quantization(raw: dict) -> str | None:
    """``FORMAT`` if a raw ``config.json`` dict declares packed MXFP4 experts, None if it has no
    ``quantization_config``; ValueError for any other quantisation (method, format or weight type)."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError("config.json: quantization_config must be an object")
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"config.json: quantization_config.quant_method={qc.get('quant_method')!r} is not "
            f"supported (only compressed-tensors {FORMAT})"
        )
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise ValueError("config.json: quantization_config.config_groups must be an object")
    formats = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    if formats != {FORMAT}:
        raise ValueError(
            f"config.json: quantization format {sorted(map(str, formats))} is not supported (only {FORMAT})"
        )
    for name, g in groups.items():
        w = (g or {}).get("weights") or {}
        got = (w.get("num_bits"), w.get("type"), w.get("group_size"))
        if w and got != (4, "float", GROUP):
            raise ValueError(
                f"config.json: quantization group {name}: weights (num_bits, type, group_size) = {got}, "
                f"expected (4, 'float', {GROUP}) for {FORMAT}"
            )
        if (g or {}).get("input_activations"):
            log.info(
                "quantization group %s declares input_activations; they are a runtime choice here "
                "(k3.quant.enable_qat(model, weights=None, activations=...)), the model loads without them",
                name,
            )
    return FORMAT


def pack_weight(w: Tensor, mode: str = "floor") -> tuple[Tensor, Tensor]:
    """W [out, in] float -> (weight_packed uint8 [out, in / 2], weight_scale uint8 [out, in / 32])."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise ValueError(f"an MXFP4 weight must be [out, in] with in a multiple of {GROUP}, got {tuple(w.shape)}")
    codes, scales = quantize(w, ELEM, GROUP, mode)
    return pack_fp4(codes), scales


def pack_expert_tensors(tensors: dict[str, Tensor], mode: str = "floor") -> dict[str, Tensor]:
    """Checkpoint tensors -> the same with every ``...experts.J.w{1,2,3}.weight`` replaced by
    ``weight_packed`` + ``weight_scale`` (order kept); other tensors are passed through unchanged."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            out[name] = t
            continue
        try:
            packed, scale = pack_weight(t, mode)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        out[f"{m.group(1)}.{PACKED}"], out[f"{m.group(1)}.{SCALE}"] = packed.contiguous(), scale.contiguous()
    return out


def map_packed_pairs(tensors: dict[str, Tensor], fn: Callable[[Tensor, Tensor], Tensor]) -> dict[str, Tensor]:
    """Every ``X.weight_packed`` + ``X.weight_scale`` pair of ``tensors`` (real or meta) checked and replaced by
    ``X.weight = fn(packed, scale)``; other tensors passed through (order kept). ValueError for a half pair, a
    wrong dtype or mismatched shapes."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("." + SCALE):
            if name[: -len(SCALE)] + PACKED not in tensors:
                raise ValueError(f"checkpoint has {name} without its {PACKED}")
            continue
        if not name.endswith("." + PACKED):
            out[name] = t
            continue
        base = name[: -len(PACKED) - 1]
        scale = tensors.get(f"{base}.{SCALE}")
        if scale is None:
            raise ValueError(f"checkpoint has {name} without its {SCALE}")
        if t.dtype != torch.uint8:
            raise ValueError(f"{name}: expected uint8, got {t.dtype}")
        want = (*t.shape[:-1], 2 * t.shape[-1] // GROUP) if t.dim() else None
        if t.dim() == 0 or (2 * t.shape[-1]) % GROUP or tuple(scale.shape) != want:
            raise ValueError(
                f"{name} {tuple(t.shape)} and its {SCALE} {tuple(scale.shape)} do not match "
                f"(expected scales {want} for groups of {GROUP})"
            )
        out[f"{base}.weight"] = fn(t, scale)
    return out


def unpack_expert_tensors(tensors: dict[str, Tensor], dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Inverse of :func:`pack_expert_tensors`: every ``X.weight_packed`` + ``X.weight_scale`` pair becomes a
    dequantised ``X.weight`` in ``dtype`` (:func:`map_packed_pairs` checks the pairs)."""
    return map_packed_pairs(tensors, lambda packed, scale: unpack_weight(packed, scale, dtype))


class PackedExperts(nn.Module):
    """Routed experts kept packed in memory (inference): uint8 buffers ``w{1,2,3}_packed`` [E, out, in / 2]
    and ``w{1,2,3}_scale`` [E, out, in / 32] (4.25 bits a weight). The forward reads them through
    k3.ops.moe.mxfp4.moe_experts_packed (only the selected experts are dequantised, in :attr:`dtype`).

    The properties ``w1``, ``w3`` [E, I, D] and ``w2`` [E, D, I] dequantise the whole bank on every access, in the
    dtype of the model (the non-persistent ``dtype_ref`` buffer follows ``model.cast`` / ``.to``): they are for
    conversion, export and comparisons, not for the forward."""

    packed = True  # what k3.model.moe.MoE asks to route its experts to the packed op

    def __init__(self, num_experts: int, dim: int, intermediate: int):
        super().__init__()
        if dim % GROUP or intermediate % GROUP:
            raise ValueError(f"packed experts need widths that are multiples of {GROUP}, got D={dim}, I={intermediate}")
        for w, (out_f, in_f) in (("w1", (intermediate, dim)), ("w2", (dim, intermediate)), ("w3", (intermediate, dim))):
            self.register_buffer(f"{w}_packed", torch.zeros(num_experts, out_f, in_f // 2, dtype=torch.uint8))
            self.register_buffer(f"{w}_scale", torch.zeros(num_experts, out_f, in_f // GROUP, dtype=torch.uint8))
        # real (not meta) even when built under torch.device("meta"): it only carries a dtype and a device
        self.register_buffer("dtype_ref", torch.zeros(0, device="cpu"), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the experts are dequantised to: the model's."""
        return self.dtype_ref.dtype

    def _weight(self, w: str) -> Tensor:
        return unpack_weight(getattr(self, f"{w}_packed"), getattr(self, f"{w}_scale"), self.dtype_ref.dtype)

    @property
    def w1(self) -> Tensor:
        """Every expert's gate weight [E, I, D], dequantised (conversion and export only)."""
        return self._weight("w1")

    @property
    def w2(self) -> Tensor:
        """Every expert's down weight [E, D, I], dequantised (conversion and export only)."""
        return self._weight("w2")

    @property
    def w3(self) -> Tensor:
        """Every expert's up weight [E, I, D], dequantised (conversion and export only)."""
        return self._weight("w3")


def use_packed_experts(model: nn.Module) -> int:
    """Replace every MoE layer's ``experts`` by an empty :class:`PackedExperts` of the same shape (to be
    filled by ``load_state_dict``); returns how many layers were changed."""
    from k3.model.moe import MoE

    n = 0
    for moe in model.modules():
        if isinstance(moe, MoE) and not getattr(moe.experts, "packed", False):
            e, i, d = moe.experts.w1.shape
            moe.experts = PackedExperts(e, d, i)
            n += 1
    return n
