"""Tensor names: our state dict <-> checkpoint files.

Our module names are the K3 / original Kimi-Linear checkpoint names, with two storage differences:
- routed experts are stacked ``block_sparse_moe.experts.w{1,2,3}`` [E, out, in] (files: one tensor per
  expert, ``block_sparse_moe.experts.{j}.w{1,2,3}.weight``); packed MXFP4 experts (k3.quant.packed) likewise
  stack ``experts.w{1,2,3}_packed`` / ``_scale`` <-> ``experts.{j}.w{1,2,3}.weight_packed`` / ``weight_scale``;
- KDA ``A_log`` is [H]. Files: with K3's bounded gate (``kda.gate_lower_bound`` set) 1-D, zero-padded to the
  next multiple of 128 (:func:`a_log_file_size`; the K3 release stores 96 heads as [128]); with the softplus gate
  [1, 1, H, 1], as Kimi-Linear stores it (transformers' ``KimiLinearForCausalLM`` loads that shape).
Writing always uses the file names above (the K3 release and transformers' ``save_pretrained`` both do).
Reading also accepts transformers' runtime names (``self_attn.forget_gate.*``, one fused ``self_attn.conv1d``,
``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.gate`` / ``mlp.shared_experts`` for MoE layers, a dense
FFN under ``block_sparse_moe.``), the multimodal ``language_model.`` prefix, and either ``A_log`` layout (any
shape holding H values, or more with zeros past H).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from k3.config import K3Config

_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight"
                     r"(_packed|_scale)?$")
_STACKED = re.compile(r"\.block_sparse_moe\.experts\.(w[123])(_packed|_scale)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


A_LOG_PAD = 128


def a_log_file_size(num_heads: int) -> int:
    """Length of a bounded-gate ``A_log`` in a file: ``num_heads`` rounded up to a multiple of 128.

    The one data point is the K3 release, which stores its 96 heads as [128]. That fits a fixed length of 128 and
    rounding up to a multiple of 128 alike; the two agree up to 128 heads, and only the multiple holds more, so we
    read it as the multiple. Our reader takes the first H values of any zero-padded length."""
    return -(-num_heads // A_LOG_PAD) * A_LOG_PAD


def _a_log_to_file(t: Tensor, config: K3Config) -> Tensor:
    """One layer's A_log [H] in its file layout (see the module docstring)."""
    if config.kda.gate_lower_bound is None:
        return t.reshape(1, 1, -1, 1).contiguous()
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(a_log_file_size(flat.numel()) - flat.numel())])


def to_files(state: dict[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """Our state dict -> checkpoint tensors (per-expert matrices, A_log in its file layout); contiguous copies."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        m = _STACKED.search(name)
        if m:
            prefix, suffix = name[: m.start()] + ".block_sparse_moe.experts", m.group(2) or ""
            for j in range(t.shape[0]):
                out[f"{prefix}.{j}.{m.group(1)}.weight{suffix}"] = t[j].contiguous()
        elif name.endswith(".self_attn.A_log"):
            out[name] = _a_log_to_file(t, config)
        else:
            out[name] = t.contiguous()
    return out


def _canonical_name(name: str, config: K3Config) -> str:
    """Rename one tensor (no reshaping) from any accepted spelling to ours."""
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    m = _LAYER.match(name)
    if not m:
        return name
    layer, rest = int(m.group(1)), m.group(2)
    rest = re.sub(r"^self_attn\.forget_gate\.", "self_attn.", rest)
    if config.ffn(layer) == "dense":
        rest = re.sub(r"^block_sparse_moe\.", "mlp.", rest)
    else:
        rest = re.sub(r"^mlp\.", "block_sparse_moe.", rest)
    return f"model.layers.{layer}.{rest}"


def from_files(tensors: dict[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """Checkpoint tensors in any accepted spelling -> our state dict (stacked experts, A_log [H], split convs).

    Raises ValueError for a tensor that cannot be mapped (wrong fused size, missing or duplicate experts).
    """
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    kda, moe = config.kda, config.moe
    for raw, t in tensors.items():
        name = _canonical_name(raw, config)
        m = _EXPERT.match(name)
        if m:
            slot = experts.setdefault((m.group(1), m.group(3) + (m.group(4) or "")), {})
            if int(m.group(2)) in slot:
                raise ValueError(f"checkpoint has expert tensor {raw!r} twice")
            slot[int(m.group(2))] = t
            continue
        if name.endswith(".self_attn.conv1d.weight"):  # transformers fuses q, k, v convs
            sizes = [kda.num_heads * kda.head_dim] * 2 + [kda.num_heads * kda.v_head_dim]
            if t.shape[0] != sum(sizes):
                raise ValueError(f"{raw}: fused conv has {t.shape[0]} channels, expected {sum(sizes)}")
            base = name[: -len("conv1d.weight")]
            for part, piece in zip(("q", "k", "v"), t.split(sizes, dim=0)):
                out[f"{base}{part}_conv1d.weight"] = piece
            continue
        if name.endswith(".experts.gate_up_proj"):  # transformers: [E, 2I, D] = [w1; w3]
            base = name[: -len("gate_up_proj")]
            w1, w3 = t.chunk(2, dim=1)
            out[base + "w1"], out[base + "w3"] = w1, w3
            continue
        if name.endswith(".experts.down_proj"):
            out[name[: -len("down_proj")] + "w2"] = t
            continue
        if name.endswith(".self_attn.A_log"):
            flat = t.reshape(-1)
            h = kda.num_heads
            if flat.numel() > h and torch.count_nonzero(flat[h:]) == 0:
                flat = flat[:h]  # a zero-padded A_log
            out[name] = flat
            continue
        if name in out:
            raise ValueError(f"checkpoint has tensor {name!r} twice (as {raw!r})")
        out[name] = t
    for (prefix, w), slot in experts.items():
        want = list(range(moe.num_experts))
        if sorted(slot) != want:
            missing = sorted(set(want) - set(slot))[:8]
            extra = sorted(set(slot) - set(want))[:8]
            raise ValueError(f"{prefix}.*.{w}: expected experts 0..{moe.num_experts - 1}; missing {missing}, "
                             f"unexpected {extra}")
        shapes = {tuple(slot[j].shape) for j in want}
        if len(shapes) != 1:
            raise ValueError(f"{prefix}.*.{w}: experts have different shapes {sorted(shapes)}")
        out[f"{prefix}.{w}"] = torch.stack([slot[j] for j in want])
    return out
