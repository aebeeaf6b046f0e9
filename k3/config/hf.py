"""``config.json`` <-> ``K3Config``.

A config names what it is. One transformers' ``KimiLinearForCausalLM`` can run (no K3-only feature) says
``model_type: kimi_linear``; one with K3's features (SiTU, AttnRes, LatentMoE, the bounded gate, Gated MLA, a
vision tower, ...) says the K3 release's ``model_type: kimi_k3`` with ``architectures: [KimiK3ForCausalLM]``,
the text-model counterpart of the release's ``KimiK3ForConditionalGeneration`` (transformers runs it through the
modeling code the checkpoint carries: k3.checkpoint.hf_code). Three formats:
- ``k3``: the released K3 text-config keys (docs/architecture.md#layer-schedule): 1-indexed
  ``linear_attn_config.kda_layers`` / ``full_attn_layers``, ``gate_lower_bound``, ``use_full_rank_gate``,
  ``mla_use_output_gate``, ``routed_expert_hidden_size``, ``latent_moe_use_norm``, ``attn_res_block_size``,
  ``activation_situ_*``, plus a ``k3`` sub-dict for what the release does not spell out (AttnRes mode, gate
  ranks, chunk size, ...), flat at the top level.
- ``kimi_linear``: the Kimi-Linear keys only, loadable by transformers' ``KimiLinearForCausalLM``; only
  Kimi-Linear-shaped configs can be written this way.
- ``k3-release``: the multimodal release's ``kimi_k3`` wrapper: ``text_config`` (the ``k3`` format, named
  ``kimi_linear`` as the release names it), ``vision_config`` (``vt_*`` keys) and the media token ids at the top
  level; needs a vision tower.
Reading accepts all of these and what earlier versions wrote (a ``k3``-format config named ``kimi_linear``),
transformers' native spellings (``layer_types``, ``mlp_layer_types``, ``linear_num_heads``,
``num_local_experts``, ``num_experts_per_tok``, ``n_shared_experts``, ``norm_topk_prob``, ``model_max_length``)
and the multimodal ``kimi_k3`` wrapper: its ``text_config`` gives the text model, its ``vision_config`` and media
token ids the vision tower (K3's tower and media ids, ``k3.config.presets.k3_vision``, for what it does not spell).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from k3.config.config import AttnResConfig, K3Config, KDAConfig, MLAConfig, MoEConfig, VisionConfig
from k3.config.presets import k3_vision

FORMATS = ("k3", "kimi_linear", "k3-release")
KIMI_LINEAR = ("kimi_linear", "KimiLinearForCausalLM")  # model_type, architecture: transformers runs it natively
KIMI_K3 = ("kimi_k3", "KimiK3ForCausalLM")  # a text model with K3's features (the checkpoint carries its code)
KIMI_K3_RELEASE = ("kimi_k3", "KimiK3ForConditionalGeneration")  # the multimodal release wrapper


_REQUIRED = object()


def _first(d: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def _as_int(value: Any, name: str) -> int:
    """``value`` if it is a JSON integer; else one ValueError naming ``name`` (64.9 is not silently 64)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json: {name}={value!r} must be an integer")
    return value


def _int(d: dict, *keys: str, default: Any = _REQUIRED, prefix: str = "") -> Any:
    """The first of ``keys`` present and not null in ``d``, checked to be an integer; ``default`` when none is
    (a required key: one ValueError naming it)."""
    for k in keys:
        if d.get(k) is not None:
            return _as_int(d[k], prefix + k)
    if default is _REQUIRED:
        raise ValueError(f"config.json: {prefix}{keys[0]} is missing or null")
    return default


def _float(d: dict, key: str, default: float, prefix: str = "") -> float:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json: {prefix}{key}={value!r} must be a number")
    return float(value)


def _dict(d: dict, key: str) -> dict:
    value = d.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"config.json: {key} must be a JSON object, not {type(value).__name__}")
    return value


