"""Norms under autocast: they return autocast's dtype (the cast every consumer matmul would make, once), with the
values of the fp32 norm rounded once; without autocast nothing changes."""

import dataclasses

import pytest
import torch

from k3.config import get_preset
from k3.config.presets import with_vision
from k3.model import norm as norm_mod
from k3.model.decoder import K3ForCausalLM
from k3.model.multimodal import K3ForConditionalGeneration
from k3.model.norm import GatedRMSNorm, RMSNorm, gated_rms_norm, rms_norm


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


def perturbed(model):
    with torch.no_grad():
        for p in model.parameters():  # AttnRes queries start at zero: make every mix and gate non-trivial
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.mark.parametrize("mode,latent", [("snapshot", True), ("full", True), ("none", False), ("block_sum", False)])
def test_model_under_autocast_matches_per_consumer_casts(mode, latent, monkeypatch):
    """The tiny model's forward under autocast with the norms casting (the default) against the norms returning
    fp32 and every matmul casting its input itself (matmul_dtype patched to None). The same inputs reach every
    projection: bf16 ones, and the fp32 normed input at a MoE's router (fp32 under autocast), since a MoE's pre-norm
    does not cast (a plain MoE's routed sum also comes back in its input's dtype), so the logits are identical. The
    gradients differ by where the consumers' input gradients are summed (bf16 now, fp32 before): measured 0.9%,
    a few bf16 roundings (2^-9 each) of sums that propagate to every parameter."""
    cfg = get_preset("tiny")
    cfg.attn_res.mode = mode
    if not latent:
        cfg.moe.latent_size, cfg.moe.latent_norm = None, False
    torch.manual_seed(0)
    model = perturbed(K3ForCausalLM(cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 32))

    def run():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits.float()
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    logits, grads = run()
    monkeypatch.setattr(norm_mod, "matmul_dtype", lambda x: None)
    logits_ref, grads_ref = run()
    assert torch.equal(logits, logits_ref)
    total = sum(g.double().pow(2).sum() for g in grads_ref).sqrt()
    diff = sum((a.double() - b.double()).pow(2).sum() for a, b in zip(grads, grads_ref)).sqrt()
    assert diff / total <= 3e-2, (diff / total).item()


def test_image_features_keep_their_dtype_under_autocast(monkeypatch):
    """The vision projector's norm feeds the text embeddings, not a matmul: it does not cast, and the image
    features and logits under autocast are those of the per-consumer casts."""
    cfg = with_vision(get_preset("tiny"))
    v = dataclasses.replace(
        cfg.vision, media_placeholder_token_id=500, media_begin_token_id=501, media_end_token_id=502
    )
    cfg = dataclasses.replace(cfg, vision=v)
    torch.manual_seed(0)
    model = perturbed(K3ForConditionalGeneration(cfg))
    grids, patches = [(4, 4)], torch.randn(16, 3 * v.patch_size**2)
    ids = torch.randint(0, 300, (1, 12))
    ids[0, 2:6] = v.media_placeholder_token_id

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return (
                model.encode_images(patches, grids),
                model(ids, pixel_patches=patches, grid_hws=grids).logits.float(),
            )

    features, logits = run()
    monkeypatch.setattr(norm_mod, "matmul_dtype", lambda x: None)
    features_ref, logits_ref = run()
    assert features.dtype == features_ref.dtype and torch.equal(features, features_ref)
    assert torch.equal(logits, logits_ref)
