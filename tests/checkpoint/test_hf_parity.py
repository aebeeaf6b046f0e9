"""Parity with a model nobody here wrote: transformers' native KimiLinearForCausalLM."""

import pytest
import torch

import k3

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from k3.infer.generate import greedy_generate  # noqa: E402


def hf_model(seed=0):
    cfg = KimiLinearConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.446,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.05,
        rms_norm_eps=1e-5,
        linear_attn_config={
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4, 5],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    )
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # non-zero router bias, so selection differs from the raw scores
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref = hf_model()
    path = tmp_path_factory.mktemp("hf_kimi_linear")
    ref.save_pretrained(path)
    ours = k3.from_pretrained(path).eval()
    return ref, ours, path


def test_config_is_read_as_kimi_linear(pair):
    _, ours, _ = pair
    c = ours.config
    assert c.mla_layers == (3, 4) and c.first_k_dense_replace == 1 and c.hidden_act == "silu"
    assert c.kda.gate_lower_bound is None and not c.kda.full_rank_output_gate and c.mla.q_lora_rank is None
    assert c.moe.latent_size is None and c.moe.routed_scaling_factor == 2.446 and c.attn_res.mode == "none"


def test_logits_match_transformers(pair):
    ref, ours, _ = pair
    torch.manual_seed(1)
    ids = torch.randint(3, 300, (3, 80))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids).logits
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"max abs logit difference {err:.2e}"
    assert want.abs().max() > 0.1  # a non-trivial model


def test_greedy_generation_matches_transformers(pair):
    ref, ours, _ = pair
    torch.manual_seed(2)
    prompt = torch.randint(3, 300, (2, 12))
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16, pad_token_id=0)
    got = greedy_generate(ours, prompt, 16)
    # compare up to the first step whose top-2 logits are within 1e-4 (a tie either side may break)
    with torch.no_grad():
        logits = ours(want[:, :-1]).logits[:, 11:]
    top2 = logits.topk(2, dim=-1).values
    near_tie = (top2[..., 0] - top2[..., 1]) < 1e-4
    for row in range(2):
        ties = near_tie[row].nonzero()
        stop = int(ties[0]) if len(ties) else 16
        assert torch.equal(got[row, 12 : 12 + stop], want[row, 12 : 12 + stop]), (row, stop)
    assert not near_tie.any(), "random model produced a near tie; the comparison above was partial"
