"""Model configuration: nested dataclasses, validated on construction.

Every impossible value raises one ``ValueError`` whose single line names the field, e.g.
``moe.num_experts_per_token=20 must be <= moe.num_experts=8``.

Layer indices are 0-indexed here (``mla_layers``); the HF ``config.json`` keeps K3's 1-indexed
``linear_attn_config.kda_layers`` / ``full_attn_layers`` (see ``k3.config.hf``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

ATTN_RES_MODES = ("snapshot", "block_sum", "full", "none")
HIDDEN_ACTS = ("situ", "silu")


def _fail(path: str, msg: str) -> None:
    raise ValueError(f"{path} {msg}")


def _positive_int(obj: Any, prefix: str, *names: str, least: int = 1) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            _fail(
                f"{prefix}{name}={value!r}",
                "must be a positive integer" if least == 1 else "must be a non-negative integer",
            )


def _positive_float(obj: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            _fail(f"{prefix}{name}={value!r}", "must be a positive finite number")


@dataclass
class KDAConfig:
    """Kimi Delta Attention (docs/architecture.md#kda). Widths: q/k = num_heads*head_dim, v = num_heads*v_head_dim."""

    num_heads: int = 96
    head_dim: int = 128
    v_head_dim: int = 128
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # K3 sigmoid gate in (lb, 0); None = Kimi-Linear softplus gate
    full_rank_output_gate: bool = True  # K3: g_proj d -> H*dv; Kimi-Linear: g_a_proj/g_b_proj of rank output_gate_rank
    forget_gate_rank: int = 128  # f_a_proj d -> rank, f_b_proj rank -> H*dk (open point: rank = head_dim)
    output_gate_rank: int = 128  # used only when full_rank_output_gate is False
    chunk_size: int = 64
    l2norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "kda.") -> None:
        _positive_int(
            self,
            prefix,
            "num_heads",
            "head_dim",
            "v_head_dim",
            "conv_kernel_size",
            "forget_gate_rank",
            "output_gate_rank",
            "chunk_size",
        )
        _positive_float(self, prefix, "l2norm_eps")
        if self.gate_lower_bound is not None:
            lb = self.gate_lower_bound
            if isinstance(lb, bool) or not isinstance(lb, (int, float)) or not math.isfinite(lb) or lb >= 0:
                _fail(f"{prefix}gate_lower_bound={lb!r}", "must be a negative number or None (softplus gate)")
        if self.chunk_size % 16 and self.chunk_size > 16:
            _fail(f"{prefix}chunk_size={self.chunk_size}", "must be <= 16 or a multiple of 16 (sub-chunk size)")


