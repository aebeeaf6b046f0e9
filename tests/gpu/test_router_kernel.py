"""The router's Triton top-k kernel (k3.ops.router.triton_topk) against the torch reference on a CUDA GPU (run with
``pytest -m gpu``), at the decode shapes: one token and a batch of 64, 64 experts choosing 8 and 896 choosing 16.

Both compute in fp32: the same set of experts per token (sorted, as the reference's order is unspecified; rows whose
k-th and (k+1)-th keys are within 1e-5 may differ, as the sigmoids differ by rounding), and the scores and the
weights aligned by expert within 1e-5 relative, element by element: Triton's sigmoid takes a fast exp (ex2.approx,
~2^-22 relative, plus the rounding of x * log2(e)) where torch's is correctly rounded to ~1 ulp, and the
renormalising sums add k <= 16 terms in other orders (CPU interpreter: tests/ops/test_router.py, 1e-6).
Then route() itself: the kernel without gradients, the reference with them, on the fast backend. Last, the opt-in
one-launch router (k3.ops.router.triton_gemm_topk: the GEMM too) against F.linear + route, repeated and in a CUDA
graph (its ticket counter), and route_input choosing it only when opted in.
"""

import pytest
import torch

from k3.ops import backend
from k3.ops import router
from k3.ops.router import reference
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

    monkeypatch.delenv("K3_ROUTER_TOPK", raising=False)  # the default: the kernel where it can run

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


def _linear_then_route(x, w, bias, k, renormalize):
    return reference.route(torch.nn.functional.linear(x.float(), w.float()), bias, k, renormalize, 2.5)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("n,e,k,d,wdtype", [(1, 64, 8, 1024, torch.float32), (64, 64, 8, 1024, torch.float32),
                                            (8, 896, 16, 2048, torch.float32), (5, 100, 7, 96, torch.bfloat16),
                                            (200, 32, 4, 64, torch.float32)])
def test_one_launch_router_matches_linear_then_route(n, e, k, d, wdtype, renormalize):
    """The opt-in one-launch router (k3.ops.router.triton_gemm_topk) against F.linear in fp32 (TF32 off) and the
    torch route, as above, with 2e-5: its GEMM sums in another order (split partials, or one FMA chain of D terms
    where SPLITS is 1), a few 1e-6 of a score at D = 2048, where a TF32 product (10-bit mantissa) would be off by
    ~1e-4. The shapes: 1 and 64 tokens of the benchmark's router, K3's 896 experts, an expert count and a width
    that fill no block, more rows than one phase-1 block, a bf16 weight. Then launches back to back on two inputs
    in turn, each equal to its first result (a last program reading another launch's stale partials, or a counter
    left off 0, would not be), and a CUDA graph replayed on new data copied into its input."""
    from k3.ops.router import triton_gemm_topk as tg

    g = torch.Generator(device=DEV).manual_seed(n * e + d)

    def inputs():
        return (torch.randn(n, d, device=DEV, generator=g).bfloat16(),
                (torch.randn(e, d, device=DEV, generator=g) * d ** -0.5 * 2).to(wdtype))

    bias = torch.randn(e, device=DEV, generator=g) * 0.3
    (x, w), (x2, w2) = inputs(), inputs()
    got = tg.router_gemm_topk(x, w, bias, k, renormalize, 2.5)
    assert_same_routing(got, _linear_then_route(x, w, bias, k, renormalize), bias, k, 2e-5, tie_gap=1e-5)
    got2 = tg.router_gemm_topk(x2, w2, bias, k, renormalize, 2.5)
    assert_same_routing(got2, _linear_then_route(x2, w2, bias, k, renormalize), bias, k, 2e-5,
                        tie_gap=1e-5)
    for step in range(40):
        xs, ws, want = (x, w, got) if step % 2 else (x2, w2, got2)
        again = tg.router_gemm_topk(xs, ws, bias, k, renormalize, 2.5)
        assert all(torch.equal(a, b) for a, b in zip(again, want)), step  # deterministic, no stale partials
    assert tg._counters[x.device].item() == 0
    xin = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tg.router_gemm_topk(xin, w, bias, k, renormalize, 2.5)
    for step in range(4):
        xin.copy_(x if step % 2 else torch.randn(n, d, device=DEV, generator=g).bfloat16())
        graph.replay()
        want = tg.router_gemm_topk(xin, w, bias, k, renormalize, 2.5)
        assert all(torch.equal(a, b) for a, b in zip(captured, want)), step


def test_route_input_runs_the_one_launch_router_when_opted_in(monkeypatch):
    from k3.ops.router.triton_gemm_topk import router_gemm_topk

    torch.manual_seed(4)
    x = torch.randn(64, 1024, device=DEV, dtype=torch.bfloat16)
    w, bias = torch.randn(64, 1024, device=DEV) * 0.05, torch.randn(64, device=DEV) * 0.3
    backend.set_backend("fast")
    try:
        with torch.no_grad():
            monkeypatch.delenv("K3_ROUTER_GEMM", raising=False)
            plain = router.route_input(x, w, bias, 8, True, 2.5)  # opt-in: unset is the GEMM, then route()
            assert all(torch.equal(a, b) for a, b in zip(plain, router.route(
                torch.nn.functional.linear(x.float(), w), bias, 8, True, 2.5)))
            monkeypatch.setenv("K3_ROUTER_GEMM", "triton")
            got = router.route_input(x, w, bias, 8, True, 2.5)
            assert all(torch.equal(a, b) for a, b in zip(got, router_gemm_topk(x, w, bias, 8, True, 2.5)))
    finally:
        backend.set_backend("auto")
