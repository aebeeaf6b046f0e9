"""Tests for k3.ops.kda.reference against a plain fp64 token-by-token recurrence."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda.reference import _factored_scores, _intra_chunk_scores, chunk_kda, kda_gate, recurrent_kda
from tests.helpers import rel


def check(name, a, b, tol):
    err = rel(a, b)
    print(f"{name}: rel err {err:.3e} (tol {tol:.0e})")
    assert err <= tol, f"{name}: rel err {err:.3e} > {tol:.0e}"


def truth_kda(q, k, v, g, beta, scale=None, initial_state=None):
    """Ground truth: explicit loops over batch, head and time in fp64, one K x V matrix S at a time.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] or None.
    Returns o [B, T, H, V] and final states [B, H, K, V] (fp64).
    """
    q, k, v, g, beta = (t.detach().double() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    final = torch.zeros(B, H, K, V, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, V, dtype=torch.float64)
            if initial_state is not None:
                S = initial_state[b, h].detach().double().clone()
            for t in range(T):
                S = torch.diag(torch.exp(g[b, t, h])) @ S
                kt, vt = k[b, t, h], v[b, t, h]
                S = S + beta[b, t, h] * torch.outer(kt, vt - S.T @ kt)
                o[b, t, h] = scale * (S.T @ q[b, t, h])
            final[b, h] = S
    return o, final


def make_inputs(B, T, H, K, V, gate, dtype=torch.float32, seed=0):
    """Random q, k (L2-normalised), v, g (by `gate`), beta in (0, 1), initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    beta = torch.sigmoid(randn(B, T, H))
    if gate == "k3":  # bounded gate, lower bound -5
        A_log = torch.log(1 + 15 * torch.rand(H, generator=gen, dtype=torch.float64))
        g = kda_gate(randn(B, T, H, K), A_log, randn(H * K), lower_bound=-5.0)
    elif gate == "softplus":  # Kimi-Linear gate with fla-style init
        A_log = torch.log(1 + 15 * torch.rand(H, generator=gen, dtype=torch.float64))
        dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(H * K, generator=gen))
        dt_bias = (dt + torch.log(-torch.expm1(-dt))).double()  # softplus^-1
        g = kda_gate(randn(B, T, H, K), A_log, dt_bias)
    elif gate == "strong":  # near the K3 bound for every token of several whole chunks
        g = -5 + 0.01 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    elif gate == "very_strong_softplus":  # unbounded gate reaching about -30
        A_log = torch.full((H,), math.log(8.0), dtype=torch.float64)
        g = kda_gate(1.5 * randn(B, T, H, K) + 1.0, A_log, torch.zeros(H * K, dtype=torch.float64))
        assert g.min() < -20
    else:
        raise ValueError(gate)
    s0 = randn(B, H, K, V)
    return tuple(t.to(dtype) for t in (q, k, v, g, beta, s0))


GATES = ["k3", "softplus", "strong", "very_strong_softplus"]


@pytest.mark.parametrize("T", [150, 40])
@pytest.mark.parametrize("gate", GATES)
def test_against_fp64_truth(gate, T):
    q, k, v, g, beta, s0 = make_inputs(2, T, 2, 16, 8, gate)
    o_ref, s_ref = truth_kda(q, k, v, g, beta, initial_state=s0)

    o, s = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    check(f"recurrent o [{gate}, T={T}]", o, o_ref, 1e-5)
    check(f"recurrent S [{gate}, T={T}]", s, s_ref, 1e-5)

    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    check(f"chunk o [{gate}, T={T}]", o, o_ref, 1e-4)
    check(f"chunk S [{gate}, T={T}]", s, s_ref, 1e-4)


def test_no_initial_state_and_custom_scale():
    q, k, v, g, beta, _ = make_inputs(2, 70, 2, 16, 8, "k3", seed=1)
    o_ref, s_ref = truth_kda(q, k, v, g, beta, scale=0.3)
    for fn, tol in ((recurrent_kda, 1e-5), (chunk_kda, 1e-4)):
        o, s = fn(q, k, v, g, beta, scale=0.3, output_final_state=True)
        check(f"{fn.__name__} o (zero state, scale 0.3)", o, o_ref, tol)
        check(f"{fn.__name__} S (zero state, scale 0.3)", s, s_ref, tol)
        assert fn(q, k, v, g, beta)[1] is None