def kimi_linear_incompatibilities(cfg: K3Config) -> list[str]:
    """Why ``cfg`` cannot be written as a plain Kimi-Linear config (empty list: it can)."""
    why = []
    if cfg.attn_res.mode != "none":
        why.append(f"attn_res.mode={cfg.attn_res.mode!r} (Kimi-Linear has no AttnRes)")
    if cfg.moe.latent_size is not None:
        why.append("moe.latent_size is set (Kimi-Linear has no latent MoE)")
    if cfg.kda.gate_lower_bound is not None:
        why.append("kda.gate_lower_bound is set (Kimi-Linear uses the softplus gate)")
    if cfg.kda.full_rank_output_gate:
        why.append("kda.full_rank_output_gate=True (Kimi-Linear has a low-rank output gate)")
    if cfg.mla.output_gate:
        why.append("mla.output_gate=True (Kimi-Linear MLA has no output gate)")
    if cfg.mla.rope_theta is not None:
        why.append("mla.rope_theta is set (Kimi-Linear MLA is NoPE)")
    if cfg.hidden_act != "silu":
        why.append(f"hidden_act={cfg.hidden_act!r} (Kimi-Linear uses silu)")
    k = cfg.kda
    if not (k.v_head_dim == k.head_dim == k.forget_gate_rank == k.output_gate_rank):
        why.append("kda.v_head_dim, forget_gate_rank and output_gate_rank must all equal kda.head_dim")
    if cfg.mla.norm_eps != 1e-6:
        why.append("mla.norm_eps must be 1e-6")
    if cfg.moe.shared_intermediate_size not in (None, cfg.moe.moe_intermediate_size):
        why.append("moe.shared_intermediate_size differs from moe_intermediate_size (Kimi-Linear has one width)")
    return why


def model_names(cfg: K3Config) -> tuple[str, str]:
    """(model_type, architecture) a flat config.json of ``cfg`` says: Kimi-Linear's when transformers'
    ``KimiLinearForCausalLM`` runs it as it is (no K3-only feature, no vision tower), else K3's."""
    return KIMI_LINEAR if cfg.vision is None and not kimi_linear_incompatibilities(cfg) else KIMI_K3


def _release_config(cfg: K3Config) -> dict[str, Any]:
    """The ``kimi_k3`` wrapper of a multimodal config (read back by :func:`from_hf_config` to the same config)."""
    if cfg.vision is None:
        raise ValueError(
            "format k3-release is the multimodal release layout and needs a vision tower "
            "(k3.config.presets.with_vision); write a text-only model as k3 or kimi_linear"
        )
    v = cfg.vision
    text = to_hf_config(cfg, "k3")
    text["k3"].pop("vision", None)
    text["model_type"], arch = KIMI_LINEAR  # the release names its text_config so
    text["architectures"] = [arch]
    return {
        "architectures": [KIMI_K3_RELEASE[1]],
        "model_type": KIMI_K3_RELEASE[0],
        "text_config": text,
        "vision_config": {
            "vt_num_hidden_layers": v.num_layers,
            "vt_hidden_size": v.hidden_size,
            "vt_num_attention_heads": v.num_heads,
            "qkv_hidden_size": v.num_heads * v.head_dim,
            "vt_intermediate_size": v.intermediate_size,
            "patch_size": v.patch_size,
            "merge_kernel_size": [v.merge_size, v.merge_size],
            "init_pos_emb_height": v.pos_grid,
            "init_pos_emb_width": v.pos_grid,
            "mm_projector_type": "patchmergerv2",
        },
        "media_placeholder_token_id": v.media_placeholder_token_id,
        "media_begin_token_id": v.media_begin_token_id,
        "media_end_token_id": v.media_end_token_id,
    }


def _mla_keys(mla: MLAConfig) -> dict[str, Any]:
    """The Kimi-Linear MLA keys (one K/V head per query head; NoPE unless ``rope_theta`` is set)."""
    return {
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "mla_use_nope": mla.rope_theta is None,
    }


def _moe_keys(moe: MoEConfig) -> dict[str, Any]:
    """The Kimi-Linear MoE keys: sigmoid router, one expert group (the only routing read back)."""
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_token": moe.num_experts_per_token,
        "num_shared_experts": moe.num_shared_experts,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": moe.renormalize,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
    }


