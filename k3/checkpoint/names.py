"""Tensor names: our state dict <-> checkpoint files.

Our module names are the K3 / original Kimi-Linear checkpoint names, with two storage differences:
- routed experts are stacked ``block_sparse_moe.experts.w{1,2,3}`` [E, out, in] (files: one tensor per
  expert, ``block_sparse_moe.experts.{j}.w{1,2,3}.weight``); packed MXFP4 experts (k3.quant.packed) likewise
  stack ``experts.w{1,2,3}_packed`` / ``_scale`` <-> ``experts.{j}.w{1,2,3}.weight_packed`` / ``weight_scale``;
- KDA ``A_log`` is [H]. Files: with K3's bounded gate (``kda.gate_lower_bound`` set) 1-D, zero-padded to the
  next multiple of 128 (:func:`a_log_file_size`; the K3 release stores 96 heads as [128]); with the softplus gate
  [1, 1, H, 1], as Kimi-Linear stores it (transformers' ``KimiLinearForCausalLM`` loads that shape).
Writing always uses the file names above (the K3 release and transformers' ``save_pretrained`` both do); the
``release`` layout also puts the text model under ``language_model.`` and names the vision tower as the
multimodal release does (:data:`VISION_NAMES`, docs/architecture.md#checkpoints).
Reading also accepts transformers' runtime names (``self_attn.forget_gate.*``, one fused ``self_attn.conv1d``,
``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.gate`` / ``mlp.shared_experts`` for MoE layers, a dense
FFN under ``block_sparse_moe.``), the multimodal ``language_model.`` prefix, either vision spelling (ours or the
release's, told apart by :func:`vision_layout`) and either ``A_log`` layout (any shape holding H values, or more
with zeros past H). :func:`map_tensor` maps one file tensor at a time, so a loader can stream.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from k3.config import K3Config

_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight"
    r"(_packed|_scale)?$"
)
_STACKED = re.compile(r"\.block_sparse_moe\.experts\.(w[123])(_packed|_scale)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


A_LOG_PAD = 128


def a_log_file_size(num_heads: int) -> int:
    """Length of a bounded-gate ``A_log`` in a file: ``num_heads`` rounded up to a multiple of 128.

    The one data point is the K3 release, which stores its 96 heads as [128]. That fits a fixed length of 128 and
    rounding up to a multiple of 128 alike; the two agree up to 128 heads, and only the multiple holds more, so we
    read it as the multiple. Our reader takes the first H values of any zero-padded length."""
    return -(-num_heads // A_LOG_PAD) * A_LOG_PAD


# The one vision name table: our module names <-> the multimodal release's (``{i}``: a tower block). The K3
# spec notes do not list the release's vision tensor names; these follow the MoonViT family's (Kimi-VL /
# Kimi-K2.5: ``vision_tower.patch_embed`` / ``encoder.blocks.{i}.wqkv`` ..., projector under ``mm_projector.``),
# see docs/decisions.md. The release patch embedding is a conv [D, 3, p, p]; ours a Linear [D, 3*p*p] over
# channel-major patches, the same numbers.
VISION_NAMES = (
    ("vision_tower.encoder.patch_embed.weight", "vision_tower.patch_embed.proj.weight"),
    ("vision_tower.encoder.pos_embed", "vision_tower.patch_embed.pos_emb.weight"),
    ("vision_tower.encoder.blocks.{i}.norm1.weight", "vision_tower.encoder.blocks.{i}.norm0.weight"),
    ("vision_tower.encoder.blocks.{i}.attn.qkv.weight", "vision_tower.encoder.blocks.{i}.wqkv.weight"),
    ("vision_tower.encoder.blocks.{i}.attn.proj.weight", "vision_tower.encoder.blocks.{i}.wo.weight"),
    ("vision_tower.encoder.blocks.{i}.norm2.weight", "vision_tower.encoder.blocks.{i}.norm1.weight"),
    ("vision_tower.encoder.blocks.{i}.mlp.fc1.weight", "vision_tower.encoder.blocks.{i}.mlp.fc0.weight"),
    ("vision_tower.encoder.blocks.{i}.mlp.fc2.weight", "vision_tower.encoder.blocks.{i}.mlp.fc1.weight"),
    ("vision_tower.encoder.norm.weight", "vision_tower.encoder.final_layernorm.weight"),
    ("vision_tower.projector.fc1.weight", "mm_projector.proj.0.weight"),
    ("vision_tower.projector.fc2.weight", "mm_projector.proj.2.weight"),
    ("vision_tower.projector.norm.weight", "mm_projector.post_norm.weight"),
)
TEXT_PREFIX = "language_model."
LAYOUTS = ("k3", "release")


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_RELEASE = [(_pattern(ours), release) for ours, release in VISION_NAMES]
_FROM_RELEASE = [(_pattern(release), ours) for ours, release in VISION_NAMES]
_PATCH_EMBED = "vision_tower.encoder.patch_embed.weight"


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group(1)) if m.groups() else target
    return None


def vision_layout(names) -> str:
    """``release`` when checkpoint tensor names use the release's vision spelling (``mm_projector.*``,
    ``...wqkv``, ``patch_embed.proj``), else ``k3`` (our module names)."""
    for n in names:
        if n.startswith("mm_projector.") or (
            n.startswith("vision_tower.")
            and (".wqkv." in n or ".patch_embed.proj." in n or n.endswith("final_layernorm.weight"))
        ):
            return "release"
    return "k3"


def _a_log_to_file(t: Tensor, config: K3Config) -> Tensor:
    """One layer's A_log [H] in its file layout (see the module docstring)."""
    if config.kda.gate_lower_bound is None:
        return t.reshape(1, 1, -1, 1).contiguous()
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(a_log_file_size(flat.numel()) - flat.numel())])


