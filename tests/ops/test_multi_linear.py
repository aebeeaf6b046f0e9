"""Several linear maps of one input (k3.ops.linear): the torch reference, the dispatch between it and the Triton
kernel, the kernel itself, and the KDA decode step that uses it.

On a machine with Triton but no GPU the kernel runs in Triton's interpreter (in a subprocess: TRITON_INTERPRET is
read when the kernel is defined) against the fp32 reference, in fp16 (the interpreter mishandles bf16 dot products):
relative error <= 2e-3 per output, the fp16 rounding of the outputs (2^-11 ~ 4.9e-4 per element) with room for the
products' order; observed ~2e-4. Then the custom op's fake function (torch.library.opcheck) and compiled callers of
the op and of the fast backend without graph breaks. On the GPU (bf16): tests/gpu/test_multi_linear_kernel.py.
"""

import importlib
import logging
import textwrap

import pytest
import torch
import torch.nn.functional as F

from k3.ops import backend
from k3.ops import linear
from k3.ops.linear import reference
from tests.ops.kernel_switch import check_kernel_switch


def test_reference_is_one_linear_per_weight():
    torch.manual_seed(0)
    x = torch.randn(5, 48)
    ws = [torch.randn(n, 48) for n in (16, 3, 40)]
    got = reference.multi_linear(x, ws)
    assert [tuple(y.shape) for y in got] == [(5, 16), (5, 3), (5, 40)]
    assert all(torch.equal(y, F.linear(x, w)) for y, w in zip(got, ws))


def test_reference_computes_the_last_fp32_maps_in_fp32():
    """fp32=n: the last n maps are x and the weight upcast (a router's GEMM), whatever the weight's dtype; the
    others stay in x's dtype."""
    torch.manual_seed(0)
    x = torch.randn(5, 48).bfloat16()
    ws = [torch.randn(16, 48).bfloat16(), torch.randn(8, 48).bfloat16(), torch.randn(8, 48)]
    got = reference.multi_linear(x, ws, fp32=2)
    assert [y.dtype for y in got] == [torch.bfloat16, torch.float32, torch.float32]
    assert torch.equal(got[0], F.linear(x, ws[0]))
    assert all(torch.equal(y, F.linear(x.float(), w.float())) for y, w in zip(got[1:], ws[1:]))
    for fp32 in (-1, 4):
        for fn in (reference.multi_linear, linear.multi_linear):
            with pytest.raises(ValueError, match=f"fp32={fp32} must be between 0 and the number of weights"):
                fn(x, ws, fp32=fp32)


def test_dispatch_runs_the_reference_on_cpu_and_logs_it(monkeypatch, caplog):
    """The reference on CPU (the fast backend is for CUDA devices), logged; backend=fast there is an error."""
    entry = backend._OPS["multi_linear"]
    monkeypatch.setattr(entry, "logged", set())
    x, ws = torch.randn(2, 8), [torch.randn(4, 8)]
    with caplog.at_level(logging.DEBUG, logger="k3.ops"):
        got = linear.multi_linear(x, ws)
    assert "op multi_linear runs backend reference (one torch linear per weight) on cpu" in caplog.text
    assert torch.equal(got[0], F.linear(x, ws[0]))
    backend.set_backend("fast")
    try:
        with pytest.raises(RuntimeError, match="op 'multi_linear''s fast path cannot run on cpu"):
            linear.multi_linear(x, ws)
    finally:
        backend.set_backend("auto")