def _kimi_linear_keys(cfg: K3Config) -> dict[str, Any]:
    """The keys both formats share: what transformers' ``KimiLinearForCausalLM`` reads (layers 1-indexed)."""
    kda = cfg.kda
    return {
        "architectures": [KIMI_LINEAR[1]],
        "model_type": KIMI_LINEAR[0],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        **_mla_keys(cfg.mla),
        **_moe_keys(cfg.moe),
        "linear_attn_config": {
            "num_heads": kda.num_heads,
            "head_dim": kda.head_dim,
            "short_conv_kernel_size": kda.conv_kernel_size,
            "kda_layers": [i + 1 for i in cfg.kda_layers],
            "full_attn_layers": [i + 1 for i in sorted(cfg.mla_layers)],
        },
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }


def _add_k3_keys(d: dict[str, Any], cfg: K3Config) -> None:
    """Add to ``d`` the ``k3`` format's keys beyond Kimi-Linear: the release's spellings, then the ``k3``
    sub-dict for what the release does not spell out."""
    kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
    d["head_dim"] = kda.head_dim
    d["linear_attn_config"]["gate_lower_bound"] = kda.gate_lower_bound
    d["linear_attn_config"]["use_full_rank_gate"] = kda.full_rank_output_gate
    d["mla_use_output_gate"] = mla.output_gate
    if mla.rope_theta is not None:
        d["rope_theta"] = mla.rope_theta
    d["routed_expert_hidden_size"] = moe.latent_size
    d["latent_moe_use_norm"] = moe.latent_norm
    d["attn_res_block_size"] = cfg.attn_res.block_size if cfg.attn_res.mode != "none" else None
    if cfg.hidden_act == "situ":
        d["activation_situ_beta"] = cfg.situ_beta
        d["activation_situ_linear_beta"] = cfg.situ_linear_beta
    d["k3"] = {
        "name": cfg.name,
        "attn_res_mode": cfg.attn_res.mode,
        "kda_v_head_dim": kda.v_head_dim,
        "kda_forget_gate_rank": kda.forget_gate_rank,
        "kda_output_gate_rank": kda.output_gate_rank,
        "kda_chunk_size": kda.chunk_size,
        "kda_l2norm_eps": kda.l2norm_eps,
        "mla_norm_eps": mla.norm_eps,
    }
    if moe.shared_intermediate_size is not None:
        d["k3"]["shared_intermediate_size"] = moe.shared_intermediate_size
    if cfg.vision is not None:
        d["k3"]["vision"] = dataclasses.asdict(cfg.vision)


def to_hf_config(cfg: K3Config, fmt: str = "k3") -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg`` in format ``k3``, ``kimi_linear`` or ``k3-release``."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    if fmt == "k3-release":
        return _release_config(cfg)
    if fmt == "kimi_linear":
        why = kimi_linear_incompatibilities(cfg)
        if why:
            raise ValueError("cannot write a kimi_linear config: " + "; ".join(why))
    d = _kimi_linear_keys(cfg)
    if fmt == "k3":
        _add_k3_keys(d, cfg)
        model_type, arch = model_names(cfg)
        d["model_type"], d["architectures"] = model_type, [arch]
    return d


def _mla_layers(d: dict, n: int) -> tuple[int, ...]:
    lac = _dict(d, "linear_attn_config")

    def layers(key: str) -> list[int]:
        value = lac[key]
        if not isinstance(value, list):
            raise ValueError(f"config.json: linear_attn_config.{key} must be a list of layer numbers")
        return [_as_int(i, f"linear_attn_config.{key}[{j}]") - 1 for j, i in enumerate(value)]

    if "full_attn_layers" in lac:
        mla = layers("full_attn_layers")
        if "kda_layers" in lac:
            kda = sorted(layers("kda_layers"))
            if sorted(set(range(n)) - set(mla)) != kda:
                raise ValueError(
                    f"config.json: linear_attn_config.kda_layers and full_attn_layers must partition layers 1..{n}"
                )
        return tuple(sorted(mla))
    if d.get("layer_types"):
        types = d["layer_types"]
        if len(types) != n or not set(types) <= {"full_attention", "linear_attention"}:
            raise ValueError(f"config.json: layer_types must list {n} entries of full_attention / linear_attention")
        return tuple(i for i, t in enumerate(types) if t == "full_attention")
    raise ValueError("config.json must give linear_attn_config.full_attn_layers (1-indexed) or layer_types")


