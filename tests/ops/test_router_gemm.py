"""The router from its input (k3.ops.router.route_input) and its opt-in one-launch kernel (triton_gemm_topk).

On the CPU, route_input is Router's former body: F.linear in fp32, then route (bitwise, tests/ops/test_router.py).
The chooser: the kernel only with K3_ROUTER_GEMM=triton, no gradient, supported dtypes and at most MAX_LOGITS logits.
The kernel runs in Triton's interpreter (a subprocess) against F.linear in fp32 + the torch route: the same experts
per token, and scores and weights within a relative 1e-5 elementwise. Both compute in fp32; they differ by the
GEMM's summation order (partial sums over D/SPLITS terms, then over the splits: each logit off by a few ulps of
the sum of |products|, ~1e-7 relative to it at D <= 256) and by the sigmoid's and the renormalising sum's rounding
(test_router.py: ~3e-7); the inputs keep every logit away from 0. Then the ticket counter: back at 0 after each
launch, so back-to-back launches (different splits, a second row block in phase 2) agree; and the custom op's
fake function and a compiled caller without graph breaks. On the GPU: tests/gpu/test_router_kernel.py.
"""

import logging
import textwrap

import pytest
import torch

from k3.ops import router
from k3.ops.moe import grouped


def test_route_input_without_the_kernel_is_linear_then_route():
    torch.manual_seed(0)
    x, w, b = torch.randn(7, 48, dtype=torch.bfloat16), torch.randn(64, 48), torch.randn(64) * 0.1
    got = router.route_input(x, w, b, 8, True, 2.5)
    want = router.route(torch.nn.functional.linear(x.float(), w), b, 8, True, 2.5)
    assert all(torch.equal(a, c) for a, c in zip(got, want))


