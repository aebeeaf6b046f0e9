"""The Triton small-groups expert matmul (k3.ops.moe.small_groups) and its selection in k3.ops.moe.grouped.

On a machine with Triton but no GPU, the kernel runs in Triton's interpreter (in a subprocess: TRITON_INTERPRET is
read when the kernel is defined) against a float64 per-group product, for several block shapes: groups larger than
one pass of BLOCK_M rows, empty groups, widths that are not multiples of the blocks; then the custom op's fake
function (torch.library.opcheck) and a compiled caller without graph breaks. The interpreter mishandles
bf16 dot products, so this check runs in fp16; bf16 on the GPU: tests/gpu/test_fast_paths.py."""

import textwrap

import pytest
import torch

from k3.ops.moe import grouped

INTERPRETED = textwrap.dedent("""
    import torch
    from k3.ops.moe import grouped, small_groups as sg

    torch.manual_seed(0)
    n, k, e, d, i = 30, 3, 6, 200, 72  # d, i: not multiples of the blocks
    idx = torch.rand(n, e).topk(k).indices
    idx[:, 0] = 1  # expert 1: 30+ rows, two or more passes of 16
    idx[idx == 4] = 5  # expert 4: no rows
    route = grouped._route(idx, e)
    x = torch.randn(route.src_pair.numel(), d).half()
    w = (torch.randn(e, i, d) * d ** -0.5).half()
    ends = route.offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    assert ends[4] == starts[4] and ends[1] - starts[1] >= 32
    for bm, bn, bk in [(16, 32, 64), (16, 64, 128), (32, 128, 32)]:
        y = torch.full((x.shape[0], i), float("nan")).half()
        sg._run(sg._small_groups_kernel.fn, x, w, route.offs, y, bm, BLOCK_N=bn, BLOCK_K=bk)
        for g in range(e):
            a, b = int(starts[g]), int(ends[g])
            if b > a:
                want = x[a:b].double() @ w[g].double().T
                err = ((y[a:b].double() - want).norm() / want.norm()).item()
                assert err <= 1e-3, (bm, bn, bk, g, err)  # fp16 output rounding: 2^-11 per element; NaN fails
        assert y[int(ends[-1]):].isnan().all()  # rows after the last group are not written
    # the custom op: its fake (meta) function agrees with the kernel, and a compiled caller keeps it in its graph
    import triton
    sg._small_groups_kernel = triton.autotune([triton.Config({"BLOCK_N": 32, "BLOCK_K": 64})], key=["N"])(
        sg._small_groups_kernel.fn)  # one config: the interpreter cannot benchmark the autotuner's
    xs = x[:int(ends[-1])]  # every row written (the op's checks compare whole outputs)
    checks = torch.library.opcheck(torch.ops.k3.small_groups_mm.default, (xs, w, route.offs))
    assert all(v == "SUCCESS" for v in checks.values()), checks
    caller = lambda a: sg.small_groups_mm(a * 2, w, route.offs).float().sum(-1)  # noqa: E731
    assert torch._dynamo.explain(caller)(xs).graph_break_count == 0
    assert torch.equal(torch.compile(caller, backend="aot_eager")(xs), caller(xs))
    print("ok")
""")


def test_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED)


def test_selection(monkeypatch):
    """Unset: the Triton kernel where Triton is usable (else grouped_mm), only without gradients and for at most
    COUNT_PAIRS pairs; grouped_mm when asked for; a bad value, or triton without Triton, is one clear error."""
    monkeypatch.delenv("K3_MOE_SMALL_GROUPS", raising=False)
    for have in (True, False):
        monkeypatch.setattr(grouped, "_have_triton", lambda: have)
        assert grouped._experts_matmul(64, needs_grad=False) == ("triton" if have else "grouped_mm")
        assert grouped._experts_matmul(64, needs_grad=True) == "grouped_mm"
        assert grouped._experts_matmul(grouped.COUNT_PAIRS + 1, needs_grad=False) == "grouped_mm"
    monkeypatch.setattr(grouped, "_have_triton", lambda: True)
    monkeypatch.setenv("K3_MOE_SMALL_GROUPS", "grouped_mm")
    assert grouped._experts_matmul(64, needs_grad=False) == "grouped_mm"
    monkeypatch.setenv("K3_MOE_SMALL_GROUPS", "triton")
    assert grouped._experts_matmul(64, needs_grad=False) == "triton"
    assert grouped._experts_matmul(64, needs_grad=True) == "grouped_mm"
    monkeypatch.setattr(grouped, "_have_triton", lambda: False)
    with pytest.raises(ValueError, match="K3_MOE_SMALL_GROUPS=triton needs Triton, which is not installed"):
        grouped._experts_matmul(64, needs_grad=False)
    monkeypatch.setenv("K3_MOE_SMALL_GROUPS", "cutlass")
    with pytest.raises(ValueError, match="K3_MOE_SMALL_GROUPS='cutlass' must be one of grouped_mm, triton"):
        grouped._experts_matmul(64, needs_grad=False)


def test_rejects_mismatched_inputs():
    sg = pytest.importorskip("k3.ops.moe.small_groups")
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not match"):
        sg.small_groups_mm(x, torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.tensor([8, 8]))
    with pytest.raises(ValueError, match="do not match"):
        sg.small_groups_mm(x.float(), torch.zeros(2, 4, 16), torch.tensor([8, 8]))
