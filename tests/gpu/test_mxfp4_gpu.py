"""Packed MXFP4 experts on a CUDA GPU (run with ``pytest -m gpu``): the Triton kernel (k3.ops.moe.triton_mxfp4)
against the reference (k3.ops.moe.mxfp4.moe_experts_reference, bf16) on random codes and scales, the E8M0
extremes and the NaN code included, at decode shapes; then the op's dispatch and a packed model's decode."""

import pytest
import torch

from k3.model.activation import make_glu
from k3.ops import backend
from k3.ops.moe import mxfp4
from k3.quant.packed import PackedExperts
from tests.ops.kernel_switch import keep_kernel_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def bank(e: int, d: int, i: int, seed: int, extremes: bool, big: bool = True) -> PackedExperts:
    """Random codes; scales 2^-7..2^-3; with ``extremes`` some rows at scale 0 (2^-127), one block of expert 2's w3
    at the NaN code and, with ``big``, one block a row of expert 1's w1 at 254 (codes 0 but one 0.5: 2^126
    weights, which SiTU-GLU saturates)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    b = PackedExperts(e, d, i).to(DEV, torch.bfloat16)
    for name, t in b.named_buffers():
        if name.endswith("_packed"):
            t.copy_(torch.randint(0, 256, t.shape, device=DEV, generator=g, dtype=torch.uint8))
        elif name.endswith("_scale"):
            t.copy_(torch.randint(120, 125, t.shape, device=DEV, generator=g, dtype=torch.uint8))
    if extremes:
        b.w1_scale[0, :8] = 0
        b.w2_scale[0, :8] = 0
        b.w3_scale[2, 3, 1] = 255
    if extremes and big:
        b.w1_scale[1, :, 0] = 254
        b.w1_packed[1, :, :16] = 0
        b.w1_packed[1, :, 0] = 1
    return b


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same non-finite positions; finite rows equal within bf16 rounding (relative to each row's norm)."""
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    ok = want.isfinite().all(-1)
    if not ok.any():  # e.g. one token routed to the NaN block
        return
    err = (got[ok].float() - want[ok].float()).norm(dim=-1) / want[ok].float().norm(dim=-1).clamp(min=1e-30)
    assert err.max() < 1e-2, err.max()


@pytest.mark.parametrize(
    "n,k,e,d,i",
    [(1, 16, 896, 512, 384), (8, 16, 896, 512, 384), (64, 8, 64, 256, 128), (5, 2, 4, 96, 160), (600, 8, 16, 256, 128)],
)
@pytest.mark.parametrize("extremes", [False, True])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_kernel_matches_reference(n, k, e, d, i, extremes, act):
    from k3.ops.moe.triton_mxfp4 import moe_mxfp4

    b = bank(e, d, i, n * e, extremes, big=act == "situ")  # SwiGLU would pass 2^126 on and overflow
    g = torch.Generator(device=DEV).manual_seed(n)
    x = torch.randn(n, d, device=DEV, generator=g, dtype=torch.bfloat16)
    idx = torch.rand(n, e, device=DEV, generator=g).topk(k).indices
    if extremes:
        idx[0, 0], idx[-1, -1] = 1, 2  # route to the 2^127 expert and to the NaN one
        idx[0] = torch.where(idx[0] == 2, 3, idx[0]) if n > 1 else idx[0]
    weight = torch.rand(n, k, device=DEV, generator=g)
    glu = make_glu(act)
    with torch.no_grad():
        want = mxfp4.moe_experts_reference(x, idx, weight, b, glu)
        got = moe_mxfp4(x, idx, weight, mxfp4._bank(b), glu)
    assert got.dtype == x.dtype and got.shape == (n, d)
    close(got, want)
    if extremes:
        nan_tokens = (idx == 2).any(-1)
        assert got[nan_tokens].isnan().all() and got[~nan_tokens].isfinite().all()


def test_dispatch_runs_the_kernel_for_no_grad_decode(monkeypatch):
    keep_kernel_plan(monkeypatch)
    backend.set_kernels(None)
    b = bank(64, 256, 128, 0, True)
    x = torch.randn(4, 256, device=DEV, dtype=torch.bfloat16)
    idx = torch.rand(4, 64, device=DEV).topk(8).indices
    weight = torch.rand(4, 8, device=DEV)
    with torch.no_grad():
        assert mxfp4.mxfp4_kernel(x, idx, needs_grad=False) == "triton"
        got = mxfp4.moe_experts_packed(x, idx, weight, b, make_glu("situ"))
        backend.set_kernels("moe_mxfp4=torch")  # the selected experts dequantised to bf16, then moe_experts
        torch_form = mxfp4.moe_experts_packed(x, idx, weight, b, make_glu("situ"))
        want = mxfp4.moe_experts_reference(x, idx, weight, b, make_glu("situ"))
    close(got, want)
    close(torch_form, want)