@pytest.mark.parametrize("gate", ["k3", "very_strong_softplus"])
def test_cu_seqlens_equals_separate_runs(gate):
    lengths = [37, 64, 1, 90]
    T, H, K, V = sum(lengths), 2, 16, 8
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V, gate, seed=2)
    s0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0] + lengths).cumsum(0)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    for fn, tol in ((recurrent_kda, 1e-5), (chunk_kda, 1e-4)):
        o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu)
        assert o.shape == (1, T, H, V) and s.shape == (len(lengths), H, K, V)
        for n, (a, b) in enumerate(bounds):
            seg = [t[:, a:b] for t in (q, k, v, g, beta)]
            o_n, s_n = fn(*seg, initial_state=s0[n : n + 1], output_final_state=True)
            check(f"{fn.__name__} packed vs separate o [{gate}, seg {n}]", o[:, a:b], o_n, 1e-6)
            check(f"{fn.__name__} packed vs separate S [{gate}, seg {n}]", s[n : n + 1], s_n, 1e-6)
            o_t, s_t = truth_kda(*seg, initial_state=s0[n : n + 1])
            check(f"{fn.__name__} packed vs truth o [{gate}, seg {n}]", o[:, a:b], o_t, tol)
            check(f"{fn.__name__} packed vs truth S [{gate}, seg {n}]", s[n : n + 1], s_t, tol)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_matches_recurrent(chunk_size):
    q, k, v, g, beta, s0 = make_inputs(2, 150, 3, 32, 16, "k3", seed=4)
    o_r, s_r = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_c, s_c = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
    check(f"chunk({chunk_size}) vs recurrent o", o_c, o_r, 1e-4)
    check(f"chunk({chunk_size}) vs recurrent S", s_c, s_r, 1e-4)


def test_low_precision_inputs_compute_in_fp32():
    q, k, v, g, beta, s0 = make_inputs(1, 50, 2, 16, 8, "k3", seed=5)
    args = [t.bfloat16() for t in (q, k, v, g, beta)]
    o_ref, s_ref = truth_kda(*args, initial_state=s0)
    for fn in (recurrent_kda, chunk_kda):
        o, s = fn(*args, initial_state=s0, output_final_state=True)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        check(f"{fn.__name__} bf16 inputs S", s, s_ref, 1e-4)  # state never rounded to bf16
        check(f"{fn.__name__} bf16 inputs o", o, o_ref, 1e-2)  # only the final cast to bf16


def _leaves(B, T, H, K, V, seed, dtype, gate="k3"):
    q, k, v, g, beta, s0 = make_inputs(B, T, H, K, V, gate, dtype=dtype, seed=seed)
    return [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
def test_gradcheck(fn):
    inputs = _leaves(1, 10, 2, 4, 4, seed=6, dtype=torch.float64)
    kwargs = {"chunk_size": 4} if fn is chunk_kda else {}

    def f(q, k, v, g, beta, s0):
        return fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kwargs)

    assert torch.autograd.gradcheck(f, inputs)


def test_gradcheck_chunk_varlen():
    inputs = _leaves(1, 11, 1, 4, 3, seed=7, dtype=torch.float64)
    inputs[-1] = torch.randn(3, 1, 4, 3, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 6, 11])

    def f(q, k, v, g, beta, s0):
        return chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu, chunk_size=4)

    assert torch.autograd.gradcheck(f, inputs)


