"""MoE routing after the router GEMM (k3.ops.router): the torch reference, the dispatch between it and the Triton
kernel, and the kernel itself.

The reference must be the router's former inline code to the bit. On a machine with Triton but no GPU, the kernel
runs in Triton's interpreter (in a subprocess: TRITON_INTERPRET is read when the kernel is defined) against the
reference: the same set of experts per token (the kernel's order is descending by score + bias, the reference's
unspecified, so both are sorted), the same weights once aligned by expert and the same scores, each element within
a relative 1e-6. Both compute in fp32 and differ by rounding only: the sigmoid's (a few ulps, 2^-23 ~ 1.2e-7 each,
as torch's and the kernel's exp differ) and the renormalising sum's order over k <= 16 terms; the observed worst
case is ~3e-7. Then ties, NaN and -inf keys, the custom op's fake function (torch.library.opcheck), and compiled
callers of the op and of the fast backend without graph breaks. On the GPU: tests/gpu/test_router_kernel.py.
"""

import logging
import textwrap

import pytest
import torch
import torch.nn.functional as F

from k3.model.moe import Router
from k3.ops import backend
from k3.ops import router
from k3.ops.router import reference
from tests.ops.kernel_switch import check_kernel_switch


def old_router(x, weight, bias, top_k, renormalize, scaling):
    """Router.forward before k3.ops.router existed, verbatim: the specification of the reference."""
    scores = torch.sigmoid(F.linear(x.float(), weight.float()))
    topk_idx = torch.topk(scores.detach() + bias.float(), top_k, dim=-1, sorted=False).indices
    weight = scores.gather(1, topk_idx)
    if renormalize:
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    return scores, topk_idx, weight * scaling


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("n,e,k", [(1, 64, 8), (64, 64, 8), (33, 100, 7)])
def test_reference_and_router_equal_the_old_inline_code(n, e, k, renormalize):
    torch.manual_seed(n + e)
    gate = Router(48, e, k, renormalize, 2.5)
    torch.nn.init.normal_(gate.weight, std=0.3)
    gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(n, 48, dtype=torch.bfloat16)
    want = old_router(x, gate.weight, gate.e_score_correction_bias, k, renormalize, 2.5)
    logits = F.linear(x.float(), gate.weight.float())
    for got in (reference.route(logits, gate.e_score_correction_bias, k, renormalize, 2.5), gate(x)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))  # bitwise, and in the same order
    assert gate(x)[2].requires_grad  # the weights carry the router's gradient


def test_reference_gradients():
    torch.manual_seed(0)
    logits = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, dtype=torch.float64) * 0.1

    def scores_and_weights(t):
        s, _, w = reference.route(t, bias, 3, True, 2.5)
        return s, w

    assert torch.autograd.gradcheck(scores_and_weights, (logits,))


def test_dispatch_runs_the_reference_on_cpu_and_logs_it(monkeypatch, caplog):
    entry = backend._OPS["router"]
    monkeypatch.setattr(entry, "logged", set())
    torch.manual_seed(1)
    logits, bias = torch.randn(5, 64), torch.randn(64) * 0.1
    with caplog.at_level(logging.DEBUG, logger="k3.ops"), torch.no_grad():
        got = router.route(logits, bias, 8, True, 2.5)
    assert "op router runs backend reference (torch) on cpu" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(got, reference.route(logits, bias, 8, True, 2.5)))
    backend.set_backend("fast")
    try:
        with pytest.raises(RuntimeError, match="op 'router''s fast path cannot run on cpu"):
            router.route(logits, bias, 8, True, 2.5)
    finally:
        backend.set_backend("auto")


def test_fast_backend_wants_cuda(monkeypatch):
    """The fast backend on CUDA devices (its kernel, where chosen, checks for Triton); the reference elsewhere, and
    wherever backend=reference. A CUDA device by name: nothing asks the driver."""
    entry = backend._OPS["router"]
    monkeypatch.setattr(entry, "logged", set())
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for device, choice, want in [(cuda, "auto", "fast"), (cuda, "reference", "reference"), (cpu, "auto", "reference")]:
        monkeypatch.setattr(entry, "fast_ok", {})
        backend.set_backend(choice)
        try:
            assert backend.resolve("router", device)[0] == want, (device, choice)
        finally:
            backend.set_backend("auto")


