"""The short causal conv: the reference (packed segments) and the flat form (one conv over the stream, the first
outputs of each segment recomputed; the default path), each against a plain fp64 per-token loop and the
segment-by-segment runs."""

import logging
import textwrap

import pytest
import torch
import torch.nn.functional as F

from k3.ops.conv.flat import causal_conv1d as flat_conv
from k3.ops.conv.reference import causal_conv1d as reference_conv
from tests.ops.test_kda_reference import check


@pytest.fixture(params=["reference", "flat"])
def conv(request):
    return {"reference": reference_conv, "flat": flat_conv}[request.param]


def truth_conv(x, weight, initial_state=None, activation="silu"):
    """fp64 loop over tokens: y_t = act(sum_i w[:, i] * x_{t-(W-1)+i}); returns (y, last W-1 inputs)."""
    x, weight = x.detach().double(), weight.detach().double()
    B, T, C = x.shape
    W = weight.shape[1]
    y = torch.zeros(B, T, C, dtype=torch.float64)
    finals = []
    for b in range(B):
        past = torch.zeros(W - 1, C, dtype=torch.float64)
        if initial_state is not None:
            past = initial_state[b].detach().double().T  # [W-1, C], oldest first
        seq = torch.cat([past, x[b]])  # token t at row W-1+t
        for t in range(T):
            acc = torch.zeros(C, dtype=torch.float64)
            for i in range(W):
                acc = acc + weight[:, i] * seq[t + i]
            y[b, t] = F.silu(acc) if activation == "silu" else acc
        finals.append(seq[len(seq) - (W - 1) :].T)
    return y, torch.stack(finals)


def make(B, T, C, W=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen)
    weight = torch.randn(C, W, generator=gen) / W**0.5
    s0 = torch.randn(B, C, W - 1, generator=gen)
    return x, weight, s0


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_state", [True, False])
def test_against_loop(activation, with_state, conv):
    x, weight, s0 = make(2, 23, 6)
    s0 = s0 if with_state else None
    y_ref, f_ref = truth_conv(x, weight, s0, activation)
    y, f = conv(x, weight, initial_state=s0, output_final_state=True, activation=activation)
    assert y.dtype == x.dtype and f.shape == (2, 6, 3)
    check(f"conv y [{activation}, state={with_state}]", y, y_ref, 1e-6)
    check(f"conv final state [{activation}, state={with_state}]", f, f_ref, 1e-7)
    assert conv(x, weight)[1] is None


@pytest.mark.parametrize("W", [2, 4, 5])
def test_kernel_widths(W, conv):
    x, weight, s0 = make(1, 9, 3, W=W, seed=1)
    y_ref, f_ref = truth_conv(x, weight, s0)
    y, f = conv(x, weight, initial_state=s0, output_final_state=True)
    check(f"conv y [W={W}]", y, y_ref, 1e-6)
    check(f"conv final state [W={W}]", f, f_ref, 1e-7)


@pytest.mark.parametrize("t1", [1, 2, 3, 10, 19])
def test_state_continuation(t1, conv):
    x, weight, s0 = make(2, 20, 5, seed=2)
    y_full, f_full = conv(x, weight, initial_state=s0, output_final_state=True)
    y1, f1 = conv(x[:, :t1], weight, initial_state=s0, output_final_state=True)
    y2, f2 = conv(x[:, t1:], weight, initial_state=f1, output_final_state=True)
    check(f"continuation y [t1={t1}]", torch.cat([y1, y2], 1), y_full, 1e-7)
    check(f"continuation state [t1={t1}]", f2, f_full, 0.0)


def test_short_sequence_keeps_old_state(conv):
    x, weight, s0 = make(1, 2, 4, seed=3)  # T = 2 < W - 1 = 3
    _, f = conv(x, weight, initial_state=s0, output_final_state=True)
    expected = torch.cat([s0[:, :, 2:], x.transpose(1, 2)], dim=-1)
    assert torch.equal(f, expected)