def _first_dense(d: dict, n: int) -> int:
    if d.get("mlp_layer_types"):
        types = d["mlp_layer_types"]
        k = 0
        while k < len(types) and types[k] == "dense":
            k += 1
        if len(types) != n or any(t != "sparse" for t in types[k:]):
            raise ValueError("config.json: mlp_layer_types must be dense layers followed by sparse layers")
        return k
    return _int(d, "first_k_dense_replace", default=1)


def _release_vision(top: dict) -> VisionConfig:
    """The vision tower of a release ``kimi_k3`` config.json: K3's tower (``k3_vision``) with the release's keys
    where present. Shape: ``vision_config``'s ``vt_*`` / ``qkv_hidden_size`` / ``patch_size`` /
    ``merge_kernel_size`` (the K3 release's spellings) and ``init_pos_emb_height`` / ``_width`` (the MoonViT
    family's); media ids: the top-level ``media_placeholder_token_id``
    and, if given, ``media_begin_token_id`` / ``media_end_token_id``. The release is not known to carry begin /
    end ids, so K3's (163602 / 163604) apply unless it does (null: no wrapping)."""
    v = dataclasses.asdict(k3_vision())
    vc = _dict(top, "vision_config")
    for key, field in (
        ("vt_num_hidden_layers", "num_layers"),
        ("vt_hidden_size", "hidden_size"),
        ("vt_num_attention_heads", "num_heads"),
        ("vt_intermediate_size", "intermediate_size"),
        ("patch_size", "patch_size"),
        ("init_pos_emb_height", "pos_grid"),
    ):
        v[field] = _int(vc, key, default=v[field], prefix="vision_config.")
    if vc.get("init_pos_emb_width") not in (None, v["pos_grid"]):
        raise ValueError(
            f"config.json: vision_config.init_pos_emb_width={vc['init_pos_emb_width']} != "
            f"init_pos_emb_height={v['pos_grid']} is not supported (square grid only)"
        )
    if vc.get("qkv_hidden_size") is not None:
        qkv = _int(vc, "qkv_hidden_size", prefix="vision_config.")
        if qkv % v["num_heads"]:
            raise ValueError(
                f"config.json: vision_config.qkv_hidden_size={qkv} is not a multiple of {v['num_heads']} heads"
            )
        v["head_dim"] = qkv // v["num_heads"]
    merge = vc.get("merge_kernel_size")
    if merge is not None:
        name = "vision_config.merge_kernel_size"
        merge = [_as_int(m, name) for m in merge] if isinstance(merge, list) else [_as_int(merge, name)] * 2
        if len(merge) != 2 or merge[0] != merge[1]:
            raise ValueError(f"config.json: vision_config.merge_kernel_size={merge} is not supported (square only)")
        v["merge_size"] = merge[0]
    for key in ("media_placeholder_token_id", "media_begin_token_id", "media_end_token_id"):
        if key != "media_placeholder_token_id" and key in top and top[key] is None:
            v[key] = None  # spelled null: no wrapping
        else:
            v[key] = _int(top, key, default=v[key])
    return VisionConfig(**v)


def _vision(v: Any) -> VisionConfig:
    """The ``k3.vision`` dict: VisionConfig's own fields (an unknown or missing one: one ValueError)."""
    if not isinstance(v, dict):
        raise ValueError("config.json: k3.vision must be a JSON object")
    try:
        return VisionConfig(**v)
    except TypeError as e:
        raise ValueError(f"config.json: k3.vision does not match VisionConfig: {e}") from None


def _unwrap_release(d: Any) -> tuple[dict[str, Any], VisionConfig | None]:
    """The text config of ``d`` and, for the multimodal ``kimi_k3`` wrapper, its vision tower (else None). A
    ``kimi_k3`` config without ``text_config`` is a flat text config (the ``k3`` format of a K3-featured model)."""
    if not isinstance(d, dict):
        raise ValueError(f"config.json must hold a JSON object, not {type(d).__name__}")
    if d.get("model_type") != "kimi_k3":
        return d, None
    if "text_config" not in d:
        if "num_hidden_layers" not in d:
            raise ValueError(
                "config.json: model_type kimi_k3 needs a text_config (the multimodal release) or the text "
                "model's keys at the top level"
            )
        return d, None
    release_vision = _release_vision(d)
    return _dict(d, "text_config"), release_vision


