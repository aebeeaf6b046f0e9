"""Several linear maps of one input in one Triton launch (k3.ops.linear.triton_multi) against the fp32 reference on a
CUDA GPU (run with ``pytest -m gpu``), at the decode shapes of a KDA layer of the decode benchmark's model (x
[M, 1024] -> q, k, v 1024 each, the gates' low-rank maps 64, beta 16) and with ragged widths.

bf16 inputs and outputs with fp32 accumulation: each output's relative error <= 5e-3, the bf16 rounding of the
outputs (2^-9 ~ 2e-3 per element, ~1e-3 over a vector) with room for the sum's order (CPU interpreter, fp16:
tests/ops/test_multi_linear.py). Then multi_linear() itself: the kernel without gradients, torch with them. Last,
the opt-in maps-and-convs launch (multi_linear_conv) against the two kernels it fuses.
"""

import pytest
import torch

from k3.ops import backend, linear
from k3.ops.linear import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


@pytest.mark.parametrize("sizes,k", [((1024, 1024, 1024, 64, 16, 64), 1024), ((7, 300, 129, 1), 96)])
@pytest.mark.parametrize("m", [1, 64, 200])
def test_triton_multi_linear_matches_reference(m, sizes, k):
    from k3.ops.linear.triton_multi import multi_linear

    g = torch.Generator(device=DEV).manual_seed(m + k)
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    ws = [(torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).bfloat16() for n in sizes]
    got = multi_linear(x, ws)
    for y, want in zip(got, reference.multi_linear(x.float(), [w.float() for w in ws])):
        assert y.dtype == torch.bfloat16 and y.shape == want.shape
        assert ((y.float() - want).norm() / want.norm()).item() <= 5e-3


def test_multi_linear_runs_the_kernel_only_without_gradients(monkeypatch):
    from k3.ops.linear.triton_multi import multi_linear

    monkeypatch.delenv("K3_MULTI_LINEAR", raising=False)  # the default: the kernel where it can run
    torch.manual_seed(3)
    x = torch.randn(16, 256, device=DEV, dtype=torch.bfloat16)
    ws = [torch.randn(n, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True) for n in (64, 32)]
    backend.set_backend("fast")
    try:
        with torch.no_grad():
            got = linear.multi_linear(x, ws)
            want = multi_linear(x, ws)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        got = linear.multi_linear(x, ws)  # a gradient is needed: torch
        assert all(torch.equal(a, b) for a, b in zip(got, reference.multi_linear(x, ws)))
        sum(y.float().sum() for y in got).backward()
        assert all(w.grad is not None for w in ws)
    finally:
        backend.set_backend("auto")


@pytest.mark.parametrize("sizes,width,silu", [((1024, 1024, 1024, 64, 16, 64), 4, True),
                                              ((1000, 520, 200, 64, 16), 3, False), ((48, 48, 40), 2, True)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 64, 200])
def test_maps_and_convs_in_one_launch_match_the_two_kernels(m, state_dtype, sizes, width, silu, monkeypatch):
    """The opt-in multi_linear_conv (the KDA decode step's six maps with the q, k, v short convs on the way out)
    against multi_linear then conv_steps, the two kernels it fuses, at the decode benchmark's KDA shapes: the same
    products, so every pool row equal to the bit and the untouched maps too; the conv outputs sum their taps
    in fp32, perhaps in another order, so they may differ by one bf16 rounding (<= 2^-7 of the value). Then through
    k3.ops.linear.multi_linear_conv with K3_MAPS_CONV=triton, and the pools moved by exactly one step. Also
    widths that fill no column block, conv widths 3 and 2, and no SiLU."""
    from k3.ops.conv.triton_step import conv_steps
    from k3.ops.linear import triton_multi as tm

    g = torch.Generator(device=DEV).manual_seed(m)
    k = 1024
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    ws = [(torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).bfloat16() for n in sizes]
    cws = [torch.randn(n, width, device=DEV, generator=g) * 0.5 for n in sizes[:3]]
    pools = [torch.randn(m + 7, n, width - 1, device=DEV, generator=g).to(state_dtype) for n in sizes[:3]]
    slots = torch.randperm(m + 7, device=DEV, generator=g)[:m]
    mine, theirs = [p.clone() for p in pools], [p.clone() for p in pools]
    got = tm.multi_linear_conv(x, ws, *cws, *mine, slots, silu)[:len(ws)]
    maps = tm.multi_linear(x, ws)
    want = list(conv_steps(*maps[:3], *cws, *theirs, slots, silu)) + maps[3:]
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    for a, b in zip(got[3:], want[3:]):
        assert torch.equal(a, b)
    for a, b in zip(got[:3], want[:3]):
        assert ((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs() + 1e-5).all()  # one bf16 step
    for p, q, y in zip(pools, mine, maps[:3]):  # one step: the window shifted, the map's output last
        assert torch.equal(q[slots, :, :-1], p[slots, :, 1:]) and torch.equal(q[slots, :, -1], y.to(state_dtype))
    monkeypatch.setenv("K3_MAPS_CONV", "triton")
    backend.set_backend("fast")
    try:
        with torch.no_grad():
            again = [p.clone() for p in pools]
            assert linear.conv_kernel(x, ws, cws, again, "silu" if silu else None) == "triton"
            routed = linear.multi_linear_conv(x, ws, cws, states=again, slots=slots,
                                              activation="silu" if silu else None)
        assert all(torch.equal(a, b) for a, b in zip(routed, got))
        assert all(torch.equal(a, b) for a, b in zip(again, mine))
    finally:
        backend.set_backend("auto")
