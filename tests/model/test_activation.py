"""SiTU and SiTU-GLU (docs/architecture.md#situ)."""

import torch
import torch.nn.functional as F

from k3.model.activation import make_glu, situ, situ_glu


def test_situ_formula_and_limits():
    x = torch.linspace(-50, 50, 2001, dtype=torch.float64)
    assert torch.allclose(situ(x, 4.0), 4.0 * torch.tanh(x / 4.0) * torch.sigmoid(x))
    assert torch.allclose(situ(x, 1e6), F.silu(x), atol=1e-6)  # beta -> inf recovers SiLU


def test_situ_glu_is_bounded_and_swiglu_near_zero():
    torch.manual_seed(0)
    g, u = torch.randn(10000) * 1e3, torch.randn(10000) * 1e3
    assert situ_glu(g, u).abs().max() <= 100.0  # reaches 100 exactly only by fp32 saturation
    g, u = torch.randn(1000, dtype=torch.float64) * 1e-3, torch.randn(1000, dtype=torch.float64) * 1e-3
    swi = F.silu(g) * u
    assert ((situ_glu(g, u) - swi).norm() / swi.norm()) < 1e-5


def test_fp32_compute_for_bf16_inputs():
    g = torch.randn(64).to(torch.bfloat16)
    u = torch.randn(64).to(torch.bfloat16)
    y = situ_glu(g, u)
    assert y.dtype == torch.bfloat16
    g, u = g.float(), u.float()
    ref = (4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)).to(torch.bfloat16)
    assert torch.equal(y, ref)


def test_make_glu_rejects_unknown():
    try:
        make_glu("gelu")
    except ValueError as e:
        assert "hidden_act" in str(e)
    else:
        raise AssertionError("no error")