def test_fast_backend_runs_the_kernel_only_without_gradients(monkeypatch, caplog):
    """Under the fast backend: the Triton kernel when no gradient is needed, fp32 inputs and E <= MAX_EXPERTS;
    torch otherwise. Each choice is logged once, with its reason. K3_KERNELS=router_topk=torch turns the kernel off;
    any other value than torch / triton is one clear error."""
    logits, bias = torch.zeros(2, 64, requires_grad=True), torch.zeros(64)
    check_kernel_switch(monkeypatch, "router_topk", lambda: router.topk_kernel(logits.detach(), bias))
    monkeypatch.setattr(router, "_logged", set())
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert router.topk_kernel(logits, bias) == "torch"
        with torch.no_grad():
            assert router.topk_kernel(logits, bias) == "triton"
            assert router.topk_kernel(logits.double(), bias.double()) == "torch"
            wide = torch.zeros(1, router.MAX_EXPERTS + 1)
            assert router.topk_kernel(wide, torch.zeros(router.MAX_EXPERTS + 1)) == "torch"
        assert router.topk_kernel(logits.detach(), bias) == "triton"  # grad mode on, but nothing to differentiate
        assert router.topk_kernel(logits, bias) == "torch"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "router: top-k by torch (k3.ops.router.reference): a gradient is needed",
        "router: top-k by the Triton kernel (k3.ops.router.triton_topk)",
        "router: top-k by torch (k3.ops.router.reference): the kernel takes fp32 logits and bias, not "
        "torch.float64 and torch.float64",
        "router: top-k by torch (k3.ops.router.reference): 4097 experts, more than the kernel's 4096",
    ]


def test_kernel_rejects_bad_inputs():
    tk = pytest.importorskip("k3.ops.router.triton_topk")
    logits, bias = torch.zeros(3, 16), torch.zeros(16)
    for args in [
        (logits.double(), bias.double(), 4),
        (logits[0], bias, 4),
        (logits, bias[:8], 4),
        (logits, bias, 0),
        (logits, bias, 17),
        (torch.zeros(1, 4097), torch.zeros(4097), 4),
    ]:
        with pytest.raises(ValueError, match="router_topk: .* do not match"):
            tk.router_topk(*args, True, 1.0)


INTERPRETED = textwrap.dedent("""
    import torch
    from torch._dynamo.utils import counters
    from k3.ops import backend
    from k3.ops import router
    from k3.ops.router import reference, triton_topk
    from tests.ops.routing_checks import assert_same_routing

    def check(logits, bias, k, renormalize, scaling=2.5):
        got = triton_topk.router_topk(logits, bias, k, renormalize, scaling)
        assert_same_routing(got, reference.route(logits, bias, k, renormalize, scaling), bias, k, 1e-6)
        return got[1]

    torch.manual_seed(0)
    for n, e, k in [(1, 64, 8), (64, 64, 8), (1, 896, 16), (64, 896, 16), (5, 100, 7), (3, 5, 5)]:
        logits, bias = torch.randn(n, e) * 2, torch.randn(e) * 0.3
        for renormalize in (False, True):
            check(logits, bias, k, renormalize)
            _, i, _ = triton_topk.router_topk(logits, torch.zeros(e), k, renormalize, 2.5)
            assert n < 64 or not torch.equal(i, check(logits, bias, k, renormalize))  # the bias changes choices
    # equal keys: the lowest index first
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, 3.0], [0.0] * 6])
    _, i, w = triton_topk.router_topk(logits, torch.zeros(6), 4, True, 1.0)
    assert i.tolist() == [[1, 3, 5, 2], [0, 1, 2, 3]], i
    # a NaN logit ranks first (as in torch.topk); -inf biases still give distinct experts, in range
    logits = torch.randn(2, 8)
    logits[0, 6] = float("nan")
    _, i, _ = triton_topk.router_topk(logits[:1], torch.zeros(8), 3, False, 1.0)
    want = reference.route(logits[:1], torch.zeros(8), 3, False, 1.0)[1]
    assert i[0, 0] == 6 and torch.equal(i.sort(1).values, want.sort(1).values), (i, want)
    bias = torch.tensor([0.0, 0.0] + [float("-inf")] * 6)
    _, i, w = triton_topk.router_topk(logits[1:], bias, 4, True, 1.0)
    assert sorted(i[0, :2].tolist()) == [0, 1] and i[0, 2:].tolist() == [2, 3] and w.isfinite().all(), (i, w)
    # the custom op: its fake function agrees with the kernel; compiled callers keep it in their graph
    logits, bias = torch.randn(6, 100), torch.randn(100) * 0.3
    checks = torch.library.opcheck(torch.ops.k3.router_topk.default, (logits, bias, 7, True, 2.5))
    assert all(v == "SUCCESS" for v in checks.values()), checks
    caller = lambda t: triton_topk.router_topk(t * 2, bias, 7, True, 2.5)  # noqa: E731
    counters.clear()
    got = torch.compile(caller, backend="aot_eager", dynamic=True)(logits)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(torch.equal(a, b) for a, b in zip(got, caller(logits)))
    backend.set_kernels(None, triton=True)  # Triton's interpreter stands in for a GPU
    fast = lambda t: router._route_fast(t * 2, bias, 7, True, 2.5)  # noqa: E731  (the fast backend's function)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(fast(logits), caller(logits)))  # eager first: it logs
        counters.clear()
        explained = torch._dynamo.explain(fast)(logits)
        assert all(torch.equal(a, b) for a, b in zip(torch.compile(fast, backend="eager")(logits), caller(logits)))
    assert explained.graph_break_count == 0 and not counters["graph_break"], explained.break_reasons
    assert "k3.router_topk" in "\\n".join(g.code for g in explained.graphs)
    print("ok")
""")


def test_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED)
