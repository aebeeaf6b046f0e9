"""A KDA decode step's input maps and short convs (k3.ops.linear.multi_linear_conv) and their opt-in one-launch
kernel (k3.ops.linear.triton_multi.multi_linear_conv).

Off the kernel it is multi_linear, then causal_conv1d_steps of the first three outputs: checked against F.linear and
the conv reference's step, outputs and state pools. The chooser: the kernel only with K3_MAPS_CONV=triton and where
both parts' own kernels would run. In Triton's interpreter (fp16 inputs: the interpreter's bf16 matrix products are
wrong), the kernel against the two kernels it fuses run one after the other: every output and every pool row
equal to the bit (the same products, rounded to fp16 before the conv as when stored; the same fp32 window sums in
tap order), widths 2..4 (the kernel's range), rows in several passes and slots in any order; then the custom op's
fake function and a compiled caller without graph breaks. On the GPU: tests/gpu/test_multi_linear_kernel.py.
"""

import logging
import textwrap

import pytest
import torch
import torch.nn.functional as F

from k3.ops import linear
from k3.ops.conv.reference import causal_conv1d_step
from k3.ops.moe import grouped


def test_without_the_kernel_it_is_the_maps_then_the_conv_steps():
    torch.manual_seed(0)
    m, k, sizes, width = 5, 32, (24, 24, 16, 8, 3, 8), 4
    x = torch.randn(m, k)
    ws = [torch.randn(n, k) for n in sizes]
    cws = [torch.randn(n, width) for n in sizes[:3]]
    states = [torch.randn(9, n, width - 1) for n in sizes[:3]]
    slots = torch.tensor([7, 0, 3, 8, 1])
    want_states = [s.clone() for s in states]
    got = linear.multi_linear_conv(x, ws, cws, states=states, slots=slots, activation="silu")
    maps = [F.linear(x, w) for w in ws]
    want = [causal_conv1d_step(y, cw, state=s, slots=slots) for y, cw, s in zip(maps, cws, want_states)]
    assert all(torch.equal(a, b) for a, b in zip(got, want + maps[3:]))
    assert all(torch.equal(a, b) for a, b in zip(states, want_states))


def test_the_kernel_is_opt_in_and_needs_both_parts_kernels(monkeypatch, caplog):
    monkeypatch.setattr(linear, "_conv_logged", set())
    monkeypatch.setattr(grouped, "_have_triton", lambda: True)
    for var in ("K3_MAPS_CONV", "K3_MULTI_LINEAR", "K3_CONV_STEP"):
        monkeypatch.delenv(var, raising=False)
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    ws = [torch.zeros(n, 32, dtype=torch.bfloat16) for n in (16, 16, 8, 4)]
    cws = [torch.zeros(n, 4) for n in (16, 16, 8)]
    states = [torch.zeros(6, n, 3) for n in (16, 16, 8)]
    with caplog.at_level(logging.INFO, logger="k3.ops"), torch.no_grad():
        assert linear.conv_kernel(x, ws, cws, states, "silu") == "torch"  # unset: opt-in
        monkeypatch.setenv("K3_MAPS_CONV", "triton")
        assert linear.conv_kernel(x, ws, cws, states, "silu") == "triton"
        assert linear.conv_kernel(x, ws[:2], cws[:2], states[:2], "silu") == "torch"
        assert linear.conv_kernel(x, ws, cws, states, "relu") == "torch"
        assert linear.conv_kernel(x, ws, [cws[0], cws[1], torch.zeros(8, 3)], states, "silu") == "torch"
        assert linear.conv_kernel(x, ws, [torch.zeros(n, 5) for n in (16, 16, 8)], states, "silu") == "torch"
        monkeypatch.setenv("K3_CONV_STEP", "torch")
        assert linear.conv_kernel(x, ws, cws, states, "silu") == "torch"
        monkeypatch.delenv("K3_CONV_STEP")
        monkeypatch.setenv("K3_MULTI_LINEAR", "torch")
        assert linear.conv_kernel(x, ws, cws, states, "silu") == "torch"
        monkeypatch.delenv("K3_MULTI_LINEAR")
    assert linear.conv_kernel(x, ws, cws, states, "silu") == "triton"  # grad mode, nothing to differentiate
    assert linear.conv_kernel(x, [ws[0].requires_grad_()] + ws[1:], cws, states, "silu") == "torch"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("multi_linear_conv:")]
    head, off = "multi_linear_conv: ", "multi_linear, then causal_conv1d_steps: "
    assert lines == [
        head + off + "K3_MAPS_CONV is not set (the kernel is opt-in until measured on a GPU: K3_MAPS_CONV=triton)",
        head + "one Triton launch (k3.ops.linear.triton_multi.multi_linear_conv)",
        head + off + "the kernel takes three convolved maps first",
        head + off + "the short conv's own kernel does not run here (its log line says why)",
        head + off + "the kernel takes three convs of one width, at most 4",
        head + off + "multi_linear's own kernel does not run here (its log line says why)"], lines