def test_cu_seqlens_equals_separate_runs(conv):
    lengths = [7, 1, 2, 12, 4]
    x, weight, _ = make(1, sum(lengths), 5, seed=4)
    s0 = torch.randn(len(lengths), 5, 3, generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0] + lengths).cumsum(0)
    y, f = conv(x, weight, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    assert y.shape == x.shape and f.shape == (len(lengths), 5, 3)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_n, f_n = conv(x[:, a:b], weight, initial_state=s0[n : n + 1], output_final_state=True)
        check(f"varlen y [seg {n}]", y[:, a:b], y_n, 1e-7)
        check(f"varlen state [seg {n}]", f[n : n + 1], f_n, 0.0)
        y_t, f_t = truth_conv(x[:, a:b], weight, s0[n : n + 1])
        check(f"varlen y vs loop [seg {n}]", y[:, a:b], y_t, 1e-6)


def test_dtypes(conv):
    x, weight, s0 = make(1, 8, 4, seed=6)
    y, f = conv(x.bfloat16(), weight, initial_state=s0, output_final_state=True)
    assert y.dtype == torch.bfloat16 and f.dtype == torch.float32


def test_gradcheck(conv):
    x, weight, s0 = (t.double().requires_grad_() for t in make(2, 6, 3, seed=7))

    def f(x, weight, s0):
        return conv(x, weight, initial_state=s0, output_final_state=True)

    assert torch.autograd.gradcheck(f, (x, weight, s0))

    x1 = torch.randn(1, 7, 3, dtype=torch.float64, requires_grad=True)
    s1 = torch.randn(3, 3, 3, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 3, 7])

    def g(x, weight, s0):
        return conv(x, weight, initial_state=s0, output_final_state=True, cu_seqlens=cu)

    assert torch.autograd.gradcheck(g, (x1, weight, s1))


def test_invalid_arguments(conv):
    x, weight, s0 = make(2, 10, 4, seed=8)
    with pytest.raises(ValueError):
        conv(x, weight, cu_seqlens=torch.tensor([0, 4, 10]))  # B > 1
    with pytest.raises(ValueError):
        conv(x, weight, initial_state=s0[:1])  # N != B
    with pytest.raises(ValueError):
        conv(x[:1], weight, initial_state=s0, cu_seqlens=torch.tensor([0, 3, 6, 10]))  # N != segments
    with pytest.raises(ValueError):
        conv(x, weight, activation="relu")


def test_step_extends_the_pool_like_the_full_conv():
    """causal_conv1d_step token by token over a slot pool == one causal_conv1d over the whole sequences."""
    from k3.ops.conv.reference import causal_conv1d_step

    gen = torch.Generator().manual_seed(3)
    N, T, C, W = 2, 6, 5, 4
    x, weight = torch.randn(N, T, C, generator=gen), torch.randn(C, W, generator=gen)
    init = torch.randn(N, C, W - 1, generator=gen)
    y_ref, final_ref = truth_conv(x, weight, init)
    pool = torch.randn(4, C, W - 1, generator=gen)
    slots = torch.tensor([2, 0])
    pool[slots] = init
    spare = pool[[1, 3]].clone()
    ys = [causal_conv1d_step(x[:, t], weight, state=pool, slots=slots) for t in range(T)]
    check("conv step outputs", torch.stack(ys, 1), y_ref, 1e-6)
    check("conv step state", pool[slots], final_ref, 1e-6)
    assert torch.equal(pool[[1, 3]], spare)


def test_flat_equals_reference_on_packed_documents_without_state():
    """The training case: documents shorter and longer than W-1 packed back to back, no history; outputs and
    gradients of the flat form equal the reference's (fp64)."""
    lengths = [1, 2, 9, 3, 1, 6]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, sum(lengths), 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    cu = torch.tensor([0] + lengths).cumsum(0)
    grad = torch.randn(1, sum(lengths), 5, dtype=torch.float64, generator=gen)
    results = []
    for impl in (reference_conv, flat_conv):
        y, f = impl(x, weight, cu_seqlens=cu, output_final_state=True)
        gx, gw = torch.autograd.grad((y * grad).sum() + f.sum(), (x, weight))
        results.append((y, f, gx, gw))
    for name, a, b in zip(("y", "final state", "dx", "dweight"), results[1], results[0]):
        check(f"flat vs reference {name}", a, b, 1e-13)


def test_autocast_keeps_the_documented_fp32_compute(conv):
    """Under bf16 autocast (training on a GPU; the CPU has the same conv1d rule) the conv still computes in
    promote(x.dtype, fp32): the flat form's corrections must meet an fp32 convolution, not a bf16 one."""
    lengths = [3, 1, 9, 2]
    x, weight, _ = make(1, sum(lengths), 6, seed=12)
    cu = torch.tensor([0] + lengths).cumsum(0)
    want, _ = reference_conv(x, weight, cu_seqlens=cu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = conv(x, weight, cu_seqlens=cu)
    assert got.dtype == x.dtype
    check("conv under autocast", got, want, 1e-6)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5])