def test_fast_backend_runs_the_kernel_only_where_it_fits(monkeypatch, caplog):
    """Under the fast backend: the Triton kernel where the kernel plan chose it, no gradient is needed and the
    shapes / dtypes fit; torch otherwise, each choice logged once with its reason; a bad K3_KERNELS value is one
    clear error."""
    x, ws = torch.zeros(3, 16, dtype=torch.bfloat16), [torch.zeros(8, 16, dtype=torch.bfloat16)] * 2
    check_kernel_switch(monkeypatch, "multi_linear", lambda: linear.kernel(x, ws))
    monkeypatch.setattr(linear, "_logged", set())
    trainable = [torch.zeros(8, 16, dtype=torch.bfloat16, requires_grad=True)]
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert linear.kernel(x, trainable) == "torch"  # grad mode on and a weight to differentiate
        with torch.no_grad():
            assert linear.kernel(x, trainable) == "triton"
            assert linear.kernel(x, ws) == "triton"
            assert linear.kernel(x.float(), [w.float() for w in ws]) == "torch"
            assert linear.kernel(torch.zeros(linear.MAX_ROWS + 1, 16, dtype=torch.bfloat16), ws) == "torch"
            assert linear.kernel(torch.zeros(999, 16, dtype=torch.bfloat16), ws) == "torch"  # no new line per length
            assert linear.kernel(x, ws * 5) == "torch"  # 10 weights
            assert linear.kernel(x, [torch.zeros(8, 12, dtype=torch.bfloat16)]) == "torch"  # another width
            router = torch.zeros(4, 16)
            assert linear.kernel(x, ws + [router], fp32=1) == "triton"  # an fp32 weight in an fp32 slot
            assert linear.kernel(x, ws + [router.bfloat16()], fp32=1) == "triton"
            assert linear.kernel(x, [router] + ws, fp32=1) == "torch"  # an fp32 weight in a slot of x's dtype
        assert linear.kernel(x, ws) == "triton"  # grad mode on, but nothing to differentiate
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"multi_linear: {linear.TORCH_FORM}: a gradient is needed",
        "multi_linear: one Triton launch (k3.ops.linear.triton_multi)",
        f"multi_linear: {linear.TORCH_FORM}: the kernel takes 2-D bf16 / fp16 inputs, not 2-D torch.float32",
        f"multi_linear: {linear.TORCH_FORM}: more than 256 rows",
        f"multi_linear: {linear.TORCH_FORM}: the kernel takes 1..8 [N, K] weights of the "
        "input's dtype (fp32 ones: also fp32)",
    ]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.bfloat16, 1e-2)])
def test_concatenated_is_the_reference_in_one_product_with_its_gradients(dtype, tol):
    """One linear over the stacked weights = one linear per weight, outputs and the gradients of x and every weight
    (random cotangents); fp64: the same sums (<= 1e-12), bf16: the products' rounding (2^-8 ~ 3.9e-3 per element)
    with room. Strided outputs (views of one [M, sum N] product). Mixed dtypes fall back to the reference. With
    fp32=1 the last map (a router's) is the reference's fp32 product, outside the stack, gradients included."""
    torch.manual_seed(0)
    x = torch.randn(300, 48, dtype=dtype, requires_grad=True)
    ws = [torch.randn(n, 48, dtype=dtype, requires_grad=True) for n in (16, 3, 40)]
    cots = [torch.randn(300, n, dtype=dtype) for n in (16, 3, 40)]
    got = linear.concatenated(x, ws)
    assert [tuple(y.shape) for y in got] == [(300, 16), (300, 3), (300, 40)] and got[1].stride() == (59, 1)
    grads = torch.autograd.grad(got, [x, *ws], cots)
    want = reference.multi_linear(x, ws)
    want_grads = torch.autograd.grad(want, [x, *ws], cots)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    assert all(rel(a, b) <= tol for a, b in zip(got + list(grads), want + list(want_grads)))
    mixed = [ws[0].detach().float(), ws[1].detach().bfloat16()]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # where mixed weights meet (autocast casts each)
        assert all(y.is_contiguous() for y in linear.concatenated(x.detach().float(), mixed))  # one linear each
    router = torch.randn(6, 48, dtype=dtype, requires_grad=True)  # fp32=1: the last map is the reference's
    got = linear.concatenated(x, ws + [router], fp32=1)
    want = reference.multi_linear(x, ws + [router], fp32=1)
    assert got[1].stride() == (59, 1) and got[-1].dtype == want[-1].dtype == torch.promote_types(dtype, torch.float32)
    cots = cots + [torch.randn(300, 6, dtype=want[-1].dtype)]
    grads = torch.autograd.grad(got, [x, *ws, router], cots)
    want_grads = torch.autograd.grad(want, [x, *ws, router], cots)
    assert all(rel(a, b) <= tol for a, b in zip(got + list(grads), want + list(want_grads)))


