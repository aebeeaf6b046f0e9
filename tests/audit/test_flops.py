"""One FLOP count: k3 info, the audit's table by path and the benchmarks' MFU print the same number
(k3.audit.accounting.flops_per_token); the decode form's MLA term equals what torch's FLOP counter sees in an
absorbed decode step."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from k3.audit.accounting import flops_per_token, report
from k3.model.accounting import attention_flops_per_token
from k3.audit.paths import by_path
from k3.config import get_preset
from k3.model.cache import K3Cache
from k3.model.decoder import K3ForCausalLM


@pytest.mark.parametrize("preset", ["tiny", "small-1b", "k3"])
def test_info_audit_and_benchmarks_count_the_same_flops(preset, capsys):
    from k3.bench.model import train_flops_per_token
    from k3.cli.main import main

    config = get_preset(preset)
    r = report(config, context=4096)
    assert main(["info", "--preset", preset, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["flops_per_token_forward"] == r["flops_per_token_forward"] == flops_per_token(config)["total"]
    assert by_path(config, r, 4096)["total"]["flops"] == pytest.approx(r["flops_per_token_forward"], rel=1e-12)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    assert train_flops_per_token(model, 4096)["total"] == pytest.approx(3 * r["flops_per_token_forward"], rel=1e-12)
    decode = flops_per_token(config, 4096, "decode")
    assert decode["matmul"] == r["flops_per_token_breakdown"]["matmul"]
    assert r["flops_per_token_decode"] == decode["total"]


def test_decode_form_mla_attention_is_what_an_absorbed_step_computes():
    """One absorbed MLA decode step (tiny preset, 2 sequences at ``ctx`` cached rows, the cache exactly that
    long): FLOPs counted by torch = 2 per weight of the layer's matmuls + the decode form's attention term."""
    config = get_preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    i = config.mla_layers[0]
    mla = model.model.layers[i].self_attn
    ctx = 96
    cache = K3Cache(config, 2, capacity=ctx)
    cache.layers[i].kv.normal_()
    x = torch.randn(2, config.hidden_size)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        mla.step(x, cache.layers[i], torch.tensor([0, 1]), torch.tensor([ctx - 1, ctx - 1]))
    per_token = counter.get_total_flops() / 2
    weights = sum(p.numel() for p in mla.parameters() if p.dim() == 2)
    attention = attention_flops_per_token(config, ctx, "decode")["mla_attention"] / len(config.mla_layers)
    assert per_token == 2 * weights + attention
    forward = attention_flops_per_token(config, ctx)["mla_attention"] / len(config.mla_layers)
    assert attention > forward  # the latent is wider than a head: decode does more work per key
    with pytest.raises(ValueError, match="form"):
        attention_flops_per_token(config, ctx, "prefill")