def _check_supported(d: dict) -> None:
    """One ValueError for a config this model cannot express (wrong model type, GQA, sparse MoE placement, MTP,
    grouped routing, tied embeddings, a non-sigmoid router); also that the layer and head counts are given."""
    if d.get("model_type") not in ("kimi_linear", "kimi_k3", None):
        raise ValueError(f"config.json: model_type {d.get('model_type')!r} is not kimi_linear / kimi_k3")
    _int(d, "num_hidden_layers")
    heads = _int(d, "num_attention_heads")
    if d.get("num_key_value_heads") not in (None, heads):
        raise ValueError(
            f"config.json: num_key_value_heads={d['num_key_value_heads']} != num_attention_heads={heads} "
            "(MLA here has one K/V per query head)"
        )
    if _int(d, "moe_layer_freq", default=1) != 1:
        raise ValueError(f"config.json: moe_layer_freq={d['moe_layer_freq']} is not supported (only 1)")
    if _int(d, "num_nextn_predict_layers", default=0) != 0:
        raise ValueError("config.json: MTP layers (num_nextn_predict_layers > 0) are not supported")
    groups, topk_groups = _int(d, "num_expert_group", "n_group", default=1), d.get("topk_group")
    if groups > 1 and topk_groups not in (None, groups):
        raise ValueError(
            f"config.json: grouped routing (num_expert_group={groups}, topk_group={topk_groups}) is not supported"
        )
    if d.get("tie_word_embeddings"):
        raise ValueError("config.json: tie_word_embeddings=true is not supported")
    act = d.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise ValueError(f"config.json: moe_router_activation_func={act!r} is not supported (sigmoid only)")


def _kda_config(d: dict, lac: dict, ext: dict) -> KDAConfig:
    """KDA from ``linear_attn_config`` (or transformers' ``linear_*`` keys) and the ``k3`` sub-dict; head dim,
    gate ranks and value head dim default to one another as in Kimi-Linear."""
    kda_head = _int(lac, "head_dim", default=_int(d, "linear_head_dim", default=128), prefix="linear_attn_config.")
    lb = lac.get("gate_lower_bound")
    return KDAConfig(
        num_heads=_int(lac, "num_heads", default=_int(d, "linear_num_heads", default=32), prefix="linear_attn_config."),
        head_dim=kda_head,
        v_head_dim=_int(ext, "kda_v_head_dim", default=kda_head, prefix="k3."),
        conv_kernel_size=_int(
            lac,
            "short_conv_kernel_size",
            default=_int(d, "linear_conv_kernel_dim", default=4),
            prefix="linear_attn_config.",
        ),
        gate_lower_bound=None if lb is None else _float(lac, "gate_lower_bound", 0.0, "linear_attn_config."),
        full_rank_output_gate=bool(lac.get("use_full_rank_gate", False)),
        forget_gate_rank=_int(ext, "kda_forget_gate_rank", default=kda_head, prefix="k3."),
        output_gate_rank=_int(ext, "kda_output_gate_rank", default=kda_head, prefix="k3."),
        chunk_size=_int(ext, "kda_chunk_size", default=64, prefix="k3."),
        l2norm_eps=_float(ext, "kda_l2norm_eps", 1e-6, "k3."),
    )