def to_files(state: dict[str, Tensor], config: K3Config, layout: str = "k3") -> dict[str, Tensor]:
    """Our state dict -> checkpoint tensors (per-expert matrices, A_log in its file layout); contiguous copies.
    ``layout="release"``: the multimodal release's names (text under ``language_model.``, vision per
    :data:`VISION_NAMES`, conv-shaped patch embedding)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {', '.join(LAYOUTS)}")
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if layout == "release" and name.startswith("vision_tower."):
            target = _rename(name, _TO_RELEASE)
            if target is None:
                raise ValueError(f"{name}: no release name for this vision tensor (k3.checkpoint.names.VISION_NAMES)")
            if name == _PATCH_EMBED:
                p = config.vision.patch_size
                t = t.reshape(t.shape[0], -1, p, p)
            out[target] = t.contiguous()
            continue
        prefix = TEXT_PREFIX if layout == "release" else ""
        m = _STACKED.search(name)
        if m:
            base, suffix = name[: m.start()] + ".block_sparse_moe.experts", m.group(2) or ""
            for j in range(t.shape[0]):
                out[f"{prefix}{base}.{j}.{m.group(1)}.weight{suffix}"] = t[j].contiguous()
        elif name.endswith(".self_attn.A_log"):
            out[prefix + name] = _a_log_to_file(t, config)
        else:
            out[prefix + name] = t.contiguous()
    return out


def _canonical_name(name: str, config: K3Config, layout: str = "k3") -> str:
    """Rename one tensor (no reshaping) from any accepted spelling to ours."""
    if layout == "release" and name.startswith(("vision_tower.", "mm_projector.")):
        return _rename(name, _FROM_RELEASE) or name
    if name.startswith(TEXT_PREFIX):
        name = name[len(TEXT_PREFIX) :]
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


def map_tensor(raw: str, t: Tensor, config: K3Config, layout: str = "k3") -> list[tuple[str, int | None, Tensor]]:
    """One checkpoint tensor -> its pieces of our state dict: ``(name, expert index or None, tensor)``.

    A per-expert matrix is slot ``j`` of the stacked ``...experts.w{1,2,3}``; transformers' fused conv and
    ``gate_up_proj`` split into several pieces. Works on meta tensors too (shapes only; a zero-padded A_log is
    then assumed to be padding). ValueError for a tensor that cannot be mapped (wrong fused size)."""
    kda = config.kda
    name = _canonical_name(raw, config, layout)
    m = _EXPERT.match(name)
    if m:
        return [(f"{m.group(1)}.{m.group(3)}{m.group(4) or ''}", int(m.group(2)), t)]
    if name.endswith(".self_attn.conv1d.weight"):  # transformers fuses q, k, v convs
        sizes = [kda.num_heads * kda.head_dim] * 2 + [kda.num_heads * kda.v_head_dim]
        if t.shape[0] != sum(sizes):
            raise ValueError(f"{raw}: fused conv has {t.shape[0]} channels, expected {sum(sizes)}")
        base = name[: -len("conv1d.weight")]
        return [
            (f"{base}{part}_conv1d.weight", None, piece) for part, piece in zip(("q", "k", "v"), t.split(sizes, dim=0))
        ]
    if name.endswith(".experts.gate_up_proj"):  # transformers: [E, 2I, D] = [w1; w3]
        base = name[: -len("gate_up_proj")]
        w1, w3 = t.chunk(2, dim=1)
        return [(base + "w1", None, w1), (base + "w3", None, w3)]
    if name.endswith(".experts.down_proj"):
        return [(name[: -len("down_proj")] + "w2", None, t)]
    if name.endswith(".self_attn.A_log"):
        flat = t.reshape(-1)
        h = kda.num_heads
        if flat.numel() > h and (flat.is_meta or torch.count_nonzero(flat[h:]) == 0):
            flat = flat[:h]  # a zero-padded A_log
        return [(name, None, flat)]
    if name == _PATCH_EMBED and t.dim() == 4:  # the release's conv-shaped patch embedding
        return [(name, None, t.reshape(t.shape[0], -1))]
    return [(name, None, t)]


def from_files(tensors: dict[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """Checkpoint tensors in any accepted spelling -> our state dict (stacked experts, A_log [H], split convs).

    Raises ValueError for a tensor that cannot be mapped (wrong fused size, missing or duplicate experts).
    """
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = {}
    layout = vision_layout(tensors)
    for raw, t in tensors.items():
        for name, j, piece in map_tensor(raw, t, config, layout):
            if j is not None:
                slot = experts.setdefault(name, {})
                if j in slot:
                    raise ValueError(f"checkpoint has expert tensor {raw!r} twice")
                slot[j] = piece
                continue
            if name in out:
                raise ValueError(f"checkpoint has tensor {name!r} twice (as {raw!r})")
            out[name] = piece
    for name, slot in experts.items():
        check_experts(name, {j: tuple(t.shape) for j, t in slot.items()}, config.moe.num_experts)
        out[name] = torch.stack([slot[j] for j in range(config.moe.num_experts)])
    return out


def check_experts(name: str, shapes: dict[int, tuple], num_experts: int) -> None:
    """One stacked expert tensor's file pieces: experts 0..E-1, each once, all of one shape; else ValueError."""
    want = list(range(num_experts))
    prefix, w = name.rsplit(".", 1)
    if sorted(shapes) != want:
        missing = sorted(set(want) - set(shapes))[:8]
        extra = sorted(set(shapes) - set(want))[:8]
        raise ValueError(
            f"{prefix}.*.{w}: expected experts 0..{num_experts - 1}; missing {missing}, unexpected {extra}"
        )
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{prefix}.*.{w}: experts have different shapes {sorted(set(shapes.values()))}")