def test_fast_backend_stacks_the_weights_where_a_gradient_is_needed(monkeypatch):
    """The torch form of the fast backend: one product over the stacked weights where a gradient is needed (a
    training step), one linear per weight otherwise (a prefill gains nothing; a decode step's GEMVs, more than
    MAX_ROWS rows at large batches, would pay the stacking's weight copy)."""
    monkeypatch.setattr(linear, "kernel", lambda x, ws, fp32=0: "torch")
    ws = [torch.randn(8, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)]
    x = torch.randn(linear.MAX_ROWS + 1, 16)
    assert [y.is_contiguous() for y in linear._multi_linear_fast(x, ws)] == [False, False]  # views of one product
    with torch.no_grad():
        assert [y.is_contiguous() for y in linear._multi_linear_fast(x, ws)] == [True, True]
    frozen = [w.detach() for w in ws]
    assert [y.is_contiguous() for y in linear._multi_linear_fast(x, frozen)] == [True, True]
    assert [y.is_contiguous() for y in linear._multi_linear_fast(x.requires_grad_(), frozen)] == [False, False]


def test_kernel_rejects_bad_inputs():
    tm = pytest.importorskip("k3.ops.linear.triton_multi")
    x = torch.zeros(2, 8, dtype=torch.float16)
    for args in [
        (x.float(), [torch.zeros(4, 8)]),
        (x, []),
        (x, [torch.zeros(4, 9, dtype=torch.float16)]),
        (x, [torch.zeros(4, 8)]),
        (x, [torch.zeros(4, 8, dtype=torch.float16)] * 9),
        (x, [torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16)], 1),
        (x, [torch.zeros(4, 8, dtype=torch.float16)], 2),
    ]:
        with pytest.raises(ValueError, match="multi_linear: .* do not match"):
            tm.multi_linear(*args)


