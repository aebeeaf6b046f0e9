"""The one-program Triton routing (k3.ops.moe.triton_route) on a CUDA GPU (run with ``pytest -m gpu``): exactly the
definition and the torch form's routing at the decode shapes (1 and 64 tokens; 64 experts choosing 8, 896 choosing
16) and at COUNT_PAIRS pairs, where the program runs 8 warps and the -1 fill and the pairs' rows are written by
different threads (the interpreter, tests/ops/test_moe_route.py, runs one thread and cannot test that barrier).
Then the routed experts end to end with the kernel (the default): the same output as the torch routing, bit for bit.
"""

import pytest
import torch

from k3.ops import backend
from k3.ops.moe import grouped
from tests.ops.kernel_switch import keep_kernel_plan
from tests.ops.test_moe_route import assert_routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


@pytest.mark.parametrize(
    "n,k,e", [(1, 8, 64), (64, 8, 64), (1, 16, 896), (64, 16, 896), (128, 16, 896), (256, 8, 512), (7, 3, 4096)]
)
def test_triton_route_matches_definition_and_torch(n, k, e, monkeypatch):
    from k3.ops.moe.triton_route import moe_route

    keep_kernel_plan(monkeypatch)
    backend.set_kernels("moe_route=torch")  # _route: the torch form
    g = torch.Generator(device=DEV).manual_seed(n * e)
    idx = torch.rand(n, e, device=DEV, generator=g).topk(k).indices  # distinct experts per token, as routed
    got = moe_route(idx, e)
    assert_routing(idx.cpu(), e, *(t.cpu() for t in got))
    assert all(torch.equal(a, b) for a, b in zip(got, grouped._route(idx, e)))


def test_moe_experts_with_the_routing_kernel(monkeypatch):
    torch.manual_seed(0)
    n, k, e, d, i = 64, 8, 64, 256, 128
    x = torch.randn(n, d, device=DEV, dtype=torch.bfloat16)
    idx = torch.rand(n, e, device=DEV).topk(k).indices
    weight = torch.rand(n, k, device=DEV)
    w1, w3 = (torch.randn(e, i, d, device=DEV, dtype=torch.bfloat16) * d**-0.5 for _ in range(2))
    w2 = torch.randn(e, d, i, device=DEV, dtype=torch.bfloat16) * i**-0.5

    def glu(a, b):
        return torch.nn.functional.silu(a.float()) * b.float()

    with torch.no_grad():
        keep_kernel_plan(monkeypatch)
        backend.set_kernels("moe_route=torch")
        want = grouped.moe_experts(x, idx, weight, w1, w2, w3, glu)
        backend.set_kernels(None)  # the default: the kernel
        assert grouped.route_kernel(idx, e) == "triton"  # so the comparison is not with itself
        got = grouped.moe_experts(x, idx, weight, w1, w2, w3, glu)
    assert torch.equal(got, want)


def test_triton_route_fill_never_overwrites_a_pair():
    """The -1 fill of 4096 * 8 + P rows and the pairs' rows are written by different threads of one block, ordered
    by a barrier: repeated launches (a race shows only sometimes) must each hold every pair at its row."""
    from k3.ops.moe.triton_route import moe_route

    g = torch.Generator(device=DEV).manual_seed(1)
    idx = torch.rand(128, 4096, device=DEV, generator=g).topk(16).indices  # 2048 pairs: 8 warps
    want = torch.arange(idx.numel(), device=DEV)
    for _ in range(200):
        rows, src, _ = moe_route(idx, 4096)
        assert torch.equal(src[rows.reshape(-1)], want) and int((src >= 0).sum()) == idx.numel()