def test_flat_equals_reference_on_random_segmentations(W):
    """Many random segmentations (segments shorter and longer than W-1), with and without history, fp64; the
    boundary tables cached on cu_seqlens are reused by a second call."""
    gen = torch.Generator().manual_seed(20 + W)
    for _ in range(6):
        lengths = torch.randint(1, 8, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        x = torch.randn(1, sum(lengths), 3, dtype=torch.float64, generator=gen)
        w = torch.randn(3, W, dtype=torch.float64, generator=gen)
        h = torch.randn(len(lengths), 3, W - 1, dtype=torch.float64, generator=gen)
        cu = torch.tensor([0] + lengths).cumsum(0)
        for state in (None, h):
            want = reference_conv(x, w, initial_state=state, output_final_state=True, cu_seqlens=cu)
            for _ in range(2):
                got = flat_conv(x, w, initial_state=state, output_final_state=True, cu_seqlens=cu)
                check(f"random segments W={W} y", got[0], want[0], 1e-13)
                assert torch.equal(got[1], want[1])


def test_flat_boundary_tables_are_kept_per_segments_and_inf_stays_in_its_document(monkeypatch):
    """The boundary tables are made once per Segments (the layers of a forward share them) and other offsets,
    another Segments, get their own; a non-finite input in one document does not reach the next one's outputs
    (the reference keeps them finite)."""
    from k3.ops.conv import flat
    from k3.ops.segments import Segments

    built, real = [], flat._boundary
    monkeypatch.setattr(flat, "_boundary", lambda *a: built.append(a[0]) or real(*a))
    x, weight, _ = make(1, 12, 4, seed=30)
    cu = Segments.from_host([0, 5, 12])
    first = flat_conv(x, weight, cu_seqlens=cu)[0]
    assert torch.equal(flat_conv(x, weight, cu_seqlens=cu)[0], first) and built == [[5, 7]]
    other = Segments.from_host([0, 2, 12])
    check(
        "conv after the offsets changed",
        flat_conv(x, weight, cu_seqlens=other)[0],
        reference_conv(x, weight, cu_seqlens=torch.tensor([0, 2, 12]))[0],
        1e-7,
    )
    x[0, 1] = float("inf")  # the last token of the first document
    y = flat_conv(x, weight, cu_seqlens=other)[0]
    assert torch.isfinite(y[0, 2:]).all() and built == [[5, 7], [2, 10]]


CONV_STEPS = textwrap.dedent("""
    import torch
    from torch._dynamo.utils import counters
    from k3.ops import conv
    from k3.ops.conv import reference, triton_step
    from k3.ops import backend

    torch.manual_seed(0)
    N, S = 5, 7
    slots = torch.tensor([6, 0, 3, 2, 5])
    for width, dtype, state_dtype, silu, sizes in [(4, torch.float32, torch.float32, True, (96, 300, 64)),
                                                   (4, torch.float16, torch.float16, False, (256, 256, 40)),
                                                   (3, torch.float32, torch.float16, True, (8, 513, 17)),
                                                   (2, torch.float16, torch.float32, True, (33, 1, 260))]:
        xs = [torch.randn(N, 2 * c).to(dtype)[:, ::2] if c == 96 else torch.randn(N, c).to(dtype) for c in sizes]
        ws = [torch.randn(c, width) for c in sizes]  # fp32 weights, as a bf16 model's are not: both run
        states = [torch.randn(S, c, width - 1).to(state_dtype) for c in sizes]
        got_states = [s.clone() for s in states]
        got = triton_step.conv_steps(*xs, *ws, *got_states, slots, silu)
        for i in range(3):
            want_state = states[i].clone()
            want = reference.causal_conv1d_step(xs[i], ws[i], state=want_state, slots=slots,
                                                activation="silu" if silu else None)
            assert got[i].dtype == xs[i].dtype and got[i].shape == want.shape
            err = ((got[i].float() - want.float()).norm() / want.float().norm()).item()
            assert err <= (1e-6 if dtype == torch.float32 else 1e-3), (width, dtype, i, err)  # fp16: output rounding
            assert torch.equal(got_states[i], want_state), (width, i)  # the shift and the new input, exactly
    args = (*xs, *ws, *[s.clone() for s in states], slots, True)
    checks = torch.library.opcheck(torch.ops.k3.conv_steps.default, args)
    assert all(v == "SUCCESS" for v in checks.values()), checks
    backend.set_kernels(None, triton=True)  # Triton's interpreter stands in for a GPU
    fast = lambda xs, sts: conv._steps_fast(xs, ws, states=sts, slots=slots, activation="silu")  # noqa: E731
    with torch.no_grad():
        a = [s.clone() for s in states]
        want = triton_step.conv_steps(*xs, *ws, *a, slots, True)
        b = [s.clone() for s in states]
        assert all(torch.equal(x, y) for x, y in zip(fast(xs, b), want)) and all(map(torch.equal, a, b))
        c = [s.clone() for s in states]
        counters.clear()
        explained = torch._dynamo.explain(fast)(xs, c)
    assert explained.graph_break_count == 0 and not counters["graph_break"], explained.break_reasons
    assert "k3.conv_steps" in "\\n".join(g.code for g in explained.graphs)
    print("ok")
""")


def test_conv_steps_kernel_in_triton_interpreter(triton_interpreter):
    """The three short-conv decode steps in one launch (k3.ops.conv.triton_step) against the reference's step, in
    Triton's interpreter: fp32 outputs within 1e-6 (sums in another order), fp16 within 1e-3 (the output's rounding,
    2^-11); the shifted state rows equal exactly; widths 2-4, strided inputs, channel counts off the block size; the
    custom op's schema and fake function (opcheck); the fast backend's function runs it with no graph break."""
    triton_interpreter(CONV_STEPS)


def test_fast_steps_run_the_kernel_only_without_gradients(monkeypatch, caplog):
    from k3.ops import conv
    from tests.ops.kernel_switch import check_kernel_switch

    xs = [torch.zeros(2, 8) for _ in range(3)]
    ws = [torch.zeros(8, 4, requires_grad=True) for _ in range(3)]
    pools = [torch.zeros(5, 8, 3) for _ in range(3)]
    check_kernel_switch(
        monkeypatch, "conv_step", lambda: conv.steps_kernel(xs, [w.detach() for w in ws], pools, "silu")
    )
    monkeypatch.setattr(conv, "_steps_logged", set())
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert conv.steps_kernel(xs, ws, pools, "silu") == "torch"
        with torch.no_grad():
            assert conv.steps_kernel(xs, ws, pools, "silu") == "triton"
            assert conv.steps_kernel(xs, ws, pools, None) == "triton"
            assert conv.steps_kernel(xs[:2], ws[:2], pools[:2], "silu") == "torch"
            assert conv.steps_kernel([x.double() for x in xs], ws, pools, "silu") == "torch"
            assert conv.steps_kernel(xs, ws, [p.transpose(1, 2) for p in pools], "silu") == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "causal_conv1d_steps: three torch steps (reference): a gradient is needed",
        "causal_conv1d_steps: one Triton launch (k3.ops.conv.triton_step)",
        "causal_conv1d_steps: three torch steps (reference): the kernel takes three inputs and activation silu or None",
        "causal_conv1d_steps: three torch steps (reference): fp64 inputs (the kernel computes in fp32)",
        "causal_conv1d_steps: three torch steps (reference): the kernel takes contiguous state pools and widths of at "
        "least 2",
    ]