@dataclass
class MLAConfig:
    """Gated (NoPE) multi-head latent attention (docs/architecture.md#mla)."""

    num_heads: int = 96
    q_lora_rank: int | None = 1536  # None: plain q_proj (Kimi-Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    output_gate: bool = True  # element-wise sigmoid gate before o_proj (K3); False for Kimi-Linear / K2
    rope_theta: float | None = None  # None = NoPE (K3, Kimi-Linear); K2 rotates the rope slice (no YaRN here)
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "mla.") -> None:
        _positive_int(self, prefix, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            _positive_int(self, prefix, "q_lora_rank")
        _positive_int(self, prefix, "qk_rope_head_dim", least=0)
        _positive_float(self, prefix, "norm_eps")
        if self.rope_theta is not None:
            _positive_float(self, prefix, "rope_theta")
            if self.qk_rope_head_dim % 2:
                _fail(f"{prefix}qk_rope_head_dim={self.qk_rope_head_dim}", "must be even when rope_theta is set")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class MoEConfig:
    """Sigmoid-routed MoE; Stable LatentMoE when latent_size is set (docs/architecture.md#latentmoe)."""

    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072  # per-expert GLU width (shared experts too, unless the next is set)
    shared_intermediate_size: int | None = None  # a shared expert's GLU width; None = moe_intermediate_size
    latent_size: int | None = 3584  # routed_expert_hidden_size; None = plain MoE (Kimi-Linear, K2)
    latent_norm: bool = True  # RMSNorm on the routed aggregate (Stable LatentMoE)
    routed_scaling_factor: float = 1.0
    renormalize: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def shared_width(self) -> int:
        """The shared experts' GLU width in all (they run as one wide GLU)."""
        return (self.shared_intermediate_size or self.moe_intermediate_size) * self.num_shared_experts

    def validate(self, prefix: str = "moe.") -> None:
        _positive_int(self, prefix, "num_experts", "num_experts_per_token", "moe_intermediate_size")
        _positive_int(self, prefix, "num_shared_experts", least=0)
        if self.num_experts_per_token > self.num_experts:
            _fail(
                f"{prefix}num_experts_per_token={self.num_experts_per_token}",
                f"must be <= {prefix}num_experts={self.num_experts}",
            )
        if self.latent_size is not None:
            _positive_int(self, prefix, "latent_size")
        if self.shared_intermediate_size is not None:
            _positive_int(self, prefix, "shared_intermediate_size")
        _positive_float(self, prefix, "routed_scaling_factor")


@dataclass
class AttnResConfig:
    """Attention Residuals over depth (docs/architecture.md#attnres). block_size counts decoder layers (attention +
    FFN each)."""

    mode: str = "snapshot"  # "snapshot" (checkpoint-compatible) | "block_sum" (paper) | "full" | "none"
    block_size: int = 12

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "attn_res.") -> None:
        if self.mode not in ATTN_RES_MODES:
            _fail(f"{prefix}mode={self.mode!r}", f"must be one of {', '.join(ATTN_RES_MODES)}")
        _positive_int(self, prefix, "block_size")


@dataclass
class VisionConfig:
    """MoonViT-V2 encoder shape and media token ids (docs/architecture.md#vision); see k3.model.vision."""

    num_layers: int = 27
    hidden_size: int = 1024
    num_heads: int = 12
    head_dim: int = 128
    intermediate_size: int = 4096
    patch_size: int = 14
    merge_size: int = 2
    pos_grid: int = 64
    media_placeholder_token_id: int = 163605
    # Wrap each image's tokens as begin, placeholder x n, end; None: no wrapping. The `k3` preset sets K3's
    # <|media_begin|> 163602 / <|media_end|> 163604, taken from a third-party transcription of K3's
    # tokenizer_config.json, not from a file of Moonshot's we have read (k3.config.presets.k3_vision).
    media_begin_token_id: int | None = None
    media_end_token_id: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "vision.") -> None:
        _positive_int(
            self,
            prefix,
            "num_layers",
            "hidden_size",
            "num_heads",
            "head_dim",
            "intermediate_size",
            "patch_size",
            "merge_size",
            "pos_grid",
        )
        ids = [self.media_placeholder_token_id, self.media_begin_token_id, self.media_end_token_id]
        if any(i is not None and (isinstance(i, bool) or not isinstance(i, int) or i < 0) for i in ids):
            _fail(f"{prefix}media token ids {ids}", "must be non-negative integers (begin / end may be None)")
        if (ids[1] is None) != (ids[2] is None) or (ids[1] is not None and len(set(ids)) != 3):
            _fail(f"{prefix}media token ids {ids}", "need begin and end both set (or both None), all three distinct")
        if self.head_dim % 4:
            _fail(f"{prefix}head_dim={self.head_dim}", "must be divisible by 4 (2D RoPE splits it in quarters)")