def test_intra_chunk_scores_subblocks():
    """The sub-chunked scores equal the direct pairwise formula, and are differentiable."""
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(2, 3, 8, 5, generator=gen, dtype=torch.float64).unbind(0)
    G = (-torch.rand(3, 8, 5, generator=gen, dtype=torch.float64)).cumsum(-2)
    pair = (G[:, :, None] - G[:, None, :]).clamp(max=0).exp()  # i >= j entries are exact
    A_ref = torch.einsum("nic,njc,nijc->nij", k, k, pair).tril(-1)
    B_ref = torch.einsum("nic,njc,nijc->nij", q, k, pair).tril()
    for sub in (2, 4, 8):
        A, Bqk = _intra_chunk_scores(q, k, G, sub)
        check(f"A (sub {sub})", A, A_ref, 1e-12)
        check(f"Bqk (sub {sub})", Bqk, B_ref, 1e-12)
    A, Bqk = _factored_scores(q, k, G)  # spread <= 8 here: the factored form applies
    check("A (factored)", A, A_ref, 1e-12)
    check("Bqk (factored)", Bqk, B_ref, 1e-12)
    leaves = [t.clone().requires_grad_() for t in (q[:1], k[:1], G[:1])]
    assert torch.autograd.gradcheck(lambda a, b, c: _intra_chunk_scores(a, b, c, 2), leaves)
    assert torch.autograd.gradcheck(lambda a, b, c: _factored_scores(a, b, c), leaves)


def test_factored_form_at_its_spread_limit_in_fp32():
    """Spread just under the limit (79 over a chunk): factored fp32 scores still equal the exact ones."""
    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(2, 4, 64, 16, generator=gen).unbind(0)
    g = -torch.rand(4, 64, 16, generator=gen)
    g = g / (g.sum(-2, keepdim=True) - g[:, :1]) * 79.0  # G_first - G_last = 79 in every channel
    G = g.cumsum(-2)
    assert float((G[:, 0] - G[:, -1]).max()) <= 79.0 + 1e-3
    exact = _intra_chunk_scores(q.double(), k.double(), G.double(), 16)
    for got, want, name in zip(_factored_scores(q, k, G), exact, ("A", "Bqk")):
        assert torch.isfinite(got).all()
        check(f"{name} factored fp32", got, want, 1e-5)


@pytest.mark.parametrize("gate", ["k3", "very_strong_softplus"])
def test_gradients_chunk_match_recurrent(gate):
    inputs = _leaves(2, 150, 2, 16, 8, seed=9, dtype=torch.float32, gate=gate)
    gen = torch.Generator().manual_seed(10)
    w_o, w_s = torch.randn(2, 150, 2, 8, generator=gen), torch.randn(2, 2, 16, 8, generator=gen)
    grads = {}
    for fn in (recurrent_kda, chunk_kda):
        o, s = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
        grads[fn] = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), inputs)
    for name, gc, gr in zip(["q", "k", "v", "g", "beta", "initial_state"], grads[chunk_kda], grads[recurrent_kda]):
        assert torch.isfinite(gc).all()
        check(f"grad {name} chunk vs recurrent [{gate}]", gc, gr, 1e-4)