INTERPRETED = textwrap.dedent("""
    import torch
    from torch._dynamo.utils import counters
    from k3.ops import backend
    from k3.ops import linear
    from k3.ops.linear import reference, triton_multi as tm
    from triton.runtime.errors import OutOfResources

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    torch.manual_seed(0)
    cases = [(1, (96, 32, 40, 16, 5, 64), 64), (5, (70,), 96), (64, (33, 1, 128, 7, 9, 100, 12, 50), 64),
             (100, (40, 24), 80), (3, (16, 0, 8), 32), (2, (8, 40, 3, 33, 16, 64, 20), 32),
             (4, (8, 40, 3, 33), 32), (9, (17, 40, 3, 33, 2), 32)]  # every weight count 1..8
    # 100 rows: two passes of 64; a weight of no rows
    for m, sizes, k in cases:
        x = torch.randn(m, k).half()
        ws = [torch.randn(n, k).half() for n in sizes]
        ys = [torch.full((m, n), float("nan")).half() for n in sizes]
        tm._run(x, ws, ys, tm.block_m(m), BLOCK_N=32, BLOCK_K=32)  # several blocks
        for y, want in zip(ys, reference.multi_linear(x.float(), [w.float() for w in ws])):
            assert y.shape == want.shape and not y.isnan().any(), (m, sizes)
            assert want.numel() == 0 or rel(y, want) <= 2e-3, (m, sizes, rel(y, want))
    # fp32 slots (a router's logits): the last weights in fp32 or x's dtype, fp32 outputs; the products are exact
    # in fp32 either way (fp16 x fp16, or x upcast x fp32), so only the sums' order differs from the reference
    for m, sizes, fp32 in [(64, (96, 64, 64), 2), (5, (40, 33), 1), (100, (24, 70), 1)]:
        x = torch.randn(m, 64).half()
        ws = [torch.randn(n, 64).half() for n in sizes[:-fp32]] + [torch.randn(n, 64) for n in sizes[-fp32:]]
        ws[-1] = ws[-1].half() if fp32 == 2 else ws[-1]  # one slot of each kind
        got = tm.multi_linear(x, ws, fp32)
        want = reference.multi_linear(x, ws, fp32)
        assert [y.dtype for y in got] == [y.dtype for y in want] and got[-1].dtype == torch.float32
        assert all(rel(a, b.float()) <= (2e-3 if a.dtype == torch.float16 else 1e-5) for a, b in zip(got, want)), (
            [rel(a, b.float()) for a, b in zip(got, want)])
    assert tm.launch_config([1024, 1024, 1024, 64, 16, 64])["BLOCK_N"] == 32  # 101 programs of 32 columns
    assert tm.launch_config([512, 512])["BLOCK_N"] == 16  # 32 programs of 32 columns: 64 of 16 instead
    x = torch.randn(7, 64).half()[:, ::2]  # a strided input
    ws = [torch.randn(n, 32).half() for n in (20, 12)]
    got = tm.multi_linear(x, ws)
    assert all(rel(y, want) <= 2e-3 for y, want in zip(got, reference.multi_linear(x.float(), [w.float() for w in ws])))
    # a GPU whose shared memory does not fit the rule's 4 stages: 2 stages, and one warning
    run, launches = tm._run, []

    def small_gpu(*args, **launch):
        launches.append(launch["num_stages"])
        if launch["num_stages"] > 2:
            raise OutOfResources(98304, 65536, "shared memory")
        run(*args, **launch)

    tm._run = small_gpu
    got = tm.multi_linear(x, ws)
    tm._run = run
    assert launches == [4, 2] and tm._fewer_stages
    assert all(rel(y, want) <= 2e-3 for y, want in zip(got, reference.multi_linear(x.float(), [w.float() for w in ws])))
    x, ws = torch.randn(4, 32).half(), [torch.randn(n, 32).half() for n in (24, 8, 16)]
    checks = torch.library.opcheck(torch.ops.k3.multi_linear.default, (x, ws))
    assert all(r == "SUCCESS" for r in checks.values()), checks
    checks = torch.library.opcheck(torch.ops.k3.multi_linear.default, (x, ws[:2] + [torch.randn(4, 32)], 1))
    assert all(r == "SUCCESS" for r in checks.values()), checks
    backend.set_kernels(None, triton=True)  # Triton's interpreter stands in for a GPU
    fast = lambda t: [y * 2 for y in linear._multi_linear_fast(t + 1, ws)]  # noqa: E731  (the fast backend's function)
    with torch.no_grad():
        want = fast(x)  # eager first: it logs
        counters.clear()
        explained = torch._dynamo.explain(fast)(x)
        got = torch.compile(fast, backend="aot_eager")(x)
    assert explained.graph_break_count == 0 and not counters["graph_break"], explained.break_reasons
    assert "k3.multi_linear" in "\\n".join(g.code for g in explained.graphs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    print("ok")
""")


def test_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED)


def spy_calls(monkeypatch, module) -> list[int]:
    """Record the number of weights of each multi_linear call made through ``module``."""
    calls, real = [], module.multi_linear

    def spy(x, weights, fp32=0):
        calls.append(len(weights))
        return real(x, weights, fp32)

    monkeypatch.setattr(module, "multi_linear", spy)
    return calls