def test_the_kernel_is_opt_in_and_declines_what_it_does_not_take(monkeypatch, caplog):
    """Unset K3_ROUTER_GEMM: torch, with the reason; triton: the kernel where Triton is usable, except with
    gradients, under autocast, with K3_ROUTER_TOPK=torch, other dtypes, more than MAX_EXPERTS experts or MAX_LOGITS
    logits, or off a GPU; torch: torch; any other value, or triton without Triton, one clear error."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a CPU tensor counts as on the kernel's device
    monkeypatch.setattr(router, "_gemm_logged", set())
    x, w, b = torch.zeros(4, 32, requires_grad=True), torch.zeros(64, 32), torch.zeros(64)
    monkeypatch.setattr(grouped, "_have_triton", lambda: True)
    monkeypatch.delenv("K3_ROUTER_GEMM", raising=False)
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert router.gemm_topk_kernel(x.detach(), w, b) == "torch"
        monkeypatch.setenv("K3_ROUTER_GEMM", "triton")
        assert router.gemm_topk_kernel(x.detach(), w, b) == "triton"
        assert router.gemm_topk_kernel(x.detach().bfloat16(), w.bfloat16(), b) == "triton"
        assert router.gemm_topk_kernel(x, w, b) == "torch"
        with torch.no_grad():
            assert router.gemm_topk_kernel(x, w, b) == "triton"
            assert router.gemm_topk_kernel(x.double(), w.double(), b) == "torch"
            assert router.gemm_topk_kernel(x, w, b.bfloat16()) == "torch"
            wide = torch.zeros(router.MAX_EXPERTS + 1, 32)
            assert router.gemm_topk_kernel(x, wide, torch.zeros(router.MAX_EXPERTS + 1)) == "torch"
            rows = torch.zeros(router.MAX_LOGITS // 64 + 1, 32)
            assert router.gemm_topk_kernel(rows, w, b) == "torch"
            assert router.gemm_topk_kernel(rows[:-1], w, b) == "triton"
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert router.gemm_topk_kernel(x, w, b) == "torch"
            monkeypatch.setenv("K3_ROUTER_TOPK", "torch")
            assert router.gemm_topk_kernel(x, w, b) == "torch"
            monkeypatch.delenv("K3_ROUTER_TOPK")
        monkeypatch.delenv("TRITON_INTERPRET")
        assert router.gemm_topk_kernel(x.detach(), w, b) == "torch"  # a CPU tensor, no interpreter
    lines = [r.getMessage() for r in caplog.records]
    head = "router: GEMM and top-k by "
    assert lines == [
        head + "F.linear in fp32, then route(): K3_ROUTER_GEMM is not set (the kernel is opt-in until measured on a "
        "GPU: K3_ROUTER_GEMM=triton)",
        head + "one Triton launch (k3.ops.router.triton_gemm_topk)",
        head + "F.linear in fp32, then route(): a gradient is needed",
        head + "F.linear in fp32, then route(): the kernel takes bf16 / fp16 / fp32 x and weight and an fp32 bias, "
        "not torch.float64, torch.float64 and torch.float32",
        head + "F.linear in fp32, then route(): the kernel takes bf16 / fp16 / fp32 x and weight and an fp32 bias, "
        "not torch.float32, torch.float32 and torch.bfloat16",
        head + f"F.linear in fp32, then route(): 4097 experts, more than the kernel's {router.MAX_EXPERTS}",
        head + f"F.linear in fp32, then route(): 129 rows x 64 experts, more than the kernel's {router.MAX_LOGITS} "
        "logits",
        head + "F.linear in fp32, then route(): autocast is on (F.linear then runs in autocast's dtype; the kernel "
        "always in fp32)",
        head + "F.linear in fp32, then route(): K3_ROUTER_TOPK=torch (the launch includes the top-k)",
        head + "F.linear in fp32, then route(): the router's input is not on a GPU"]
    for value, error in (("fast", "K3_ROUTER_GEMM='fast' must be one of torch, triton"),
                         ("triton", "K3_ROUTER_GEMM=triton needs Triton")):
        monkeypatch.setenv("K3_ROUTER_GEMM", value)
        monkeypatch.setattr(grouped, "_have_triton", lambda: value != "triton")
        with pytest.raises(ValueError, match=error):
            router.gemm_topk_kernel(x.detach(), w, b)
    monkeypatch.setenv("K3_ROUTER_GEMM", "torch")
    monkeypatch.setattr(grouped, "_have_triton", lambda: True)
    assert router.gemm_topk_kernel(x.detach(), w, b) == "torch"


def test_kernel_rejects_bad_inputs():
    tk = pytest.importorskip("k3.ops.router.triton_gemm_topk")
    x, w, b = torch.zeros(3, 32), torch.zeros(16, 32), torch.zeros(16)
    for args in [(x.double(), w, b, 4), (x, w.double(), b, 4), (x[0], w, b, 4), (x, w[:, :8], b, 4),
                 (x, w, b[:8], 4), (x, w, b.bfloat16(), 4), (x, w, b, 0), (x, w, b, 17),
                 (torch.zeros(router.MAX_LOGITS // 16 + 1, 32), w, b, 4)]:
        with pytest.raises(ValueError, match="router_gemm_topk: .* do not match"):
            tk.router_gemm_topk(*args, True, 1.0)


INTERPRETED = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    from k3.ops.router import reference, triton_gemm_topk as tg
    from tests.ops.routing_checks import assert_same_routing

    def check(x, w, bias, k, renormalize, scaling=2.5):
        got = tg.router_gemm_topk(x, w, bias, k, renormalize, scaling)
        assert tg._counters[x.device].item() == 0  # reset for the next launch
        want = reference.route(F.linear(x.float(), w.float()), bias, k, renormalize, scaling)
        assert_same_routing(got, want, bias, k, 1e-5)

    torch.manual_seed(0)
    cases = [(1, 64, 8, 128), (64, 64, 8, 256), (5, 100, 7, 96), (8, 896, 16, 64), (3, 5, 5, 40), (200, 32, 4, 64)]
    for n, e, k, d in cases:
        x = torch.randn(n, d, dtype=torch.bfloat16)
        w = torch.randn(e, d) * d ** -0.5 * 2
        bias = torch.randn(e) * 0.3
        for renormalize in (False, True):
            check(x, w, bias, k, renormalize)
        check(x.float(), w.bfloat16(), bias, k, True)
    # the splits and phase 2's row blocks the cases cover
    assert tg.launch_shape(64, 64, 256)["SPLITS"] == 4 and tg.launch_shape(5, 100, 96)["SPLITS"] == 2
    assert tg.launch_shape(200, 32, 64)["ROWS"] == 128 and tg.launch_shape(200, 32, 64)["BLOCK_N"] == 64
    assert tg.launch_shape(8, 896, 64)["ROWS"] == 4 and tg.launch_shape(1, 64, 128)["ROWS"] == 1
    # ties: the lowest index first; a NaN logit ranks first
    x = torch.ones(2, 16)
    w = torch.zeros(6, 16)
    w[[1, 3, 5]] = 0.2
    w[[2, 4]] = 0.1
    _, i, _ = tg.router_gemm_topk(x, w, torch.zeros(6), 4, True, 1.0)
    assert i.tolist() == [[1, 3, 5, 2]] * 2, i
    w = torch.eye(16)[:8]
    w[3, 0] = float("nan")  # expert 3's logit only (a NaN in x would reach every logit)
    _, i, _ = tg.router_gemm_topk(x[:1], w, torch.zeros(8), 3, False, 1.0)
    assert i[0, 0] == 3, i
    # the custom op: its fake function agrees with the kernel; a compiled caller keeps it in its graph
    x, w, bias = torch.randn(6, 96), torch.randn(100, 96) * 0.2, torch.randn(100) * 0.3
    checks = torch.library.opcheck(torch.ops.k3.router_gemm_topk.default, (x, w, bias, 7, True, 2.5))
    assert all(v == "SUCCESS" for v in checks.values()), checks
    caller = lambda t: tg.router_gemm_topk(t * 2, w, bias, 7, True, 2.5)  # noqa: E731
    counters.clear()
    got = torch.compile(caller, backend="aot_eager", dynamic=True)(x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(torch.equal(a, b) for a, b in zip(got, caller(x)))
    print("ok")
""")


def test_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED)
