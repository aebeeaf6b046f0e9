"""Several linear maps of one input in one Triton launch (k3.ops.linear.triton_multi) against the fp32 reference on a
CUDA GPU (run with ``pytest -m gpu``), at the decode shapes of a KDA layer of the decode benchmark's model (x
[M, 1024] -> q, k, v 1024 each, the gates' low-rank maps 64, beta 16) and with ragged widths.

bf16 inputs and outputs with fp32 accumulation: each output's relative error <= 5e-3, the bf16 rounding of the
outputs (2^-9 ~ 2e-3 per element, ~1e-3 over a vector) with room for the sum's order (CPU interpreter, fp16:
tests/ops/test_multi_linear.py). Then multi_linear() itself: the kernel without gradients, torch with them.
"""

import pytest
import torch

from k3.ops import backend, linear
from k3.ops.linear import reference
from tests.ops.kernel_switch import keep_kernel_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


@pytest.mark.parametrize("sizes,k", [((1024, 1024, 1024, 64, 16, 64), 1024), ((7, 300, 129, 1), 96)])
@pytest.mark.parametrize("m", [1, 64, 200])
def test_triton_multi_linear_matches_reference(m, sizes, k):
    from k3.ops.linear.triton_multi import multi_linear

    g = torch.Generator(device=DEV).manual_seed(m + k)
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    ws = [(torch.randn(n, k, device=DEV, generator=g) * k**-0.5).bfloat16() for n in sizes]
    got = multi_linear(x, ws)
    for y, want in zip(got, reference.multi_linear(x.float(), [w.float() for w in ws])):
        assert y.dtype == torch.bfloat16 and y.shape == want.shape
        assert ((y.float() - want).norm() / want.norm()).item() <= 5e-3


@pytest.mark.parametrize("router_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 64])
def test_triton_multi_linear_router_slot_is_fp32(m, router_dtype):
    """A MoE layer's call at the decode benchmark's shapes: the shared experts' gate and up (bf16 outputs) and the
    router's 64 logits in fp32 (fp32=1) from an fp32 weight (x upcast, fp32 products) or a bf16 one (exact products,
    fp32 sums): the router's relative error <= 1e-5 against the fp32 reference (the sums' order only)."""
    from k3.ops.linear.triton_multi import multi_linear

    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 1024, device=DEV, generator=g).bfloat16()
    ws = [(torch.randn(n, 1024, device=DEV, generator=g) * 0.03).bfloat16() for n in (512, 512)]
    ws.append((torch.randn(64, 1024, device=DEV, generator=g) * 0.03).to(router_dtype))
    got = multi_linear(x, ws, 1)
    want = reference.multi_linear(x, ws, 1)
    assert [y.dtype for y in got] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for y, w, tol in zip(got, want, (5e-3, 5e-3, 1e-5)):
        assert ((y.float() - w.float()).norm() / w.float().norm()).item() <= tol


def test_multi_linear_runs_the_kernel_only_without_gradients(monkeypatch):
    from k3.ops.linear.triton_multi import multi_linear

    keep_kernel_plan(monkeypatch)
    backend.set_kernels(None)  # the default: the kernel where it can run
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