def test_kda_decode_step_takes_its_six_maps_in_one_call(monkeypatch):
    """The KDA decode step sends x through multi_linear once, with its six input weights (q, k, v, the forget and
    output gates' first maps, beta), then the core's output once (o_proj), and still equals the layer's chunked
    forward over the same tokens (fp64),
    with a low-rank and with a full-rank output gate."""
    from k3.config import get_preset
    from k3.model import kda as kda_module
    from k3.model.cache import K3Cache

    calls = spy_calls(monkeypatch, kda_module)
    torch.manual_seed(2)
    for full_gate in (False, True):
        cfg = get_preset("tiny").replace(**{"kda.full_rank_output_gate": full_gate})
        layer = kda_module.KimiDeltaAttention(cfg).double()
        state = K3Cache(cfg, 1, dtype=torch.float64, state_dtype=torch.float64).layers[0]
        x = torch.randn(6, cfg.hidden_size, dtype=torch.float64)
        with torch.no_grad():
            full = layer(x, torch.tensor([0, 6]))
            steps = torch.cat([layer.step(x[t : t + 1], state, torch.tensor([0])) for t in range(6)])
        err = ((steps - full).norm() / full.norm()).item()
        assert err <= 1e-10, (full_gate, err)
    assert calls == [6, 1] * 12  # the six input maps, then o_proj


@pytest.mark.parametrize("latent,shared", [(True, True), (False, True), (True, False), (False, False)])
def test_moe_takes_its_input_maps_in_one_call(monkeypatch, latent, shared):
    """A MoE layer sends x through multi_linear once, with the maps it has (the latent down-projection, the
    shared experts' gate and up) and last its router's weight (fp32 logits), and its output is the former one to the
    bit: routed experts on the (latent) z, the up-projection of the normed sum, plus the shared experts' GatedFFN of
    x. Gradients reach every map and the router (through the routing weights)."""
    from k3.config import get_preset
    from k3.model import moe as moe_module
    from k3.ops.moe import moe_experts

    calls = spy_calls(monkeypatch, importlib.import_module("k3.ops.moe"))  # moe_inputs: the layer's one op
    torch.manual_seed(4)
    cfg = get_preset("tiny").replace(
        **{
            "moe.latent_size": 32 if latent else None,
            "moe.latent_norm": latent,
            "moe.num_shared_experts": 1 if shared else 0,
        }
    )
    moe = moe_module.MoE(cfg, layer_idx=1)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(7, cfg.hidden_size)
    y, _ = moe(x)
    assert calls == [int(latent) + 2 * int(shared) + 1]
    _, idx, w = moe.gate(x)
    z = moe.routed_expert_down_proj(x) if latent else x
    want = moe_experts(z, idx, w, moe.experts.w1, moe.experts.w2, moe.experts.w3, moe.glu)
    if latent:
        want = moe.routed_expert_up_proj(moe.routed_expert_norm(want))
    if shared:
        want = want + moe.shared_experts(x)
    assert torch.equal(y, want)
    y.sum().backward()  # gradients reach every map through the torch path
    maps = (
        ([moe.routed_expert_down_proj] if latent else [])
        + ([moe.shared_experts.gate_proj, moe.shared_experts.up_proj] if shared else [])
        + [moe.gate]
    )
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in maps)


@pytest.mark.parametrize("q_lora_rank,output_gate", [(None, True), (16, False)])
def test_mla_decode_step_takes_its_maps_in_one_call(monkeypatch, q_lora_rank, output_gate):
    """The MLA decode step sends x through multi_linear once (the first query map, kv_a_proj_with_mqa and, when
    gated, g_proj) and still equals the layer's forward over the same tokens (fp64)."""
    from k3.config import get_preset
    from k3.model import mla as mla_module
    from k3.model.cache import K3Cache

    calls = spy_calls(monkeypatch, mla_module)
    torch.manual_seed(6)
    cfg = get_preset("tiny").replace(**{"mla.q_lora_rank": q_lora_rank, "mla.output_gate": output_gate})
    layer = mla_module.MultiheadLatentAttention(cfg).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    state = next(s for s in K3Cache(cfg, 1, dtype=torch.float64, capacity=8).layers if hasattr(s, "kv"))
    x = torch.randn(6, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, torch.tensor([0, 6]))
        steps = torch.cat([layer.step(x[t : t + 1], state, torch.tensor([0]), torch.tensor([t])) for t in range(6)])
    assert ((steps - full).norm() / full.norm()).item() <= 1e-10
    assert calls == [2 + int(output_gate)] * 6
