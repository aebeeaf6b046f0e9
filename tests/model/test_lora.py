"""LoRA as weight parametrizations: which maps it adapts, that every path sees it, and merging."""

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.lora import adapters, apply_lora, load_lora_state_dict, lora_state_dict, lora_targets, merge_lora


def _model(perturb, seed=0):
    torch.manual_seed(seed)
    return perturb(K3ForCausalLM(get_preset("tiny"))).eval()


def _randomise(model, std=0.05):
    with torch.no_grad():
        for lora in adapters(model).values():
            lora.lora_B.normal_(0, std)


def test_targets_are_the_attention_maps_and_optionally_the_dense_ffns(perturb):
    model = _model(perturb)
    attn = lora_targets(model)
    assert attn and all(".self_attn." in t for t in attn)
    assert {
        "model.layers.0.self_attn.q_proj",
        "model.layers.3.self_attn.kv_b_proj",
        "model.layers.4.self_attn.o_proj",
    } <= set(attn)
    ffn = set(lora_targets(model, shared_experts=True)) - set(attn)
    assert "model.layers.1.block_sparse_moe.shared_experts.gate_proj" in ffn and "model.layers.0.mlp.down_proj" in ffn
    assert not any("experts.w" in t or ".gate." in t or "routed_expert" in t for t in ffn)


def test_rank_r_adapters_start_at_the_base_and_are_the_only_trainable_parameters(perturb):
    model = _model(perturb)
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        base = model(ids).logits
    apply_lora(model, 3, 6.0, lora_targets(model, shared_experts=True))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base)  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in dict(model.named_parameters()) if n.endswith(("lora_A", "lora_B"))}
    q = model.model.layers[0].self_attn.q_proj
    lora = q.parametrizations.weight[0]
    assert lora.lora_A.shape == (3, q.in_features) and lora.lora_B.shape == (q.out_features, 3)
    assert lora.scale == 2.0
    with pytest.raises(ValueError, match="rank=0"):
        apply_lora(_model(perturb), 0, 1.0, lora_targets(model))
    with pytest.raises(ValueError, match="not linear maps"):
        apply_lora(_model(perturb), 2, 1.0, ["model.layers.1.block_sparse_moe.gate"])


def test_every_path_sees_the_adapters_and_merging_keeps_the_outputs(perturb):
    """Adapted weights are read directly by KDA's fused q/k/v GEMM, MLA's absorbed decode and the shared experts'
    fused inputs: the adapted model's prefill and cached decode equal the merged model's (fp32 tolerance)."""
    model = _model(perturb)
    apply_lora(model, 4, 4.0, lora_targets(model, shared_experts=True))
    _randomise(model)
    ids = torch.randint(0, 512, (2, 17))
    merged = _model(perturb)
    apply_lora(merged, 4, 4.0, lora_targets(merged, shared_experts=True))
    load_lora_state_dict(merged, lora_state_dict(model))
    merge_lora(merged)
    assert not adapters(merged) and "model.layers.0.self_attn.q_proj.weight" in merged.state_dict()
    with torch.no_grad():
        a, b = model(ids).logits, merged(ids).logits
        assert torch.allclose(a, b, rtol=0, atol=1e-5 * a.abs().max())
        assert not torch.allclose(a, _model(perturb)(ids).logits, atol=1e-3)  # the adapters do change the model
        steps = []
        for m in (model, merged):
            cache = m.new_cache(2)
            m(ids, cache=cache)
            steps.append(m.decode(torch.tensor([7, 9]), cache, [0, 1]))
        assert torch.allclose(steps[0], steps[1], rtol=0, atol=1e-5 * steps[0].abs().max())


def test_loading_adapters_checks_names_and_shapes(perturb):
    model = _model(perturb)
    apply_lora(model, 2, 2.0, lora_targets(model))
    saved = {k: v.clone() for k, v in lora_state_dict(model).items()}
    other = _model(perturb, seed=1)
    apply_lora(other, 2, 2.0, lora_targets(other))
    load_lora_state_dict(other, saved)
    assert all(torch.equal(v, saved[k]) for k, v in lora_state_dict(other).items())
    key = next(iter(saved))
    with pytest.raises(ValueError, match="missing"):
        load_lora_state_dict(other, {k: v for k, v in saved.items() if k != key})
    with pytest.raises(ValueError, match="shapes"):
        load_lora_state_dict(other, {**saved, key: torch.zeros(1, 1)})
