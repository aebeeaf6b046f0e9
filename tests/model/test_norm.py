"""Norms under autocast: they return autocast's dtype (the cast every consumer matmul would make, once), with the
values of the fp32 norm rounded once; without autocast nothing changes."""

import pytest
import torch

from k3.config import get_preset
from k3.model import norm as norm_mod
from k3.model.decoder import K3ForCausalLM
from k3.model.norm import GatedRMSNorm, RMSNorm, gated_rms_norm, rms_norm


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_norms_return_autocast_dtype_with_the_fp32_values():
    torch.manual_seed(0)
    x, gate = torch.randn(2, 64, 48), torch.randn(2, 64, 48)
    n, g = RMSNorm(48), GatedRMSNorm(48)
    with torch.no_grad():
        n.weight.uniform_(0.5, 1.5)
        g.weight.uniform_(0.5, 1.5)
    plain = n(x), g(x, gate)
    assert all(t.dtype == torch.float32 for t in plain)
    assert torch.equal(plain[0], rms_norm.reference(x, n.weight, n.eps))
    assert torch.equal(plain[1], gated_rms_norm.reference(x, gate, g.weight, g.eps))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = n(x), g(x, gate)
        assert n(x.double()).dtype == torch.float64  # fp64 is never autocast
    for a, b in zip(cast, plain):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))


@pytest.mark.parametrize("mode", ["snapshot", "full"])
def test_model_under_autocast_matches_per_consumer_casts(mode, monkeypatch):
    """The tiny model's forward under autocast with the norms casting (the default) against the norms returning
    fp32 and every matmul casting its input itself (matmul_dtype patched to None). The same bf16 inputs reach
    every projection (the router's linear too: autocast casts it), so the logits are identical; the gradients
    differ by where the consumers' input gradients are summed (bf16 now, fp32 before): measured 0.9%, a few
    bf16 roundings (2^-9 each) of sums that propagate to every parameter."""
    cfg = get_preset("tiny")
    cfg.attn_res.mode = mode
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # AttnRes queries start at zero: make every mix and gate non-trivial
            p.add_(torch.randn_like(p) * 0.02)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))

    def run():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits.float()
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    logits, grads = run()
    monkeypatch.setattr(norm_mod, "matmul_dtype", lambda x: None)
    import k3.model.attn_res as attn_res_mod

    monkeypatch.setattr(attn_res_mod, "matmul_dtype", lambda x: None)
    logits_ref, grads_ref = run()
    assert torch.equal(logits, logits_ref)
    total = sum(g.double().pow(2).sum() for g in grads_ref).sqrt()
    diff = sum((a.double() - b.double()).pow(2).sum() for a, b in zip(grads, grads_ref)).sqrt()
    assert diff / total <= 3e-2, (diff / total).item()
