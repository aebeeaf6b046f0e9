"""The Triton small-groups expert matmul (k3.ops.moe.small_groups) and its selection in k3.ops.moe.grouped.

On a machine with Triton but no GPU, the kernel runs in Triton's interpreter (in a subprocess: TRITON_INTERPRET is
read when the kernel is defined) against a float64 per-group product, for several block shapes: groups larger than
one pass of BLOCK_M rows, empty groups, widths that are not multiples of the blocks; then the custom op's fake
function (torch.library.opcheck) and a compiled caller without graph breaks. The interpreter mishandles
bf16 dot products, so this check runs in fp16; bf16 on the GPU: tests/gpu/test_fast_paths.py."""

import logging
import textwrap

import pytest
import torch

from k3.ops import backend
from k3.ops.moe import grouped
from tests.ops.kernel_switch import check_kernel_switch, keep_kernel_plan

CPU = torch.device("cpu")

ROUTED = textwrap.dedent("""
    import torch
    from k3.ops.moe import grouped, small_groups as sg

    torch.manual_seed(0)
    n, k, e, d, i = 30, 3, 6, 200, 72  # d, i: not multiples of the blocks
    idx = torch.rand(n, e).topk(k).indices
    idx[:, 0] = 1  # expert 1: 30+ rows, two or more passes of 16
    idx[idx == 4] = 5  # expert 4: no rows
    route = grouped._route(idx, e)
""")  # the routing both kernels' scripts start from

