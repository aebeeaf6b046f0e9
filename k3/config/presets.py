"""Presets as functions. ``tiny`` hits every branch, ``small`` trains on a CPU, the rest are published models."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from k3.config.config import AttnResConfig, K3Config, KDAConfig, MLAConfig, MoEConfig, VisionConfig


def tiny() -> K3Config:
    """5 layers [KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE, MLA+MoE]; AttnRes blocks [0,1] [2,3] [4] (partial)."""
    return K3Config(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=5,
        mla_layers=(3, 4),
        first_k_dense_replace=1,
        intermediate_size=128,
        max_position_embeddings=4096,
        kda=KDAConfig(num_heads=2, head_dim=16, v_head_dim=16, forget_gate_rank=16, output_gate_rank=16, chunk_size=16),
        mla=MLAConfig(
            num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
        ),
        moe=MoEConfig(
            num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32, latent_size=32
        ),
        attn_res=AttnResConfig(mode="snapshot", block_size=2),
    )


def small() -> K3Config:
    """~35M total / ~11M activated parameters in K3's layout: 2 x [KDA, KDA, KDA, MLA] + a final MLA."""
    return K3Config(
        name="small",
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=9,
        mla_layers=(3, 7, 8),
        first_k_dense_replace=1,
        intermediate_size=768,
        max_position_embeddings=65536,
        kda=KDAConfig(num_heads=4, head_dim=64, v_head_dim=64, forget_gate_rank=64, output_gate_rank=64),
        mla=MLAConfig(
            num_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64
        ),
        moe=MoEConfig(
            num_experts=32, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=256, latent_size=128
        ),
        attn_res=AttnResConfig(mode="snapshot", block_size=4),
    )