def test_steps_equal_three_single_steps():
    """causal_conv1d_steps (on a CPU: the reference's three steps) pairs each input with its weight and pool: each
    output equals the single step and the whole-sequence conv from the pool's window, whose final state is the
    updated pool row; the other slots are untouched."""
    from k3.ops import conv
    from k3.ops.conv.reference import causal_conv1d_step

    torch.manual_seed(1)
    xs = [torch.randn(3, c) for c in (16, 16, 24)]
    ws = [torch.randn(c, 4) for c in (16, 16, 24)]
    pools = [torch.randn(5, c, 3) for c in (16, 16, 24)]
    slots = torch.tensor([4, 1, 2])
    mine = [p.clone() for p in pools]
    got = conv.causal_conv1d_steps(xs, ws, states=mine, slots=slots)
    for x, w, p, m, y in zip(xs, ws, pools, mine, got):
        whole, final = reference_conv(x[:, None], w, initial_state=p[slots], output_final_state=True)
        check("steps vs whole-sequence conv", y, whole[:, 0], 1e-6)
        check("updated pool rows vs final state", m[slots], final, 1e-6)
        assert torch.equal(m[[0, 3]], p[[0, 3]])
        assert torch.equal(y, causal_conv1d_step(x, w, state=p, slots=slots)) and torch.equal(m, p)
