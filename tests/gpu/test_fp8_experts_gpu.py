"""FP8 expert matmuls on a GPU (torchao's FP8 grouped GEMM) against the emulated rule and the bf16 path."""

import pytest
import torch

from k3.ops.fp8 import E4M3, fp8_rowwise
from k3.ops.moe import grouped
from k3.ops.moe.reference import moe_experts as reference_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
    ),
]


def _glu(a, b):
    return torch.nn.functional.silu(a) * b


def _case(n=300, d=128, i=192, e=16, k=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(e, i, d, device="cuda", generator=g) / d**0.5).bfloat16()
    w3 = (torch.randn(e, i, d, device="cuda", generator=g) / d**0.5).bfloat16()
    w2 = (torch.randn(e, d, i, device="cuda", generator=g) / i**0.5).bfloat16()
    idx = torch.rand(n, e, device="cuda", generator=g).topk(k, dim=-1).indices
    p = torch.rand(n, k, device="cuda", generator=g)
    return x, idx, p, w1, w2, w3


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_torchao_cast_is_our_rule():
    from torchao.prototype.moe_training.kernels import triton_fp8_rowwise_2d_scale_and_cast

    x = torch.randn(256, 128, device="cuda") * torch.logspace(-3, 3, 256, device="cuda").unsqueeze(1)
    data, scales = triton_fp8_rowwise_2d_scale_and_cast(x, output_dtype=E4M3, round_scales_to_power_of_2=True)
    same = (data.float() / scales.reshape(-1, 1)) == fp8_rowwise(x)
    assert same.float().mean() > 0.999  # (its fp32 quotient 448 / amax may round up where ours, in fp64, does not)


def test_fp8_grouped_forward_matches_the_emulation():
    """Same roundings on both sides; what differs is the accumulation order and bf16 outputs: ~1e-2 at most."""
    x, idx, p, w1, w2, w3 = _case()
    fast = grouped.moe_experts(x, idx, p, w1, w2, w3, _glu, fp8=True)
    emulated = reference_experts(x.float(), idx, p, w1.float(), w2.float(), w3.float(), _glu, fp8=True)
    exact = reference_experts(x.float(), idx, p, w1.float(), w2.float(), w3.float(), _glu)
    assert _rel(fast, emulated) < 2e-2
    assert 0.01 < _rel(fast, exact) < 0.1  # it did round to e4m3 (bf16 alone: ~0.4%)


def test_fp8_grouped_gradients_close_to_bf16():
    x, idx, p, w1, w2, w3 = _case(seed=1)
    grads = []
    for fp8 in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, w3)]
        y = grouped.moe_experts(leaves[0], idx, p, leaves[1], leaves[2], leaves[3], _glu, fp8=fp8)
        y.float().square().sum().backward()
        grads.append([t.grad for t in leaves])
    for g_bf16, g_fp8 in zip(*grads):
        assert torch.isfinite(g_fp8).all() and _rel(g_fp8, g_bf16) < 0.15


def test_training_steps_with_fp8_experts(tmp_path):
    from k3.model.moe import moe_layers
    from k3.train.config import TrainConfig
    from k3.train.trainer import Trainer

    cfg = TrainConfig(
        preset="small",
        steps=3,
        batch_size=4,
        seq_len=256,
        vocab_size=1024,
        tokenizer_train_bytes=200_000,
        max_tokens=100_000,
        eval_every=3,
        eval_rows=4,
        samples=0,
        fp8_experts=True,
        out=str(tmp_path / "run"),
        device="cuda",
    )
    tr = Trainer(cfg, progress=False)
    assert all(m.fp8 for m in moe_layers(tr.model))
    out = tr.run()
    assert tr.step == 3 and out is not None