@dataclass
class K3Config:
    """The whole text model. Sub-configs: ``kda``, ``mla``, ``moe``, ``attn_res``, optional ``vision``."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    mla_layers: tuple[int, ...] = tuple(range(3, 92, 4)) + (92,)  # 0-indexed; every other layer is KDA
    first_k_dense_replace: int = 1  # layers [0, k) use the dense FFN, the rest MoE
    intermediate_size: int = 33792  # dense FFN width
    hidden_act: str = "situ"  # "situ" (SiTU-GLU) or "silu" (SwiGLU)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    attn_res: AttnResConfig = field(default_factory=AttnResConfig)
    vision: VisionConfig | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        self.mla_layers = tuple(self.mla_layers)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        _positive_int(
            self, "", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings"
        )
        _positive_float(self, "", "situ_beta", "situ_linear_beta", "rms_norm_eps", "initializer_range")
        if self.hidden_act not in HIDDEN_ACTS:
            _fail(f"hidden_act={self.hidden_act!r}", f"must be one of {', '.join(HIDDEN_ACTS)}")
        if self.tie_word_embeddings:
            _fail("tie_word_embeddings=True", "is not supported: K3 has an untied embedding and lm_head")
        n = self.num_hidden_layers
        fk = self.first_k_dense_replace
        if isinstance(fk, bool) or not isinstance(fk, int) or not 0 <= fk <= n:
            _fail(f"first_k_dense_replace={fk!r}", f"must be an integer in [0, num_hidden_layers={n}]")
        for i in self.mla_layers:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                _fail(f"mla_layers contains {i!r}", f"which is out of range [0, num_hidden_layers={n})")
        if len(set(self.mla_layers)) != len(self.mla_layers):
            _fail(f"mla_layers={list(self.mla_layers)}", "has duplicate layer indices")
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, tok)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size):
                _fail(f"{tok}={v!r}", f"must be None or in [0, vocab_size={self.vocab_size})")
        for sub, cls in (("kda", KDAConfig), ("mla", MLAConfig), ("moe", MoEConfig), ("attn_res", AttnResConfig)):
            value = getattr(self, sub)
            if not isinstance(value, cls):
                _fail(f"{sub}={value!r}", f"must be a {cls.__name__}")
            value.validate(f"{sub}.")
        if self.vision is not None:
            if not isinstance(self.vision, VisionConfig):
                _fail(f"vision={self.vision!r}", "must be a VisionConfig or None")
            self.vision.validate("vision.")
        if self.moe.latent_size is not None and self.moe.latent_size > self.hidden_size:
            _fail(f"moe.latent_size={self.moe.latent_size}", f"must be <= hidden_size={self.hidden_size}")

    # ------------------------------------------------------------------ schedule
    def mixer(self, layer: int) -> str:
        """'mla' or 'kda' for a 0-indexed layer."""
        return "mla" if layer in self.mla_layers else "kda"

    def ffn(self, layer: int) -> str:
        """'dense' or 'moe' for a 0-indexed layer."""
        return "dense" if layer < self.first_k_dense_replace else "moe"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The 0-indexed layers whose FFN is a MoE, in order."""
        return tuple(i for i in range(self.num_hidden_layers) if self.ffn(i) == "moe")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.mla_layers)

    def attn_res_block(self, layer: int) -> int | None:
        """Index of the AttnRes block holding a layer (None when AttnRes is off)."""
        return None if self.attn_res.mode == "none" else layer // self.attn_res.block_size

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mla_layers"] = list(self.mla_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown K3Config field(s): {', '.join(unknown)}")
        subs = {"kda": KDAConfig, "mla": MLAConfig, "moe": MoEConfig, "attn_res": AttnResConfig, "vision": VisionConfig}
        for key, sub_cls in subs.items():
            if isinstance(d.get(key), dict):
                sub_known = {f.name for f in dataclasses.fields(sub_cls)}
                bad = sorted(set(d[key]) - sub_known)
                if bad:
                    raise ValueError(f"unknown {key} field(s): {', '.join(bad)}")
                d[key] = sub_cls(**d[key])
        if "mla_layers" in d:
            d["mla_layers"] = tuple(d["mla_layers"])
        return cls(**d)

    def replace(self, **overrides: Any) -> "K3Config":
        """A validated copy with dotted overrides, e.g. ``cfg.replace(**{"moe.num_experts": 8, "hidden_size": 64})``."""
        d = self.to_dict()
        for key, value in overrides.items():
            target = d
            *parents, leaf = key.split(".")
            for p in parents:
                if not isinstance(target.get(p), dict):
                    raise ValueError(f"unknown config field {key!r}")
                target = target[p]
            if leaf not in target:
                raise ValueError(f"unknown config field {key!r}")
            target[leaf] = value
        return K3Config.from_dict(d)
