"""FP8 expert matmuls (k3.ops.fp8, k3.quant.fp8): the row-wise e4m3 rule against torchao's scale and cast, the
emulated expert path against the high-precision one, and the switches that refuse what does not combine."""

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.moe import moe_layers
from k3.ops.fp8 import E4M3, E4M3_MAX, fp8_rowwise, fp8_rowwise_ste, rowwise_scale
from k3.ops.moe.reference import moe_experts
from k3.quant.fp8 import disable_fp8_experts, enable_fp8_experts
from k3.quant.qat import enable_qat
from k3.train.config import TrainConfig


def _rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)  # rows over six decades
    x[5] = 0.0  # an all-zero row
    x[7, 3] = 1e4  # a row with one outlier
    return x


def test_scale_and_cast_match_torchao():
    """Scales: torchao's amax_to_scale with power-of-two rounding, row by row; values: its saturated e4m3 cast."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    x = _rows()
    s = rowwise_scale(x)
    ref = amax_to_scale(x.abs().amax(-1, keepdim=True), E4M3, round_scales_to_power_of_2=True)
    assert torch.equal(s, ref)
    expect = to_fp8_saturated(x * ref, E4M3).float() / ref
    assert torch.equal(fp8_rowwise(x), expect)


def test_rule_properties():
    x = _rows(1)
    s = rowwise_scale(x)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    top = (x.abs().amax(-1) * s.squeeze(-1))[x.abs().amax(-1) > 0]
    assert torch.all((top > E4M3_MAX / 2) & (top <= E4M3_MAX))  # each row's maximum lands in the top binade
    q = fp8_rowwise(x)
    assert torch.equal(fp8_rowwise(q), q) and torch.equal(q[5], x[5])  # idempotent; a zero row stays zero
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for every element in the normal range of its row
    normal = x.abs() * s >= 2.0**-6
    rel = ((q - x).abs() / x.abs().clamp(min=1e-30))[normal]
    assert rel.max() <= 2.0**-4 and rel.mean() < 2.0**-5


def test_ste_gradient_is_the_identity():
    x = torch.randn(4, 32, requires_grad=True)
    g = torch.randn(4, 32)
    fp8_rowwise_ste(x).backward(g)
    assert torch.equal(x.grad, g)


def test_emulated_experts_close_to_high_precision():
    """The fp8 reference path against the fp64 loop. e4m3 keeps 3 mantissa bits: a rounded operand's relative
    error is at most 2^-4 and about 2^-4 / sqrt(3) ~ 3.6% RMS; five operands are rounded on the way (x, w1, w3,
    the GLU output, w2), so ~sqrt(5) x 3.6% ~ 8% of the output's norm, well above bf16's ~0.4%."""
    torch.manual_seed(0)
    n, d, i, e, k = 48, 64, 96, 8, 2
    x = torch.randn(n, d, dtype=torch.float64)
    w1, w3 = torch.randn(e, i, d, dtype=torch.float64) / d**0.5, torch.randn(e, i, d, dtype=torch.float64) / d**0.5
    w2 = torch.randn(e, d, i, dtype=torch.float64) / i**0.5
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    p = torch.rand(n, k, dtype=torch.float64)

    def glu(a, b):
        return torch.nn.functional.silu(a) * b

    exact = moe_experts(x, idx, p, w1, w2, w3, glu)
    rel = (moe_experts(x, idx, p, w1, w2, w3, glu, fp8=True) - exact).norm() / exact.norm()
    assert 0.01 < rel < 0.1


def test_switches_refuse_what_does_not_combine():
    model = K3ForCausalLM(get_preset("tiny"))
    enable_fp8_experts(model)
    assert all(m.fp8 for m in moe_layers(model))
    with pytest.raises(ValueError, match="FP8"):
        enable_qat(model)
    disable_fp8_experts(model)
    enable_qat(model)
    with pytest.raises(ValueError, match="QAT is on"):
        enable_fp8_experts(model)
    with pytest.raises(ValueError, match="do not combine"):
        TrainConfig(fp8_experts=True, qat="mxfp4").validate()


def test_tiny_training_step_with_fp8_experts(tmp_path):
    """One optimiser step of the tiny preset with --fp8-experts (the emulated path on a CPU): finite loss, and the
    routed experts' masters receive gradients."""
    from k3.train.trainer import Trainer

    cfg = TrainConfig(
        preset="tiny",
        steps=1,
        batch_size=2,
        seq_len=32,
        vocab_size=300,
        tokenizer_train_bytes=50_000,
        max_tokens=20_000,
        eval_every=1,
        eval_rows=2,
        samples=0,
        fp8_experts=True,
        out=str(tmp_path / "run"),
        device="cpu",
    )
    tr = Trainer(cfg, progress=False)
    assert all(m.fp8 for m in moe_layers(tr.model))
    before = moe_layers(tr.model)[0].experts.w1.detach().clone()
    tr.run()
    assert not torch.equal(before, moe_layers(tr.model)[0].experts.w1.detach())