def test_kda_gate_formulas():
    gen = torch.Generator().manual_seed(11)
    H, K = 3, 4
    f = 3 * torch.randn(2, 5, H, K, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g_sp = kda_gate(f, A_log, dt_bias)
    g_k3 = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    for h in range(H):
        for c in range(K):
            x = f[..., h, c].double() + dt_bias[h * K + c].double()
            a = math.exp(A_log[h].item())
            sp = torch.log1p(torch.exp(x))
            torch.testing.assert_close(g_sp[..., h, c].double(), -a * sp, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(g_k3[..., h, c].double(), -5.0 / (1 + torch.exp(-a * x)), rtol=1e-6, atol=1e-6)
    assert g_sp.dtype == torch.float32 and kda_gate(f.bfloat16(), A_log, dt_bias).dtype == torch.float32
    assert (g_sp < 0).all()
    assert (g_k3 >= -5.0).all() and (g_k3 <= 0).all()
    # Strictly inside (l, 0) as long as sigmoid does not saturate: |exp(A_log) (f + dt_bias)| < ~16 in fp32
    # (fp32 sigmoid rounds to exactly 1 beyond that, giving g == l), much wider in fp64.
    moderate = kda_gate(torch.rand(4, 50, H, K, generator=gen) * 6 - 3, torch.zeros(H), torch.zeros(H * K), -5.0)
    f_wide = 8 * torch.randn(4, 50, H, K, generator=gen, dtype=torch.float64)
    wide = kda_gate(f_wide, torch.zeros(H), torch.zeros(H * K), -5.0)
    for g in (moderate, wide):
        assert (g > -5.0).all() and (g < 0).all()


def test_invalid_arguments():
    q, k, v, g, beta, s0 = make_inputs(2, 20, 2, 4, 4, "k3", seed=12)
    cu = torch.tensor([0, 7, 20])
    for fn in (recurrent_kda, chunk_kda):
        with pytest.raises(ValueError):
            fn(q, k, v, g, beta, cu_seqlens=cu)  # B > 1 with cu_seqlens
        with pytest.raises(ValueError):
            fn(q, k, v, g, beta, initial_state=s0[:1])  # N != B
        one = [t[:1] for t in (q, k, v, g, beta)]
        with pytest.raises(ValueError):
            fn(*one, initial_state=s0, cu_seqlens=torch.tensor([0, 5, 9, 20]))  # N != segments
        with pytest.raises(ValueError):
            fn(*one, cu_seqlens=torch.tensor([0, 7, 19]))  # does not end at T


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_decode_step_updates_the_pool_in_place(lower_bound):
    """kda_decode_step from raw projections == the fp64 truth on normalised q/k, gate and sigmoid(b); only the
    named slots of the state pool change."""
    from k3.ops.kda.reference import kda_decode_step

    gen = torch.Generator().manual_seed(7)
    S, N, H, K, V = 5, 3, 2, 8, 6
    q, k, f = (torch.randn(N, H, K, generator=gen) for _ in range(3))
    v, b = torch.randn(N, H, V, generator=gen), torch.randn(N, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen)
    pool = torch.randn(S, H, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([3, 0, 4])
    o = kda_decode_step(q, k, v, f, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, state=pool, slots=slots)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    o_ref, final = truth_kda(
        F.normalize(q, dim=-1)[:, None],
        F.normalize(k, dim=-1)[:, None],
        v[:, None],
        g[:, None],
        torch.sigmoid(b)[:, None],
        initial_state=before[slots],
    )
    check("decode step output", o, o_ref[:, 0], 1e-6)
    check("decode step states", pool[slots], final, 1e-6)
    untouched = torch.tensor([1, 2])
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_kda_raw_equals_the_truth_on_normalised_inputs(lower_bound):
    """chunk_kda_raw from raw projections (two segments, initial states) == the fp64 truth per segment on
    L2-normalised q/k (eps 1e-12, the same as F.normalize's to 1e-13), the gate and sigmoid(b); its gradients
    reach A_log and dt_bias (gradcheck)."""
    from k3.ops.kda.reference import chunk_kda_raw

    gen = torch.Generator().manual_seed(11)
    T, H, K, V, cut = 13, 2, 4, 3, 6
    q, k, f = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v, b = (
        torch.randn(1, T, H, V, generator=gen, dtype=torch.float64),
        torch.randn(1, T, H, generator=gen, dtype=torch.float64),
    )
    A_log = (torch.randn(H, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    dt_bias = torch.randn(H * K, generator=gen, dtype=torch.float64).requires_grad_()
    s0 = torch.randn(2, H, K, V, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, cut, T])
    o, s = chunk_kda_raw(
        q,
        k,
        v,
        f,
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        l2norm_eps=1e-12,
        initial_state=s0,
        output_final_state=True,
        cu_seqlens=cu,
        chunk_size=4,
    )
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    for i, (a, e) in enumerate(((0, cut), (cut, T))):
        o_ref, s_ref = truth_kda(
            F.normalize(q[:, a:e], dim=-1),
            F.normalize(k[:, a:e], dim=-1),
            v[:, a:e],
            g[:, a:e],
            torch.sigmoid(b[:, a:e]),
            initial_state=s0[i : i + 1],
        )
        check(f"raw chunk output, segment {i}", o[:, a:e], o_ref, 1e-10)
        check(f"raw chunk state, segment {i}", s[i : i + 1], s_ref, 1e-10)

    def fn(A, dt, ff, bb):
        o, s = chunk_kda_raw(
            q,
            k,
            v,
            ff,
            bb,
            A_log=A,
            dt_bias=dt,
            lower_bound=lower_bound,
            l2norm_eps=1e-12,
            initial_state=s0,
            output_final_state=True,
            cu_seqlens=cu,
            chunk_size=4,
        )
        return o, s

    assert torch.autograd.gradcheck(fn, (A_log, dt_bias, f.requires_grad_(), b.requires_grad_()))
