"""Config validation (one-line ValueErrors naming the field), presets, serialisation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.config import PRESETS, K3Config, get_preset

non_positive = st.integers(max_value=0)
BAD_FIELDS = {
    "vocab_size": non_positive,
    "hidden_size": non_positive,
    "num_hidden_layers": non_positive,
    "intermediate_size": non_positive,
    "hidden_act": st.sampled_from(["gelu", "relu", "", "SiTU"]),
    "rms_norm_eps": st.floats(max_value=0.0, allow_nan=False) | st.just(float("nan")),
    "situ_beta": st.floats(max_value=0.0, allow_nan=False),
    "tie_word_embeddings": st.just(True),
    "first_k_dense_replace": st.integers(min_value=6) | st.integers(max_value=-1),
    "mla_layers": st.lists(st.integers(min_value=5, max_value=10**6), min_size=1, max_size=3).map(tuple)
    | st.integers(min_value=0, max_value=4).map(lambda i: (i, i)),
    "bos_token_id": st.integers(min_value=512) | st.integers(max_value=-1),
    "kda.num_heads": non_positive,
    "kda.head_dim": non_positive,
    "kda.conv_kernel_size": non_positive,
    "kda.gate_lower_bound": st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
    "kda.chunk_size": st.sampled_from([24, 40, 100]) | non_positive,
    "mla.num_heads": non_positive,
    "mla.q_lora_rank": non_positive,
    "mla.kv_lora_rank": non_positive,
    "mla.qk_rope_head_dim": st.integers(max_value=-1),
    "mla.rope_theta": st.floats(max_value=0.0, allow_nan=False),
    "moe.num_experts": non_positive,
    "moe.num_experts_per_token": st.integers(min_value=9, max_value=10**4) | non_positive,
    "moe.num_shared_experts": st.integers(max_value=-1),
    "moe.latent_size": st.integers(min_value=65, max_value=10**6) | non_positive,
    "moe.shared_intermediate_size": non_positive,
    "moe.routed_scaling_factor": st.floats(max_value=0.0, allow_nan=False),
    "attn_res.mode": st.text(max_size=8).filter(lambda s: s not in ("snapshot", "block_sum", "full", "none")),
    "attn_res.block_size": non_positive,
}


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_bad_field_raises_one_line_naming_it(data):
    field = data.draw(st.sampled_from(sorted(BAD_FIELDS)))
    value = data.draw(BAD_FIELDS[field])
    with pytest.raises(ValueError) as err:
        get_preset("tiny").replace(**{field: value})
    msg = str(err.value)
    assert "\n" not in msg
    leaf = field.split(".")[-1]
    assert leaf in msg, f"{field}={value!r} gave {msg!r}"


def test_vision_fields_are_validated():
    with pytest.raises(ValueError, match=r"vision\.num_heads=0"):
        get_preset("k3").replace(**{"vision.num_heads": 0})
    with pytest.raises(ValueError, match=r"vision\.head_dim=6"):
        get_preset("k3").replace(**{"vision.head_dim": 6})


def test_unknown_fields_and_presets():
    with pytest.raises(ValueError, match="unknown config field"):
        get_preset("tiny").replace(**{"kda.heads": 4})
    with pytest.raises(ValueError, match="unknown K3Config field"):
        K3Config.from_dict({"hidden": 4})
    with pytest.raises(ValueError, match="unknown preset 'k4'"):
        get_preset("k4")


@pytest.mark.parametrize("name", list(PRESETS))
def test_round_trip(name):
    cfg = get_preset(name)
    assert K3Config.from_dict(cfg.to_dict()) == cfg


def test_shared_expert_width_of_its_own():
    """moe.shared_intermediate_size sets the shared experts' width apart from the routed ones'; the k3 config.json
    carries it, a kimi_linear one cannot and says so."""
    import torch

    from k3.config.hf import from_hf_config, to_hf_config
    from k3.model.moe import MoE

    cfg = get_preset("tiny").replace(**{"moe.shared_intermediate_size": 48})
    assert cfg.moe.shared_width == 48 * cfg.moe.num_shared_experts
    assert get_preset("tiny").moe.shared_width == 32 * get_preset("tiny").moe.num_shared_experts
    with torch.device("meta"):
        moe = MoE(cfg, 1)
    assert moe.shared_experts.gate_proj.weight.shape == (48, cfg.hidden_size)
    assert moe.experts.w1.shape[1] == cfg.moe.moe_intermediate_size
    assert from_hf_config(to_hf_config(cfg, "k3")) == cfg
    plain = cfg.replace(**{"attn_res.mode": "none", "moe.latent_size": None, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="shared_intermediate_size"):
        to_hf_config(plain, "kimi_linear")


def test_k3_preset_is_the_released_config():
    c = get_preset("k3")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (163840, 7168, 93, 33792)
    assert c.mla_layers == tuple(range(3, 92, 4)) + (92,) and len(c.kda_layers) == 69
    assert [i + 1 for i in c.mla_layers][-3:] == [88, 92, 93]  # 1-indexed 4, 8, ..., 92, 93
    assert c.first_k_dense_replace == 1 and c.hidden_act == "situ"
    assert (c.situ_beta, c.situ_linear_beta, c.rms_norm_eps) == (4.0, 25.0, 1e-5)
    assert (c.kda.num_heads, c.kda.head_dim, c.kda.v_head_dim, c.kda.conv_kernel_size) == (96, 128, 128, 4)
    assert c.kda.gate_lower_bound == -5.0 and c.kda.full_rank_output_gate
    m = c.mla
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        96,
        1536,
        512,
        128,
        64,
        128,
    )
    assert m.output_gate and m.rope_theta is None
    e = c.moe
    assert (e.num_experts, e.num_experts_per_token, e.num_shared_experts, e.moe_intermediate_size, e.latent_size) == (
        896,
        16,
        2,
        3072,
        3584,
    )
    assert e.latent_norm and e.routed_scaling_factor == 1.0 and e.renormalize
    assert (c.attn_res.mode, c.attn_res.block_size) == ("snapshot", 12)
    assert c.max_position_embeddings == 1048576 and not c.tie_word_embeddings
    assert c.vision is not None and c.vision.num_layers == 27


def test_schedule_helpers():
    c = get_preset("tiny")
    assert [c.mixer(i) for i in range(5)] == ["kda", "kda", "kda", "mla", "mla"]
    assert [c.ffn(i) for i in range(5)] == ["dense", "moe", "moe", "moe", "moe"]
    assert [c.attn_res_block(i) for i in range(5)] == [0, 0, 1, 1, 2]


def test_release_kimi_k3_config_gives_k3_tower_and_media_ids():
    """A release-style kimi_k3 config.json (no ``k3`` extension keys) reads as K3's tower with its media ids;
    ids the release spells win, and a plain Kimi-Linear config stays text-only."""
    from k3.config.hf import from_hf_config, to_hf_config

    text = to_hf_config(get_preset("k3"))
    del text["k3"]
    vision_config = {
        "vt_num_hidden_layers": 27,
        "vt_hidden_size": 1024,
        "vt_num_attention_heads": 12,
        "qkv_hidden_size": 1536,
        "vt_intermediate_size": 4096,
        "patch_size": 14,
        "merge_kernel_size": [2, 2],
    }
    release = {
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": vision_config,
        "media_placeholder_token_id": 163605,
    }
    assert from_hf_config(release).vision == get_preset("k3").vision
    v = from_hf_config({**release, "media_begin_token_id": 5, "media_end_token_id": 6}).vision
    assert (v.media_begin_token_id, v.media_end_token_id) == (5, 6)
    assert (
        from_hf_config({**release, "vision_config": {**vision_config, "vt_num_hidden_layers": 3}}).vision.num_layers
        == 3
    )
    assert from_hf_config(text).vision is None


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("hidden_size", None, "hidden_size is missing or null"),
        ("vocab_size", "DELETE", "vocab_size is missing or null"),
        ("num_attention_heads", None, "num_attention_heads is missing or null"),
        ("hidden_size", 64.9, "hidden_size=64.9 must be an integer"),
        ("num_hidden_layers", 5.0, "num_hidden_layers=5.0 must be an integer"),
        ("kv_lora_rank", True, "kv_lora_rank=True must be an integer"),
        ("moe_intermediate_size", "32", "moe_intermediate_size='32' must be an integer"),
        ("eos_token_id", 10**6, "eos_token_id=1000000 is outside the vocabulary"),
        ("bos_token_id", -1, "bos_token_id=-1 is outside the vocabulary"),
        ("eos_token_id", 2.5, "eos_token_id=2.5 must be an integer"),
        ("rms_norm_eps", "tiny", "rms_norm_eps='tiny' must be a number"),
    ],
)
def test_config_json_values_are_checked(key, value, match):
    """config.json: a missing / null required key, a non-integer where an integer belongs and an out-of-range
    token id each give one ValueError naming the key (before: KeyError / TypeError, truncation, silent drop)."""
    from k3.config.hf import from_hf_config, to_hf_config

    d = to_hf_config(get_preset("tiny"))
    if value == "DELETE":
        del d[key]
    else:
        d[key] = value
    with pytest.raises(ValueError, match=match) as err:
        from_hf_config(d)
    assert "\n" not in str(err.value)


def test_config_json_nested_values_are_checked():
    from k3.config.hf import from_hf_config, to_hf_config

    d = to_hf_config(get_preset("tiny"))
    d["linear_attn_config"]["num_heads"] = 2.5
    with pytest.raises(ValueError, match=r"linear_attn_config\.num_heads=2\.5 must be an integer"):
        from_hf_config(d)
    d = to_hf_config(get_preset("tiny"))
    d["linear_attn_config"]["full_attn_layers"] = [4, None]
    with pytest.raises(ValueError, match="full_attn_layers"):
        from_hf_config(d)
    with pytest.raises(ValueError, match="config.json must hold a JSON object"):
        from_hf_config([1, 2])


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("model_type", "llama", "model_type 'llama' is not kimi_linear / kimi_k3"),
        ("num_key_value_heads", 1, "num_key_value_heads=1 != num_attention_heads="),
        ("moe_layer_freq", 2, "moe_layer_freq=2 is not supported"),
        ("num_nextn_predict_layers", 1, "MTP layers"),
        ("num_expert_group", 4, r"grouped routing \(num_expert_group=4, topk_group=1\)"),
        ("tie_word_embeddings", True, "tie_word_embeddings=true is not supported"),
        ("moe_router_activation_func", "softmax", "moe_router_activation_func='softmax' is not supported"),
    ],
)
def test_config_json_unsupported_features_are_refused(key, value, match):
    from k3.config.hf import from_hf_config, to_hf_config

    d = to_hf_config(get_preset("tiny"))
    d[key] = value
    with pytest.raises(ValueError, match=match):
        from_hf_config(d)


def test_config_json_transformers_spellings_read_the_same():
    """transformers' native KimiLinear spellings give the same config as the Kimi-Linear keys."""
    from k3.config.hf import from_hf_config, to_hf_config

    c = get_preset("kimi-linear-48b")
    d = to_hf_config(c, "kimi_linear")
    lac = d.pop("linear_attn_config")
    n = d["num_hidden_layers"]
    d.update(
        layer_types=["full_attention" if i + 1 in lac["full_attn_layers"] else "linear_attention" for i in range(n)],
        mlp_layer_types=["dense"] * d.pop("first_k_dense_replace") + ["sparse"] * (n - c.first_k_dense_replace),
        linear_num_heads=lac["num_heads"],
        linear_head_dim=lac["head_dim"],
        linear_conv_kernel_dim=lac["short_conv_kernel_size"],
        num_local_experts=d.pop("num_experts"),
        num_experts_per_tok=d.pop("num_experts_per_token"),
        n_shared_experts=d.pop("num_shared_experts"),
        norm_topk_prob=d.pop("moe_renormalize"),
        model_max_length=d.pop("max_position_embeddings"),
    )
    assert from_hf_config(d) == from_hf_config(to_hf_config(c, "kimi_linear"))


