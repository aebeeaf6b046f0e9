"""A KDA layer's decode core in one Triton launch (k3.ops.kda.triton_decode): in Triton's interpreter on a machine
with Triton but no GPU (in a subprocess: TRITON_INTERPRET is read when a kernel is defined), against the same
equations composed of the reference ops in float64 (f_b_proj, k3.ops.kda.reference.kda_decode_step, g_b_proj, the
gated RMSNorm); then the layer's decode step with the kernel against the step composed of the reference backend;
the custom op's schema, declared mutation and fake function (torch.library.opcheck). Tolerances: fp32 inputs 1e-5
relative (sums in other orders, exp / sigmoid to a few ulps), fp16 outputs 2e-3 (their rounding, 2^-11, and the
fp16 inputs'). On the GPU: tests/gpu/test_kda_decode_core.py."""

import logging
import textwrap

import torch

from k3.ops import kda
from tests.ops.kernel_switch import check_kernel_switch

SCRIPT = textwrap.dedent("""
    import torch
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM
    from k3.ops import backend
    from k3.ops.kda import fla
    from k3.ops.kda.triton_decode import kda_decode_core
    from tests.ops.kda_core_reference import core_float64

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    torch.manual_seed(0)
    S, N = 6, 3
    slots = torch.tensor([4, 0, 5])
    for H, K, V, RF, RG, bound, dtype, state_dtype in [(2, 16, 32, 24, 8, -5.0, torch.float32, torch.float32),
                                                       (3, 32, 16, 16, 0, None, torch.float32, torch.float32),
                                                       (2, 16, 16, 40, 0, -5.0, torch.float16, torch.float16),
                                                       (1, 64, 32, 16, 12, None, torch.float16, torch.float32),
                                                       # states over 64 x 64: two passes over 32-column chunks
                                                       (2, 128, 64, 16, 12, None, torch.float32, torch.float32),
                                                       (1, 128, 128, 24, 0, -5.0, torch.float16, torch.float32)]:
        q, k = (torch.randn(N, H * K).to(dtype) for _ in range(2))
        v = torch.randn(N, H * V).to(dtype)
        f_a, w_fb = torch.randn(N, RF).to(dtype), (torch.randn(H * K, RF) * RF ** -0.5).to(dtype)
        b = torch.randn(N, H).to(dtype)
        gate_in = torch.randn(N, RG or H * V).to(dtype)
        w_gb = (torch.randn(H * V, RG) * RG ** -0.5).to(dtype) if RG else None
        A_log, dt_bias, norm_w = torch.rand(H).log1p(), torch.randn(H * K) * 0.5, torch.rand(V) + 0.5
        pool = (torch.randn(S, H, K, V) * 0.3).to(state_dtype)
        got_pool = pool.clone()
        got = kda_decode_core(q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_w, got_pool, slots, bound,
                              1e-6, 1e-5, dtype)
        want, want_pool = core_float64(q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_w, pool, slots,
                                       bound)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert got.dtype == dtype and rel(got, want) <= tol, (H, K, V, dtype, rel(got, want))
        state_tol = 1e-5 if state_dtype == torch.float32 else 2e-3
        assert rel(got_pool[slots], want_pool[slots]) <= state_tol, (H, K, V, rel(got_pool[slots], want_pool[slots]))
        assert torch.equal(got_pool[[1, 2, 3]], pool[[1, 2, 3]])  # other slots untouched
    args = (q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_w, pool.clone(), slots, None, 1e-6, 1e-5,
            dtype)
    checks = torch.library.opcheck(torch.ops.k3.kda_decode_core.default, args)
    assert all(r == "SUCCESS" for r in checks.values()), checks

    # the layer's decode step: the kernel (the fast kda_decode_step backend stands in: Triton's interpreter for a
    # GPU) against the reference backend's composition, both gate kinds
    backend.set_kernels(None, triton=True)
    backend.register("kda_decode_step", "fast", fla.kda_decode_step, lambda d: True)
    for full_rank in (True, False):
        cfg = get_preset("tiny").replace(**{"kda.full_rank_output_gate": full_rank, "kda.num_heads": 2})
        layer = next(l for l in K3ForCausalLM(cfg).model.layers if l.mixer == "kda").self_attn
        torch.nn.init.normal_(layer.o_norm.weight, 1.0, 0.2)
        cache = K3ForCausalLM(cfg).new_cache(4, capacity=8)
        state = next(s for s in cache.layers if hasattr(s, "recurrent"))
        state.recurrent.normal_(0, 0.3)
        for c in state.conv:
            c.normal_()
        x = torch.randn(3, cfg.hidden_size)
        slots = torch.tensor([2, 0, 3])
        outs, states = [], []
        for choice in ("auto", "reference"):
            backend.set_backend(choice)
            mine = type(state)(recurrent=state.recurrent.clone(), conv=[c.clone() for c in state.conv])
            with torch.no_grad():
                outs.append(layer.step(x, mine, slots))
            states.append(mine.recurrent)
        backend.set_backend("auto")
        assert rel(outs[0], outs[1]) <= 1e-5 and rel(states[0], states[1]) <= 1e-5, (full_rank, rel(outs[0], outs[1]))
    with torch.no_grad():  # traced, the step keeps the launch in its graph (no break)
        explained = torch._dynamo.explain(layer.step)(x, state, slots)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert "k3.kda_decode_core" in "\\n".join(g.code for g in explained.graphs)
    print("ok")
""")