def test_kernel_rejects_bad_inputs():
    tm = pytest.importorskip("k3.ops.linear.triton_multi")
    x, ws = torch.zeros(3, 32).half(), [torch.zeros(n, 32).half() for n in (8, 8, 4, 2)]
    cws, ss, slots = [torch.zeros(n, 4) for n in (8, 8, 4)], [torch.zeros(5, n, 3) for n in (8, 8, 4)], torch.arange(3)
    bad = [(ws[:2], cws, ss, slots), (ws, [cws[0], cws[1], torch.zeros(4, 1)], ss, slots),
           (ws, cws, [ss[0], ss[1], torch.zeros(5, 4, 2)], slots), (ws, cws, ss, slots[:2]),
           (ws, cws, [ss[0], ss[1], torch.zeros(5, 3, 4).transpose(1, 2)], slots), (ws, cws, ss, slots.float()),
           (ws, [torch.zeros(n, 5) for n in (8, 8, 4)], [torch.zeros(5, n, 4) for n in (8, 8, 4)], slots)]
    for w, c, s, sl in bad:
        with pytest.raises(ValueError, match="multi_linear_conv: .* do not match"):
            tm.multi_linear_conv(x, w, *c, *s, sl, True)


INTERPRETED = textwrap.dedent("""
    import torch
    from torch._dynamo.utils import counters
    from k3.ops.conv import triton_step
    from k3.ops.linear import triton_multi as tm

    torch.manual_seed(0)
    cases = [(1, (96, 32, 40, 16, 5, 64), 64, 4, torch.float32), (70, (40, 40, 24, 8), 32, 3, torch.float16),
             (6, (16, 16, 16), 48, 2, torch.float32)]  # 70 rows: two passes of 64
    for m, sizes, k, width, state_dtype in cases:
        x = torch.randn(m, k).half()
        ws = [(torch.randn(n, k) / k ** 0.5).half() for n in sizes]
        cws = [torch.randn(n, width) for n in sizes[:3]]
        pools = [torch.randn(m + 5, n, width - 1).to(state_dtype) for n in sizes[:3]]
        slots = torch.randperm(m + 5)[:m]
        for silu in (True, False):
            mine = [p.clone() for p in pools]
            got = tm.multi_linear_conv(x, ws, *cws, *mine, slots, silu)
            assert len(got) == 8 and all(t.shape == (m, 0) for t in got[len(ws):])
            got = got[:len(ws)]
            theirs = [p.clone() for p in pools]
            maps = tm.multi_linear(x, ws)
            want = list(triton_step.conv_steps(*maps[:3], *cws, *theirs, slots, silu)) + maps[3:]
            for a, b in zip(got, want):
                err = (a.float() - b.float()).abs().max()
                assert a.dtype == b.dtype and torch.equal(a, b), (m, sizes, width, silu, err)
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (m, sizes, width, silu)
            assert not all(torch.equal(a, b) for a, b in zip(mine, pools))  # the pools did move
    x = torch.randn(4, 32).half()
    ws = [torch.randn(n, 32).half() for n in (16, 16, 8, 4)]
    cws, pools = [torch.randn(n, 4) for n in (16, 16, 8)], [torch.randn(6, n, 3) for n in (16, 16, 8)]
    slots = torch.tensor([5, 0, 2, 3])
    checks = torch.library.opcheck(torch.ops.k3.multi_linear_conv.default, (x, ws, *cws, *pools, slots, True))
    assert all(r == "SUCCESS" for r in checks.values()), checks
    caller = lambda t: [y * 2 for y in tm.multi_linear_conv(t + 1, ws, *cws, *pools, slots, True)[:4]]  # noqa: E731
    counters.clear()
    explained = torch._dynamo.explain(caller)(x)
    assert explained.graph_break_count == 0 and not counters["graph_break"], explained.break_reasons
    assert "k3.multi_linear_conv" in "\\n".join(g.code for g in explained.graphs)
    print("ok")
""")


def test_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED)