INTERPRETED = ROUTED + textwrap.dedent("""
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


INTERPRETED_GLU = ROUTED + textwrap.dedent("""
    import triton

    def act(kind, g, u, beta=3.0, lb=20.0):  # float64, from the definitions (k3.model.activation)
        if kind == "silu":
            return g * torch.sigmoid(g) * u
        return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lb * torch.tanh(u / lb)

    x = (torch.randn(n, d) * 2).half()
    w1, w3 = ((torch.randn(e, i, d) * 3 * d ** -0.5).half() for _ in range(2))  # |g|, |u| up to ~10: tanh bends
    src, ends = route.src_pair, route.offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    data = (src >= 0).nonzero().flatten()
    tok = src[data] // k
    expert = torch.bucketize(data, ends, right=True)  # the group of each data row
    g = torch.einsum("rd,rid->ri", x[tok].double(), w1[expert].double()).half().double()  # rounded as apart
    u = torch.einsum("rd,rid->ri", x[tok].double(), w3[expert].double()).half().double()
    pad = torch.tensor([r for r in range(int(ends[-1])) if src[r] < 0])
    assert len(pad) > 0 and ends[4] == starts[4]
    for kind in ("silu", "situ"):
        want = act(kind, g, u)
        for bn, bk in [(32, 64), (64, 128), (128, 32)]:
            sg._small_groups_glu_kernel = triton.autotune([triton.Config({"BLOCK_N": bn, "BLOCK_K": bk})],
                                                          key=["N"])(sg._small_groups_glu_kernel.fn)
            h = sg.small_groups_glu(x, src, k, w1, w3, route.offs, kind, 3.0, 20.0)
            err = ((h[data].double() - want).norm() / want.norm()).item()
            assert err <= 2e-3, (kind, bn, bk, err)  # fp16 output rounding (2^-11) and the fp32 tanh / sigmoid
            assert (h[pad] == 0).all(), (kind, bn, bk)  # padding rows: act(0, 0)
    # the custom op: its fake function agrees with the kernel, and a compiled caller keeps it in its graph
    rows = src[:int(ends[-1])]  # every row written (the op's checks compare whole outputs)
    args = (x, rows, k, w1, w3, route.offs, "situ", 4.0, 25.0)
    checks = torch.library.opcheck(torch.ops.k3.small_groups_glu.default, args)
    assert all(v == "SUCCESS" for v in checks.values()), checks
    caller = lambda a: sg.small_groups_glu(a * 2, *args[1:]).float().sum(-1)  # noqa: E731
    assert torch._dynamo.explain(caller)(x).graph_break_count == 0
    assert torch.equal(torch.compile(caller, backend="aot_eager")(x), caller(x))
    print("ok")
""")


def test_fused_up_glu_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED_GLU)


def test_up_glu_selection(monkeypatch, caplog):
    """The fused kernel unless K3_KERNELS=moe_up_glu=torch or Triton is not usable, and then only on the GPU (or in
    Triton's
    interpreter) and for a named GLU (not QAT's composed one, nor a bare function), the reason logged once; a bad
    value, or triton without Triton, is one clear error; the choice traces without a graph break for either kind of
    GLU."""
    from k3.model.activation import make_glu, swiglu

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs kernels on CPU tensors
    check_kernel_switch(monkeypatch, "moe_up_glu", lambda: grouped.up_glu_kernel(make_glu("situ"), CPU))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(grouped, "_glu_logged", set())
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert grouped.up_glu_kernel(make_glu("situ"), CPU) == "torch"  # CPU tensors
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs kernels on CPU tensors
        assert grouped.up_glu_kernel(make_glu("situ", 3.0, 20.0), CPU) == "triton"
        assert grouped.up_glu_kernel(make_glu("silu"), CPU) == "triton"
        assert grouped.up_glu_kernel(swiglu, CPU) == "torch"
        assert grouped.up_glu_kernel(lambda g, u: swiglu(g, u) * 2, CPU) == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "moe_experts: up-projection and GLU by the row gather, two matmuls and the GLU apart: the experts are not on "
        "a GPU",
        "moe_experts: up-projection and GLU by one Triton launch (k3.ops.moe.small_groups.small_groups_glu)",
        "moe_experts: up-projection and GLU by the row gather, two matmuls and the GLU apart: the GLU is not a "
        "named form (k3.model.activation.GLU), e.g. QAT's quantised one",
    ]

    def quantized_glu(g, u):  # as k3.ops.moe composes QAT's
        return swiglu(g, u).round()

    for glu in (make_glu("situ"), quantized_glu):
        want = grouped.up_glu_kernel(glu, CPU)
        explained = torch._dynamo.explain(lambda t: t * 2 if grouped.up_glu_kernel(glu, CPU) == "triton" else t * 3)(
            torch.ones(2)
        )
        assert explained.graph_count == 1 and explained.graph_break_count == 0, (want, explained.break_reasons)


def test_selection(monkeypatch):
    """By default the Triton kernel where Triton is usable (else grouped_mm), only without gradients and for at
    most COUNT_PAIRS pairs; grouped_mm when asked for (K3_KERNELS=moe_small_groups=grouped_mm)."""
    keep_kernel_plan(monkeypatch)
    for have in (True, False):
        backend.set_kernels(None, triton=have)
        assert grouped._experts_matmul(64, needs_grad=False) == ("triton" if have else "grouped_mm")
        assert grouped._experts_matmul(64, needs_grad=True) == "grouped_mm"
        assert grouped._experts_matmul(grouped.COUNT_PAIRS + 1, needs_grad=False) == "grouped_mm"
    backend.set_kernels("moe_small_groups=grouped_mm", triton=True)
    assert grouped._experts_matmul(64, needs_grad=False) == "grouped_mm"
    backend.set_kernels("moe_small_groups=triton")
    assert grouped._experts_matmul(64, needs_grad=False) == "triton"
    assert grouped._experts_matmul(64, needs_grad=True) == "grouped_mm"


def test_rejects_mismatched_inputs():
    sg = pytest.importorskip("k3.ops.moe.small_groups")
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not match"):
        sg.small_groups_mm(x, torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.tensor([8, 8]))
    with pytest.raises(ValueError, match="do not match"):
        sg.small_groups_mm(x.float(), torch.zeros(2, 4, 16), torch.tensor([8, 8]))
    w, src, offs = torch.zeros(2, 4, 16, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.long), torch.tensor([8, 8])
    for args in [
        (x, src, 1, w, w[:, :2], offs, "situ"),
        (x, src.int(), 1, w, w, offs, "situ"),
        (x, src, 0, w, w, offs, "situ"),
        (x, src, 1, w, w, offs, "gelu"),
        (x.float(), src, 1, w, w, offs, "silu"),
    ]:
        with pytest.raises(ValueError, match="small_groups_glu: .* do not match"):
            sg.small_groups_glu(*args, 4.0, 25.0)


def test_block_m_covers_large_groups():
    """BLOCK_M covers mu + 4 sqrt(mu) rows (mu: pairs per expert), so that at decode a group just above the average
    takes one pass: 32 at B=64 (k=8, E=64: mu = 8, groups of 24 occur); 16 at B=16 and B=1; 64 at most."""
    sg = pytest.importorskip("k3.ops.moe.small_groups")
    rows = lambda b, k, e: b * k + grouped.ALIGN * e  # noqa: E731  (the routed buffer's rows)
    assert [sg.block_m(rows(b, 8, 64), 64) for b in (1, 16, 64, 128, 256, 1024)] == [16, 16, 32, 32, 64, 64]
    assert sg.block_m(rows(16, 16, 896), 896) == 16  # K3's router at B=16
    # unpadded groups (the packed-experts kernel's): rows are the pairs alone, the same mu
    assert [sg.block_m(b * 8, 64, align=1) for b in (1, 16, 64, 128, 256, 1024)] == [16, 16, 32, 32, 64, 64]
    assert sg.block_m(512 * 16, 896, align=1) == 32  # K3 at B=512: mu = 9.1; taken as padded it would be 16
    assert sg.block_m(512 * 16, 896) == 16