def small_1b() -> K3Config:
    """~1.0B total / ~0.22B activated in K3's layout, for end-to-end GPU numbers: 3 x [KDA, KDA, KDA, MLA]."""
    return K3Config(
        name="small-1b",
        vocab_size=32768,
        hidden_size=1024,
        num_hidden_layers=12,
        mla_layers=(3, 7, 11),
        first_k_dense_replace=1,
        intermediate_size=2816,
        max_position_embeddings=1048576,
        kda=KDAConfig(num_heads=8, head_dim=128, v_head_dim=128, forget_gate_rank=128, output_gate_rank=128),
        mla=MLAConfig(
            num_heads=8, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
        moe=MoEConfig(
            num_experts=64, num_experts_per_token=6, num_shared_experts=1, moe_intermediate_size=768, latent_size=512
        ),
        attn_res=AttnResConfig(mode="snapshot", block_size=4),
    )


def _kimi_linear_blocks(heads: int, kda_head_dim: int, experts: int, expert_width: int) -> dict:
    """The mixer and MoE configs of a Kimi-Linear model: softplus KDA gate with low-rank gates of the head size,
    MLA without q_lora or output gate (NoPE), plain MoE top-8 with one shared expert, no AttnRes."""
    return dict(
        kda=KDAConfig(
            num_heads=heads,
            head_dim=kda_head_dim,
            v_head_dim=kda_head_dim,
            gate_lower_bound=None,
            full_rank_output_gate=False,
            forget_gate_rank=kda_head_dim,
            output_gate_rank=kda_head_dim,
        ),
        mla=MLAConfig(
            num_heads=heads,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            output_gate=False,
        ),
        moe=MoEConfig(
            num_experts=experts,
            num_experts_per_token=8,
            num_shared_experts=1,
            moe_intermediate_size=expert_width,
            latent_size=None,
            latent_norm=False,
            routed_scaling_factor=2.446,
        ),
        attn_res=AttnResConfig(mode="none", block_size=1),
    )


def kimi_linear_48b() -> K3Config:
    """Kimi-Linear-48B-A3B (docs/architecture.md#layer-schedule): softplus gate, low-rank output gate, no q_lora,
    plain MoE, SwiGLU, no AttnRes."""
    return K3Config(
        name="kimi-linear-48b",
        vocab_size=163840,
        hidden_size=2304,
        num_hidden_layers=27,
        mla_layers=(3, 7, 11, 15, 19, 23, 26),
        first_k_dense_replace=1,
        intermediate_size=9216,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        **_kimi_linear_blocks(heads=32, kda_head_dim=128, experts=256, expert_width=1024),
    )


def kimi_linear_1p3b(full_mla: bool = False) -> K3Config:
    """The decode benchmark's model (k3.bench.decode): Kimi-Linear-shaped, 1.27B parameters in 12 layers (3 MLA);
    ``full_mla``: its twin with MLA in every layer."""
    layers = 12
    return K3Config(
        name="kimi-linear-1.3b" + ("-full-mla" if full_mla else ""),
        vocab_size=32768,
        hidden_size=1024,
        num_hidden_layers=layers,
        mla_layers=tuple(range(layers)) if full_mla else (3, 7, 11),
        first_k_dense_replace=1,
        intermediate_size=4096,
        hidden_act="silu",
        max_position_embeddings=1 << 20,
        **_kimi_linear_blocks(heads=16, kda_head_dim=64, experts=64, expert_width=512),
    )


def k2() -> K3Config:
    """Kimi K2 (docs/architecture.md#layer-schedule): 61 MLA layers with RoPE, 384 experts top-8, 1 shared, SwiGLU;
    1.04T / 32.6B."""
    return K3Config(
        name="k2",
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=61,
        mla_layers=tuple(range(61)),
        first_k_dense_replace=1,
        intermediate_size=18432,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        mla=MLAConfig(
            num_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            output_gate=False,
            rope_theta=50000.0,
        ),
        moe=MoEConfig(
            num_experts=384,
            num_experts_per_token=8,
            num_shared_experts=1,
            moe_intermediate_size=2048,
            latent_size=None,
            latent_norm=False,
            routed_scaling_factor=2.827,
        ),
        attn_res=AttnResConfig(mode="none", block_size=1),
    )


# K3's <|media_begin|> / <|media_end|> ids. They come from a third-party transcription of K3's tokenizer_config.json
# (<|media_begin|> 163602, <|media_content|> 163603, <|media_end|> 163604, <|media_pad|> 163605), not from a file
# of Moonshot's we have read; the placeholder 163605 matches the release config's media_placeholder_token_id.
K3_MEDIA_BEGIN_TOKEN_ID = 163602
K3_MEDIA_END_TOKEN_ID = 163604


def k3_vision() -> VisionConfig:
    """K3's MoonViT-V2 tower (the VisionConfig defaults, docs/architecture.md#vision), each image wrapped in K3's
    media begin / end."""
    return VisionConfig(media_begin_token_id=K3_MEDIA_BEGIN_TOKEN_ID, media_end_token_id=K3_MEDIA_END_TOKEN_ID)


def k3() -> K3Config:
    """Kimi K3 as released (docs/architecture.md#layer-schedule): 93 layers, 69 KDA + 24 gated NoPE MLA, Stable
    LatentMoE 896/16 + 2 shared."""
    return K3Config(name="k3", vision=k3_vision())


def k3_slice() -> K3Config:
    """K3's exact widths (docs/architecture.md#layer-schedule) in 5 layers, text only: the dense first layer, then one
    period of K3's schedule, 3 KDA + 1 MLA, all MoE (896 experts, top-16, latent 3584, expert width 3072, 2 shared;
    AttnRes). For measuring one layer of each kind at full width on one GPU (~118B routed-expert weights: packed MXFP4,
    ~63 GB)."""
    return k3().replace(name="k3-slice", num_hidden_layers=5, mla_layers=[4], vision=None)


# Vision towers for the small presets (docs/architecture.md#vision shape, scaled down); the text presets stay
# text-only and
# ``with_vision`` attaches the matching tower (config.json carries it through a checkpoint round trip).
def tiny_vision() -> VisionConfig:
    """2 layers, width 64, 4 heads x 16, MLP 128, 16 x 16 position grid (~0.12M encoder parameters)."""
    return VisionConfig(num_layers=2, hidden_size=64, num_heads=4, head_dim=16, intermediate_size=128, pos_grid=16)


def small_vision() -> VisionConfig:
    """4 layers, width 256, 4 heads x 64, MLP 1024, 32 x 32 position grid (~3.6M encoder parameters)."""
    return VisionConfig(num_layers=4, hidden_size=256, num_heads=4, head_dim=64, intermediate_size=1024, pos_grid=32)


def small_1b_vision() -> VisionConfig:
    """8 layers, width 512, 8 heads x 64, MLP 2048, 48 x 48 position grid (~26.7M encoder parameters)."""
    return VisionConfig(num_layers=8, hidden_size=512, num_heads=8, head_dim=64, intermediate_size=2048, pos_grid=48)


VISION_PRESETS: dict[str, Callable[[], VisionConfig]] = {
    "tiny": tiny_vision,
    "small": small_vision,
    "small-1b": small_1b_vision,
    "k3": k3_vision,
}


def with_vision(config: K3Config, vision: VisionConfig | None = None) -> K3Config:
    """A validated copy of ``config`` carrying ``vision``, by default the tower of the preset it is named after."""
    if vision is None:
        if config.name not in VISION_PRESETS:
            raise ValueError(
                f"no vision preset for config {config.name!r}; pass vision= or use one of: {', '.join(VISION_PRESETS)}"
            )
        vision = VISION_PRESETS[config.name]()
    return dataclasses.replace(config, vision=vision)


PRESETS: dict[str, Callable[[], K3Config]] = {
    "tiny": tiny,
    "small": small,
    "small-1b": small_1b,
    "kimi-linear-48b": kimi_linear_48b,
    "k2": k2,
    "k3": k3,
    "k3-slice": k3_slice,
}


def get_preset(name: str) -> K3Config:
    """Build a preset by name; unknown names raise one ValueError listing the choices."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
