"""Preset k3-slice: K3's exact widths in 5 layers (dense first layer, 3 KDA + 1 MLA MoE layers), checked on the
meta device (it holds ~124B parameters)."""

import torch

from k3.audit.accounting import report
from k3.config import K3Config, get_preset
from k3.model.decoder import K3ForCausalLM

EXPERT_WEIGHTS_PER_LAYER = 896 * 3 * 3072 * 3584  # ~29.6B


def test_k3_slice_has_k3s_widths_and_a_short_schedule():
    s, k = get_preset("k3-slice"), get_preset("k3")
    s.validate()
    assert K3Config.from_dict(s.to_dict()) == s
    assert (s.num_hidden_layers, s.mla_layers, s.first_k_dense_replace, s.vision) == (5, (4,), 1, None)
    assert [(s.mixer(i), s.ffn(i)) for i in range(5)] == [("kda", "dense")] + [("kda", "moe")] * 3 + [("mla", "moe")]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "hidden_act", "kda", "mla", "moe", "attn_res"):
        assert getattr(s, field) == getattr(k, field), field
    assert (s.hidden_size, s.kda.num_heads, s.kda.head_dim, s.mla.num_heads) == (7168, 96, 128, 96)
    assert (s.mla.q_lora_rank, s.mla.kv_lora_rank) == (1536, 512)
    m = s.moe
    assert (m.num_experts, m.num_experts_per_token, m.latent_size, m.moe_intermediate_size, m.num_shared_experts) == (
        896,
        16,
        3584,
        3072,
        2,
    )
    assert s.attn_res.mode != "none"


def test_k3_slice_accounting():
    cfg = get_preset("k3-slice")
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    experts = [m.experts for m in model.modules() if hasattr(m, "experts")]
    assert len(experts) == 4
    assert all(sum(p.numel() for p in e.parameters()) == EXPERT_WEIGHTS_PER_LAYER for e in experts)
    r = report(cfg, model=model)
    assert r["params_routed_experts"] == 4 * EXPERT_WEIGHTS_PER_LAYER
    assert round(EXPERT_WEIGHTS_PER_LAYER / 1e9, 1) == 29.6
    assert [(la["mixer"], la["ffn"]) for la in r["layers"]][-1] == ("mla", "moe")
