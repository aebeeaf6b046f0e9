"""QAT of the routed experts: straight-through gradients, the on/off switch, what is (not) quantised,
and a short QAT training run through the Trainer."""

import json
import logging
from pathlib import Path

import pytest
import torch

import k3
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.moe import MoE
from k3.ops.moe import moe_experts
from k3.quant import disable_qat, enable_qat, fake_quantize, fake_quantize_ste, qat_settings
from k3.train.trainer import TrainConfig, Trainer


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = K3ForCausalLM(get_preset("tiny").replace(**overrides))
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                t.normal_(0, 0.1)
    return model


def ids(seed=1):
    return torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(seed))


def test_ste_backward_is_identity_even_where_clamped():
    x = torch.tensor([[7.5, -7.9, 1.1, 0.2] * 8], requires_grad=True)  # FLOOR: 7.5 and -7.9 saturate to +-6
    y = fake_quantize_ste(x, "e2m1")
    assert torch.equal(y, fake_quantize(x.detach(), "e2m1")) and y[0, 0] == 6.0
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_act_quant_is_applied_to_both_expert_matmul_inputs():
    torch.manual_seed(0)
    n, d, i, e = 10, 32, 64, 4
    x = torch.randn(n, d)
    idx = torch.stack([torch.randperm(e)[:2] for _ in range(n)])
    w = torch.rand(n, 2)
    w1, w3, w2 = torch.randn(e, i, d), torch.randn(e, i, d), torch.randn(e, d, i)
    glu = lambda a, b: torch.nn.functional.silu(a) * b  # noqa: E731
    seen = []

    def spy(t):
        seen.append(tuple(t.shape))
        return t

    assert torch.equal(moe_experts(x, idx, w, w1, w2, w3, glu, act_quant=spy), moe_experts(x, idx, w, w1, w2, w3, glu))
    assert seen[0] == (n, d) and all(s[1] == i for s in seen[1:]) and sum(s[0] for s in seen[1:]) == 2 * n
    q = lambda t: fake_quantize(t, "e4m3")  # noqa: E731
    out = moe_experts(x, idx, w, w1, w2, w3, glu, act_quant=q)
    assert not torch.equal(out, moe_experts(x, idx, w, w1, w2, w3, glu))


def test_switch_on_off_and_only_moe_layers():
    model = tiny_model()
    before = model(ids()).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    qat = enable_qat(model)
    assert qat_settings(model) == qat and (qat.weights, qat.activations, qat.mode) == ("mxfp4", "mxfp8_e4m3", "floor")
    assert all(m.qat is qat for m in model.modules() if isinstance(m, MoE))
    assert sum(isinstance(m, MoE) for m in model.modules()) == 4
    assert not any(hasattr(m, "qat") for m in model.modules() if not isinstance(m, MoE))
    on = model(ids()).logits
    assert not torch.equal(on, before) and (on - before).abs().max() < 0.1 * before.abs().max()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # masters untouched
    disable_qat(model)
    assert qat_settings(model) is None
    assert torch.equal(model(ids()).logits, before)  # bit for bit


def test_weights_and_activations_are_fake_quantised(monkeypatch):
    """The layer's expert op sees fake_quantize(w) for w1/w2/w3 and an act_quant that is fake_quantize(., e4m3)."""
    model = tiny_model()
    enable_qat(model, mode="rceil")
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    calls = []

    def spy(x, topk_idx, topk_weight, w1, w2, w3, glu, act_quant=None):
        calls.append((w1, w2, w3, act_quant))
        return torch.zeros_like(x)

    monkeypatch.setattr("k3.model.moe.moe_experts", spy)
    moe(torch.randn(5, 64))
    w1, w2, w3, act = calls[0]
    for got, master in ((w1, moe.experts.w1), (w2, moe.experts.w2), (w3, moe.experts.w3)):
        assert torch.equal(got, fake_quantize(master.detach(), "e2m1", mode="rceil"))
    z = torch.randn(7, 32)
    assert torch.equal(act(z), fake_quantize(z, "e4m3", mode="rceil"))
    enable_qat(model, activations=None)
    moe(torch.randn(5, 64))
    assert calls[-1][3] is None


def test_master_gradient_equals_gradient_of_the_fake_quantised_weights():
    model = tiny_model()
    enable_qat(model)
    model(ids()).logits.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    # reference: put the fake-quantised weights in as plain tensors, keep only the activation quantisation
    ref = tiny_model()
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, MoE):
                for w in ("w1", "w2", "w3"):
                    p = getattr(m.experts, w)
                    p.copy_(fake_quantize(p, "e2m1"))
    enable_qat(ref, weights=None)
    ref(ids()).logits.pow(2).mean().backward()
    for n, p in ref.named_parameters():
        assert torch.equal(grads[n], p.grad), n
    assert any(".experts.w2" in n and grads[n].abs().sum() > 0 for n in grads)


def test_errors():
    model = tiny_model(**{"moe.latent_size": 48})
    with pytest.raises(ValueError, match="expert input width D=48"):
        enable_qat(model)
    assert qat_settings(model) is None  # nothing half-enabled
    with pytest.raises(ValueError, match="weights="):
        enable_qat(tiny_model(), weights="int4")
    with pytest.raises(ValueError, match="quantises nothing"):
        enable_qat(tiny_model(), weights=None, activations=None)
    with pytest.raises(ValueError, match="mode="):
        enable_qat(tiny_model(), mode="even")
    with pytest.raises(ValueError, match="--qat="):
        TrainConfig(qat="fp8").validate()


def test_train_cli_flags(tmp_path):
    from k3.cli.main import build_parser
    from k3.cli.train import config_from_args

    args = build_parser().parse_args(
        [
            "train",
            "--preset",
            "tiny",
            "--qat",
            "mxfp4-weights",
            "--qat-scale-mode",
            "rceil",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.qat, cfg.qat_scale_mode) == ("mxfp4-weights", "rceil")
    assert config_from_args(build_parser().parse_args(["train", "--out", str(tmp_path / "r")])).qat is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--qat", "int4"])


def test_qat_training_run(tmp_path, caplog):
    cfg = TrainConfig(
        preset="tiny",
        steps=10,
        batch_size=2,
        seq_len=48,
        vocab_size=400,
        lr=1e-2,
        tokenizer_train_bytes=200_000,
        max_tokens=30_000,
        eval_every=10,
        eval_rows=4,
        samples=0,
        out=str(tmp_path / "run"),
        seed=0,
        qat="mxfp4",
    )
    with caplog.at_level(logging.INFO, logger="k3.train"):
        trainer = Trainer(cfg, progress=False)
    assert "checkpoints hold the high-precision masters" in caplog.text
    assert qat_settings(trainer.model).activations == "mxfp8_e4m3"
    result = trainer.run()
    losses = [h["loss"] for h in result["history"]]
    assert len(losses) == 10 and all(isinstance(x, float) and x == x for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1
    # the checkpoint holds high-precision masters (off the MXFP4 grid) and no quantization_config
    saved = k3.from_pretrained(result["checkpoint"])
    w = saved.model.layers[1].block_sparse_moe.experts.w1.detach()
    assert not torch.equal(w, fake_quantize(w, "e2m1"))
    assert "quantization_config" not in json.loads((Path(result["checkpoint"]) / "config.json").read_text())
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["qat"] == "mxfp4"
