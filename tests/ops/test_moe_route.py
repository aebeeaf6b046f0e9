"""The Triton routing program (k3.ops.moe.triton_route) and its selection in k3.ops.moe.grouped._route.

On a machine with Triton but no GPU the program runs in Triton's interpreter (a subprocess: TRITON_INTERPRET is read
when a kernel is defined). Its routing is checked against the definition (every pair's row holds that pair; each
expert's rows are its pairs in pair order, from the end of the previous expert's group padded to ALIGN; every
other row is -1; the offsets are the padded counts' cumulative sums) and must equal the torch form's exactly; then
the custom op's fake function (opcheck) and a compiled caller of _route without graph breaks. The torch form is
checked against the same definition on CPU."""

import logging

import pytest
import torch

from k3.ops import backend
from k3.ops.moe import grouped
from tests.ops.kernel_switch import check_kernel_switch, keep_kernel_plan

INTERPRETED = """
import os
import torch
from torch._dynamo.utils import counters
from k3.ops import backend
from k3.ops.moe import grouped
from k3.ops.moe.triton_route import moe_route
from tests.ops.test_moe_route import assert_routing

backend.set_kernels("moe_route=torch", triton=True)  # grouped._route: the torch form

def check(idx, e, align=grouped.ALIGN):
    got = moe_route(idx, e, align)
    assert_routing(idx, e, *got, align=align)
    for a, b in zip(got, grouped._route(idx, e, align)):  # and the torch form's, exactly
        assert torch.equal(a, b)

torch.manual_seed(0)
for n, k, e in [(1, 8, 64), (64, 8, 64), (1, 16, 896), (64, 16, 896), (5, 3, 7), (3, 2, 4096), (1, 1, 1)]:
    check(torch.stack([torch.randperm(e)[:k] for _ in range(n)]), e)  # distinct experts per token, as routed
check(torch.randint(0, 5, (100, 7)), 6)  # repeats within a token too, expert 5 unused; 700 pairs: 1024 lanes
check(torch.randint(0, 896, (64, 16)), 896, align=1)  # unpadded groups (the packed-experts kernel's)
check(torch.full((40, 4), 2), 3)  # every pair on one expert
check(torch.zeros(0, 4, dtype=torch.long), 8)  # no token: offsets 0, every row -1
check(torch.randint(0, 512, (256, 8)), 512)  # COUNT_PAIRS pairs exactly
# the custom op: its fake function agrees with the kernel; a compiled _route keeps the launch in its graph
idx = torch.randint(0, 20, (9, 4))
checks = torch.library.opcheck(torch.ops.k3.moe_route.default, (idx, 20))
assert all(v == "SUCCESS" for v in checks.values()), checks
route = lambda t: grouped._route(t % 20, 20)  # noqa: E731
want = route(idx)  # the torch form
backend.set_kernels(None)  # the default: the kernel (Triton's interpreter stands in for a GPU)
assert all(torch.equal(a, b) for a, b in zip(route(idx), want))  # eager first: it logs
counters.clear()
explained = torch._dynamo.explain(route)(idx)
assert explained.graph_break_count == 0 and not counters["graph_break"], explained.break_reasons
assert "k3.moe_route" in "\\n".join(g.code for g in explained.graphs)
assert all(torch.equal(a, b) for a, b in zip(torch.compile(route, backend="eager")(idx), want))
print("ok")
"""


def assert_routing(idx, e, rows, src, offs, align=grouped.ALIGN):
    """The routing of the pairs idx [N, k] over e experts, groups padded to ``align``, checked against its
    definition."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    padded = (torch.bincount(flat, minlength=e) + align - 1) // align * align
    assert offs.dtype == torch.int32 and offs.tolist() == padded.cumsum(0).tolist(), (offs, padded)
    assert src.shape == (n * k + align * e,) and rows.shape == (n, k) and rows.dtype == src.dtype == torch.int64
    assert torch.equal(src[rows.reshape(-1)], torch.arange(n * k)), "a pair's row holds another pair"
    assert int((src == -1).sum()) == src.numel() - n * k, "rows that are neither a pair nor -1"
    begin = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
    for g in range(e):
        mine = (flat == g).nonzero().flatten()  # expert g's pairs, in pair order
        want = torch.arange(len(mine)) + begin[g]
        assert torch.equal(rows.reshape(-1)[mine], want), (g, rows.reshape(-1)[mine], want)


def test_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED)


def _pairs(p):
    return torch.zeros(p, 1, dtype=torch.long)


def test_selection(monkeypatch, caplog):
    """The kernel unless K3_KERNELS=moe_route=torch or Triton is not usable; torch still off the GPU (but for Triton's
    interpreter), above COUNT_PAIRS pairs or ROUTE_MAX_EXPERTS experts, with the reason logged once; a bad value, or
    triton without Triton, is one clear error."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs kernels on CPU tensors
    check_kernel_switch(monkeypatch, "moe_route", lambda: grouped.route_kernel(_pairs(64), 64))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(grouped, "_route_logged", set())
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert grouped.route_kernel(_pairs(64), 64) == "torch"  # CPU tensors
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs kernels on CPU tensors
        assert grouped.route_kernel(_pairs(grouped.COUNT_PAIRS), grouped.ROUTE_MAX_EXPERTS) == "triton"
        assert grouped.route_kernel(_pairs(grouped.COUNT_PAIRS + 1), 64) == "torch"
        assert grouped.route_kernel(_pairs(64), grouped.ROUTE_MAX_EXPERTS + 1) == "torch"
        assert grouped.route_kernel(_pairs(8), 8) == "triton"  # logged once
    assert [r.getMessage() for r in caplog.records] == [
        "moe_experts: routing by torch: the routing is not on a GPU",
        "moe_experts: routing by one Triton program (k3.ops.moe.triton_route)",
        f"moe_experts: routing by torch: more than {grouped.COUNT_PAIRS} token-expert pairs",
        f"moe_experts: routing by torch: more than the kernel's {grouped.ROUTE_MAX_EXPERTS} experts",
    ]


def test_torch_form(monkeypatch):
    """The torch form (any device) against the definition: the counting branch and the argsort one."""
    keep_kernel_plan(monkeypatch)
    backend.set_kernels("moe_route=torch")
    torch.manual_seed(0)
    for idx, e in [
        (torch.randint(0, 50, (200, 8)), 50),
        (torch.randint(0, 50, (300, 8)), 50),  # 1600, 2400 pairs
        (torch.full((300, 8), 3), 5),
        (torch.zeros(0, 4, dtype=torch.long), 8),
    ]:
        assert_routing(idx, e, *grouped._route(idx, e))
        assert_routing(idx, e, *grouped._route(idx, e, align=1), align=1)


def test_rejects_bad_inputs():
    tr = pytest.importorskip("k3.ops.moe.triton_route")
    for idx, e in [
        (torch.zeros(4, 2, dtype=torch.int32), 8),
        (torch.zeros(8, dtype=torch.long), 8),
        (torch.zeros(grouped.COUNT_PAIRS + 1, 1, dtype=torch.long), 8),
        (torch.zeros(2, 2, dtype=torch.long), 0),
        (torch.zeros(2, 2, dtype=torch.long), grouped.ROUTE_MAX_EXPERTS + 1),
    ]:
        with pytest.raises(ValueError, match="moe_route: .* do not match"):
            tr.moe_route(idx, e)
