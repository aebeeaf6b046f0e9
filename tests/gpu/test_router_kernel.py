"""The router's Triton top-k kernel (k3.ops.router.triton_topk) against the torch reference on a CUDA GPU (run with
``pytest -m gpu``), at the decode shapes: one token and a batch of 64, 64 experts choosing 8 and 896 choosing 16.

Both compute in fp32: the same set of experts per token (sorted, as the reference's order is unspecified; rows whose
k-th and (k+1)-th keys are within 1e-5 may differ, as the sigmoids differ by rounding), and the scores and the
weights aligned by expert within 1e-5 relative, element by element: Triton's sigmoid takes a fast exp (ex2.approx,
~2^-22 relative, plus the rounding of x * log2(e)) where torch's is correctly rounded to ~1 ulp, and the
renormalising sums add k <= 16 terms in other orders (CPU interpreter: tests/ops/test_router.py, 1e-6).
Then route() itself: the kernel without gradients, the reference with them, on the fast backend.
"""

import pytest
import torch

from k3.ops import backend
from k3.ops import router
from k3.ops.router import reference
from tests.ops.kernel_switch import keep_kernel_plan
from tests.ops.routing_checks import assert_same_routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("e,k", [(64, 8), (896, 16)])
@pytest.mark.parametrize("n", [1, 64])
def test_triton_router_matches_reference(n, e, k, renormalize):
    from k3.ops.router.triton_topk import router_topk

    g = torch.Generator(device=DEV).manual_seed(n * e)
    logits = torch.randn(n, e, device=DEV, generator=g) * 2
    bias = torch.randn(e, device=DEV, generator=g) * 0.3
    got = router_topk(logits, bias, k, renormalize, 2.5)
    assert got[1].dtype == torch.int64 and got[2].dtype == got[0].dtype == torch.float32
    assert_same_routing(got, reference.route(logits, bias, k, renormalize, 2.5), bias, k, 1e-5, tie_gap=1e-5)


def test_route_runs_the_kernel_only_without_gradients(monkeypatch):
    from k3.ops.router.triton_topk import router_topk

    keep_kernel_plan(monkeypatch)
    backend.set_kernels(None)  # the default: the kernel where it can run

    torch.manual_seed(3)
    logits = torch.randn(64, 896, device=DEV, requires_grad=True)
    bias = torch.randn(896, device=DEV) * 0.3
    backend.set_backend("fast")
    try:
        with torch.no_grad():
            got = router.route(logits, bias, 16, True, 2.5)
            want = router_topk(logits, bias, 16, True, 2.5)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        got = router.route(logits, bias, 16, True, 2.5)  # a gradient is needed: the reference
        assert all(torch.equal(a, b) for a, b in zip(got, reference.route(logits, bias, 16, True, 2.5)))
        got[2].sum().backward()
        assert logits.grad is not None and logits.grad.abs().sum() > 0
    finally:
        backend.set_backend("auto")