def test_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter(SCRIPT)


def test_decode_core_runs_only_on_the_fast_backend_without_gradients(monkeypatch, caplog):
    """The one-launch core where kda_decode_step runs its fast backend, Triton is usable, no gradient is needed and
    the head widths fit; K3_KERNELS=kda_decode_core=torch turns it off. Logged once per choice, with the reason."""
    from k3.ops import backend

    monkeypatch.setattr(backend._OPS["kda_decode_step"], "fast_ok", {})
    monkeypatch.setitem(backend._OPS["kda_decode_step"].supports, "fast", lambda d: True)
    x, state = torch.zeros(2, 8), torch.zeros(4, 2, 16, 32)
    params = [torch.zeros(3, requires_grad=True)]
    check_kernel_switch(
        monkeypatch, "kda_decode_core", lambda: kda.decode_core_kernel(x, state, [p.detach() for p in params])
    )
    monkeypatch.setattr(kda, "_core_logged", set())
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert kda.decode_core_kernel(x, state, params) == "torch"
        with torch.no_grad():
            assert kda.decode_core_kernel(x, state, params) == "triton"
            assert kda.decode_core_kernel(x, torch.zeros(4, 2, 256, 32), params) == "torch"
            assert kda.decode_core_kernel(x, state.double(), params) == "torch"
            assert kda.decode_core_kernel(x, state.transpose(2, 3), params) == "torch"  # [.., 32, 16]: fits, strided
            backend.set_backend("reference")
            try:
                assert kda.decode_core_kernel(x, state, params) == "torch"
            finally:
                backend.set_backend("auto")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("kda decode")] == [
        "kda decode step: f_b_proj, kda_decode_step, g_b_proj, the gated norm: a gradient is needed",
        "kda decode step: one Triton launch for its gates, recurrence and output norm (k3.ops.kda.triton_decode)",
        "kda decode step: f_b_proj, kda_decode_step, g_b_proj, the gated norm: head widths (256, 32) (the kernel "
        "takes powers of two, 16..128)",
        "kda decode step: f_b_proj, kda_decode_step, g_b_proj, the gated norm: fp64 inputs (the kernel computes in "
        "fp32)",
        "kda decode step: f_b_proj, kda_decode_step, g_b_proj, the gated norm: a non-contiguous state pool",
        "kda decode step: f_b_proj, kda_decode_step, g_b_proj, the gated norm: kda_decode_step runs its reference",
    ]