def _mla_config(d: dict, ext: dict) -> MLAConfig:
    """MLA from the top-level keys: NoPE unless ``mla_use_nope`` is false (then ``rope_theta``)."""
    use_nope = d.get("mla_use_nope", True)
    return MLAConfig(
        num_heads=_int(d, "num_attention_heads"),
        q_lora_rank=_int(d, "q_lora_rank", default=None),
        kv_lora_rank=_int(d, "kv_lora_rank"),
        qk_nope_head_dim=_int(d, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(d, "qk_rope_head_dim"),
        v_head_dim=_int(d, "v_head_dim"),
        output_gate=bool(d.get("mla_use_output_gate", False)),
        rope_theta=None if use_nope else _float(d, "rope_theta", 10000.0),
        norm_eps=_float(ext, "mla_norm_eps", 1e-6, "k3."),
    )


def _moe_config(d: dict, ext: dict) -> MoEConfig:
    """MoE from the Kimi-Linear keys or their transformers / DeepSeek spellings; latent MoE when
    ``routed_expert_hidden_size`` is set (normed unless ``latent_moe_use_norm`` says otherwise)."""
    latent = _int(d, "routed_expert_hidden_size", default=None)
    return MoEConfig(
        num_experts=_int(d, "num_experts", "num_local_experts", "n_routed_experts"),
        num_experts_per_token=_int(d, "num_experts_per_token", "num_experts_per_tok"),
        num_shared_experts=_int(d, "num_shared_experts", "n_shared_experts", default=0),
        moe_intermediate_size=_int(d, "moe_intermediate_size"),
        shared_intermediate_size=_int(ext, "shared_intermediate_size", default=None, prefix="k3."),
        latent_size=latent,
        latent_norm=bool(d.get("latent_moe_use_norm", latent is not None)),
        routed_scaling_factor=_float(d, "routed_scaling_factor", 1.0),
        renormalize=bool(_first(d, "moe_renormalize", "norm_topk_prob", default=True)),
    )


def _attn_res_config(d: dict, ext: dict) -> AttnResConfig:
    """AttnRes is on when ``attn_res_block_size`` is set and non-zero; its mode (which the release does not
    spell) comes from ``k3.attn_res_mode``, ``snapshot`` by default."""
    block = _int(d, "attn_res_block_size", default=None)
    return AttnResConfig(
        mode=ext.get("attn_res_mode", "snapshot") if block else "none", block_size=block if block else 1
    )


def _token(d: dict, key: str, vocab: int) -> int | None:
    """A special-token id: null / absent is None; otherwise an integer inside the vocabulary (a list, as some
    configs give several eos ids, contributes its first)."""
    v = d.get(key)
    if isinstance(v, list) and v:
        v = v[0]
    if v is None:
        return None
    _as_int(v, key)
    if not 0 <= v < vocab:
        raise ValueError(f"config.json: {key}={v} is outside the vocabulary (vocab_size={vocab})")
    return v


def from_hf_config(d: dict[str, Any]) -> K3Config:
    """Parse a ``config.json`` dict (any format above); unsupported features raise one clear ValueError."""
    d, release_vision = _unwrap_release(d)
    _check_supported(d)
    n = _int(d, "num_hidden_layers")
    lac, ext = _dict(d, "linear_attn_config"), _dict(d, "k3")
    kda, mla, moe = _kda_config(d, lac, ext), _mla_config(d, ext), _moe_config(d, ext)
    attn_res = _attn_res_config(d, ext)
    vocab = _int(d, "vocab_size")
    return K3Config(
        name=str(ext.get("name", "custom")),
        vocab_size=vocab,
        hidden_size=_int(d, "hidden_size"),
        num_hidden_layers=n,
        mla_layers=_mla_layers(d, n),
        first_k_dense_replace=_first_dense(d, n),
        intermediate_size=_int(d, "intermediate_size"),
        hidden_act=str(d.get("hidden_act", "silu")),
        situ_beta=_float(d, "activation_situ_beta", 4.0),
        situ_linear_beta=_float(d, "activation_situ_linear_beta", 25.0),
        rms_norm_eps=_float(d, "rms_norm_eps", 1e-5),
        max_position_embeddings=_int(d, "max_position_embeddings", "model_max_length", default=1048576),
        initializer_range=_float(d, "initializer_range", 0.02),
        bos_token_id=_token(d, "bos_token_id", vocab),
        eos_token_id=_token(d, "eos_token_id", vocab),
        pad_token_id=_token(d, "pad_token_id", vocab),
        kda=kda,
        mla=mla,
        moe=moe,
        attn_res=attn_res,
        vision=_vision(ext["vision"]) if ext.get("vision") else release_vision,
    )