@pytest.mark.parametrize("name", list(PRESETS))
def test_config_json_names_what_it_is(name):
    """A config transformers' KimiLinear runs says kimi_linear; one with K3's features (or a vision tower) says
    kimi_k3 / KimiK3ForCausalLM (before: kimi_linear, which transformers then failed on with KeyError 'situ').
    Either reads back to the same config."""
    from k3.config.hf import from_hf_config, kimi_linear_incompatibilities, to_hf_config

    cfg = get_preset(name)
    d = to_hf_config(cfg, "k3")
    pure = cfg.vision is None and not kimi_linear_incompatibilities(cfg)
    want = ("kimi_linear", ["KimiLinearForCausalLM"]) if pure else ("kimi_k3", ["KimiK3ForCausalLM"])
    assert (d["model_type"], d["architectures"]) == want
    assert from_hf_config(d) == cfg


def test_which_presets_are_kimi_linear():
    from k3.config.hf import to_hf_config
    from k3.config.presets import tiny_vision, with_vision

    names = {n: to_hf_config(get_preset(n))["model_type"] for n in ("tiny", "k3", "kimi-linear-48b", "k2")}
    assert names == {"tiny": "kimi_k3", "k3": "kimi_k3", "kimi-linear-48b": "kimi_linear", "k2": "kimi_k3"}
    plain_with_tower = with_vision(get_preset("kimi-linear-48b"), tiny_vision())
    assert to_hf_config(plain_with_tower)["architectures"] == ["KimiK3ForCausalLM"]
    release = to_hf_config(with_vision(get_preset("tiny")), "k3-release")
    assert (release["model_type"], release["architectures"]) == ("kimi_k3", ["KimiK3ForConditionalGeneration"])
    assert (release["text_config"]["model_type"], release["text_config"]["architectures"]) == (
        "kimi_linear",
        ["KimiLinearForCausalLM"],
    )  # as the K3 release names its text_config


def test_config_json_written_before_still_reads():
    """config.json as earlier versions wrote it: K3's keys under model_type kimi_linear."""
    import json
    from pathlib import Path

    from k3.config.hf import from_hf_config

    old = json.loads((Path(__file__).parent / "data" / "tiny_config_kimi_linear_named.json").read_text())
    assert old["model_type"] == "kimi_linear" and old["hidden_act"] == "situ"
    assert from_hf_config(old) == get_preset("tiny")


def test_kimi_k3_without_text_or_layers_is_refused():
    from k3.config.hf import from_hf_config

    with pytest.raises(ValueError, match="model_type kimi_k3 needs a text_config .* or the text model's keys"):
        from_hf_config({"model_type": "kimi_k3", "vocab_size": 512})
