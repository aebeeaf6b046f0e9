"""Load balancing: Quantile Balancing (exact and histogram, k3.model.quantile_balancing), the baselines
(k3.model.balance_baselines), the load figures (k3.model.router_stats) and the Balancer (k3.model.balance)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3.model.balance import Balancer
from k3.model.balance_baselines import seq_aux_loss, sign_update, switch_aux_loss
from k3.model.quantile_balancing import QBHistogram, qb_quota, qb_required_bias, qb_target_bias, qb_update
from k3.model.router_stats import (
    RouterStats,
    balance_metrics,
    dead_experts,
    drop_fraction,
    expert_loads,
    max_vio,
    router_entropy,
    seq_max_vio,
)

E, K, N = 64, 8, 4096


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _offsets(seed: int = 0, scale: float = 1.5, e: int = E) -> torch.Tensor:
    return torch.randn(e, generator=_gen(seed)) * scale


def _batch(offsets: torch.Tensor, seed: int, n: int = N) -> torch.Tensor:
    """Skewed router scores: sigmoid(per-expert offset + per-token noise), fp32 [n, E]."""
    return torch.sigmoid(offsets + torch.randn(n, offsets.numel(), generator=_gen(seed)))


def _route(scores: torch.Tensor, bias: torch.Tensor, k: int = K) -> torch.Tensor:
    return torch.topk(scores + bias, k, dim=-1).indices


def _stats(scores, bias, layer, k=K):
    return RouterStats(scores=scores, topk_idx=_route(scores, bias, k), bias=bias.detach().clone(), layer=layer)


# ---------------------------------------------------------------------------------------------------------------
# Quantile Balancing, exact
# ---------------------------------------------------------------------------------------------------------------


def test_qb_acceptance_new_batch():
    off = _offsets(0)
    a, b = _batch(off, 1), _batch(off, 2)
    zero = torch.zeros(E)
    mv0 = max_vio(expert_loads(_route(b, zero), E)).item()
    new_bias = qb_update(a, zero, K)
    mv1 = max_vio(expert_loads(_route(b, new_bias), E)).item()
    print(f"\nQB acceptance (E={E}, k={K}, N={N}): MaxVio_0 = {mv0:.4f}, MaxVio_1 = {mv1:.4f}")
    assert mv1 < 0.25 * mv0, f"MaxVio_0={mv0:.4f} MaxVio_1={mv1:.4f}"
    assert abs(new_bias.mean().item()) < 1e-6
    assert new_bias.dtype == torch.float32 and new_bias.shape == (E,)


def test_qb_same_batch_threshold_counts_and_reroute():
    off = _offsets(3)
    a = _batch(off, 4)
    bias = 0.1 * torch.randn(E, generator=_gen(5))
    q = N * K // E
    r = qb_required_bias(a, bias, K)
    b_hat = qb_target_bias(a, bias, K)
    below = (r < b_hat).sum(0)
    at_or_below = (r <= b_hat).sum(0)
    # b^ is the (q+1)-th order statistic of each column: under the OLD cutoffs at most q tokens clear it strictly
    # and at least q + 1 weakly. Exactly q unless it falls on the atom r_tj = b_j (tokens whose (k+1)-th pick is
    # j itself all have r_tj = b_j up to rounding), a tie no threshold can split.
    assert (below <= q).all() and (at_or_below >= q + 1).all()
    atom = (r - bias).abs() < 1e-6
    exact = (below == q) | ((r <= b_hat) & atom).any(0)
    assert exact.all()
    # Re-routing the same batch with the centred bias: cutoffs move, so balance is approximate; repeating the
    # step on the same batch converges.
    mv0 = max_vio(expert_loads(_route(a, bias), E)).item()
    new = qb_update(a, bias, K)
    mv1 = max_vio(expert_loads(_route(a, new), E)).item()
    for _ in range(4):
        new = qb_update(a, new, K)
    mv5 = max_vio(expert_loads(_route(a, new), E)).item()
    print(f"\nQB same batch: MaxVio before {mv0:.4f}, after 1 step {mv1:.4f}, after 5 steps {mv5:.4f}")
    msg = f"MaxVio on the same batch: before {mv0:.4f}, after 1 QB step {mv1:.4f}, after 5 steps {mv5:.4f}"
    assert mv1 < 0.6 and mv1 < 0.1 * mv0, msg
    assert mv5 < 0.06, msg


def _qb_spec_fp64(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Exact QB from the docs/architecture.md#quantile-balancing, in fp64 and plain Python per expert: cutoff c_t =
    (k+1)-th largest of
    s_t + b; M = s - c; q = N k / E rounded (halves up, below N); b^_j = -((q+1)-th largest of M_{:,j});
    b <- b^ - mean(b^)."""
    s, b = scores.double(), bias.double()
    n, e = s.shape
    c = (s + b).sort(dim=-1, descending=True).values[:, k]
    m = s - c[:, None]
    q = min(int(math.floor(n * k / e + 0.5)), n - 1)
    b_hat = torch.tensor([-sorted(m[:, j].tolist(), reverse=True)[q] for j in range(e)], dtype=torch.float64)
    return b_hat - b_hat.mean()


@pytest.mark.parametrize("n,e,k", [(1000, 64, 8), (777, 32, 3), (5, 8, 6), (130, 896, 16)])
def test_exact_qb_is_the_spec_order_statistic(n, e, k):
    """The exact form equals an fp64 implementation written from the spec's text: to 1e-9 on fp64 scores (same
    arithmetic), to fp32 rounding on the fp32 scores the router produces; no interpolation between order
    statistics (the linear-quantile rule differed by 7e-5 to 3e-3 here)."""
    g = _gen(n + e)
    s64 = torch.sigmoid(
        torch.randn(n, e, generator=g, dtype=torch.float64) + torch.randn(e, generator=g, dtype=torch.float64)
    )
    bias = 0.1 * torch.randn(e, generator=g, dtype=torch.float64)
    ref = _qb_spec_fp64(s64, bias, k)
    assert (qb_update(s64, bias, k) - ref).abs().max().item() <= 1e-9
    s32 = s64.float()
    ref32 = _qb_spec_fp64(s32, bias.float(), k)
    out32 = qb_update(s32, bias.float(), k)
    assert out32.dtype == torch.float32 and (out32.double() - ref32).abs().max().item() <= 1e-6
    assert qb_quota(n, k, e) == min(int(math.floor(n * k / e + 0.5)), n - 1)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    shift=st.floats(-2.0, 2.0),
    e=st.sampled_from([8, 16, 32]),
    k=st.sampled_from([1, 2, 4]),
    n=st.integers(16, 300),
)
def test_qb_update_shift_invariant_and_centred(seed, shift, e, k, n):
    off = _offsets(seed, 1.0, e)
    s = _batch(off, seed + 1, n)
    bias = 0.2 * torch.randn(e, generator=_gen(seed + 2))
    out = qb_update(s, bias, k)
    assert abs(out.mean().item()) < 1e-5
    assert torch.isfinite(out).all()
    torch.testing.assert_close(qb_update(s, bias + shift, k), out, atol=5e-6, rtol=0)


def test_qb_rejects_bad_k():
    s = torch.rand(10, 4, generator=_gen(7)) + 0.1
    with pytest.raises(ValueError):
        qb_update(s, torch.zeros(4), 4)


# ---------------------------------------------------------------------------------------------------------------
# Quantile Balancing, histogram
# ---------------------------------------------------------------------------------------------------------------


def test_histogram_quantile_within_one_bin():
    off = _offsets(8)
    a, b = _batch(off, 9), _batch(off, 10)
    bias = qb_update(a, torch.zeros(E), K)  # a realistic non-zero bias
    h = QBHistogram(E, K, bins=1000)
    h.accumulate(b, bias)
    exact = qb_target_bias(b, bias, K)
    approx = h.quantiles()
    width = h.bin_width
    torch.testing.assert_close(width, (bias.max() - bias.min() + 2) / 1000)
    diff_bins = ((approx - exact).abs() / width).max().item()
    print(f"\nhistogram vs exact QB quantile: max |diff| = {diff_bins:.3f} bin widths")
    assert diff_bins <= 1.0, f"{diff_bins:.3f} bins"
    torch.testing.assert_close(h.compute(), approx - approx.mean())


def test_histogram_microbatches_equal_concatenation():
    off = _offsets(11)
    bias = 0.3 * torch.randn(E, generator=_gen(12))
    parts = [_batch(off, 20 + i, 512 + 37 * i) for i in range(4)]
    h4 = QBHistogram(E, K)
    for p in parts:
        h4.accumulate(p, bias)
    h1 = QBHistogram(E, K)
    h1.accumulate(torch.cat(parts), bias)
    assert h4.num_tokens == h1.num_tokens == sum(p.shape[0] for p in parts)
    assert torch.equal(h4.counts, h1.counts)
    assert torch.equal(h4.quantiles(), h1.quantiles())
    h4.reset()
    assert h4.num_tokens == 0 and h4.counts.sum().item() == 0 and h4.lo is None


def test_histogram_range_fixed_and_clamping():
    bias = 0.2 * torch.randn(E, generator=_gen(13))
    h = QBHistogram(E, K, bins=50)
    s = _batch(_offsets(14), 15, 256)
    h.accumulate(s, bias)
    lo, hi = h.lo.clone(), h.hi.clone()
    torch.testing.assert_close(lo, bias.min() - 1)
    torch.testing.assert_close(hi, bias.max() + 1)
    # A different bias later in the step must not move the range; out-of-range r clamps into edge bins.
    wild = 3.0 * torch.randn(256, E, generator=_gen(16))  # not sigmoid: r far outside the range
    h.accumulate(wild, 5 * bias)
    assert torch.equal(h.lo, lo) and torch.equal(h.hi, hi)
    assert (h.counts.sum(1) == 512).all()
    assert h.counts[:, 0].sum() > 0 and h.counts[:, -1].sum() > 0


# ---------------------------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------------------------


def test_sign_update_direction():
    loads = torch.tensor([30, 10, 20, 20])  # mean 20
    bias = torch.tensor([0.3, -0.2, 0.1, 0.05])
    new = sign_update(loads, bias, gamma=1e-3)
    torch.testing.assert_close(new - bias, torch.tensor([-1e-3, 1e-3, 0.0, 0.0]))
    # Feeding it the loads it produces reduces an imbalance over steps.
    off = _offsets(17)
    s = _batch(off, 18, 1024)
    b = torch.zeros(E)
    mv0 = max_vio(expert_loads(_route(s, b), E))
    for _ in range(100):
        b = sign_update(expert_loads(_route(s, b), E), b, gamma=2e-2)
    assert max_vio(expert_loads(_route(s, b), E)) < 0.5 * mv0


def test_switch_aux_loss_uniform_minimum_and_growth():
    e, k, n = 16, 4, 512
    c = 0.2 + 0.6 * torch.rand((), generator=_gen(19))
    uniform = torch.full((n, e), c.item())
    t = torch.arange(n).unsqueeze(1)
    cyclic = (t * k + torch.arange(k)) % e  # every expert gets exactly n k / e slots
    assert (expert_loads(cyclic, e) == n * k // e).all()
    torch.testing.assert_close(switch_aux_loss(uniform, cyclic, alpha=1e-2), torch.tensor(1e-2))
    losses = []
    for scale in (0.0, 0.5, 1.0, 2.0):
        s = _batch(_offsets(20, scale, e), 21, n)
        losses.append(switch_aux_loss(s, _route(s, 0.0, k), alpha=1e-2).item())
    assert losses[0] == pytest.approx(1e-2, rel=0.05)
    assert all(x < y for x, y in zip(losses, losses[1:])), losses


def test_switch_aux_loss_gradient():
    s = _batch(_offsets(22, 1.0, 16), 23, 128).requires_grad_(True)
    loss = switch_aux_loss(s, _route(s.detach(), 0.0, 4))
    loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and torch.isfinite(s.grad).all()


def test_seq_aux_loss_by_hand():
    s = torch.tensor(
        [[0.9, 0.2, 0.6, 0.3], [0.1, 0.8, 0.7, 0.4], [0.5, 0.5, 0.2, 0.9], [0.3, 0.6, 0.8, 0.2], [0.7, 0.4, 0.1, 0.6]]
    )
    idx = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3]])
    t, e, k, alpha = 5, 4, 2, 1e-4
    count = [0] * e
    for row in idx.tolist():
        for j in row:
            count[j] += 1
    p = [0.0] * e
    for row in s.tolist():
        tot = sum(row)
        for j in range(e):
            p[j] += row[j] / tot / t
    expected = alpha * sum(e / (k * t) * count[j] * p[j] for j in range(e))
    got = seq_aux_loss(s, idx, torch.tensor([0, 5]), alpha=alpha)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert seq_aux_loss(s, idx, None, alpha=alpha).item() == pytest.approx(expected, rel=1e-6)


def test_seq_aux_loss_segments_padding_and_grad():
    e, k = 16, 4
    lens = [7, 0, 33, 12, 1]
    n_real = sum(lens)
    s = _batch(_offsets(24, 1.0, e), 25, n_real + 5).requires_grad_(True)  # 5 padding tokens at the end
    idx = _route(s.detach(), 0.0, k)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    got = seq_aux_loss(s, idx, cu, alpha=1e-4)
    per = [seq_aux_loss(s[a:b], idx[a:b], None, alpha=1e-4) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
    torch.testing.assert_close(got, torch.stack(per).mean())
    got.backward()
    assert s.grad[:n_real].abs().sum() > 0
    assert s.grad[n_real:].abs().sum() == 0  # padding does not contribute


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------


def test_metrics_hand_made():
    loads = torch.tensor([10, 20, 30, 0, 40])  # E=5, N=50, k=2: N k = 100, mean 20
    assert max_vio(loads).item() == pytest.approx(1.0)
    assert int(dead_experts(loads)) == 1
    assert drop_fraction(loads, 2, 50, 1.0).item() == pytest.approx(0.30)  # C = 20: 10 + 20 over
    assert drop_fraction(loads, 2, 50, 1.25).item() == pytest.approx(0.20)  # C = 25: 5 + 15 over
    balanced = torch.tensor([7, 7, 7, 7])
    assert max_vio(balanced).item() == 0.0 and int(dead_experts(balanced)) == 0
    assert drop_fraction(balanced, 1, 28, 1.0).item() == 0.0
    # C = ceil(1.1 * 10 * 1 / 4) = ceil(2.75) = 3 -> one slot over on the first expert
    assert drop_fraction(torch.tensor([4, 3, 2, 1]), 1, 10, 1.1).item() == pytest.approx(0.1)


def _seq_max_vio_loop(topk_idx: torch.Tensor, cu: list[int], e: int) -> float:
    """Plain Python: each sequence's max_i count_i / (T k / E) - 1, averaged with weights T."""
    rows, k = topk_idx.tolist(), topk_idx.shape[1]
    num = den = 0.0
    for start, end in zip(cu[:-1], cu[1:]):
        toks = rows[start : min(end, len(rows))]
        if not toks:
            continue
        counts = [0] * e
        for t in toks:
            for j in t:
                counts[j] += 1
        num += len(toks) * (max(counts) / (len(toks) * k / e) - 1)
        den += len(toks)
    return num / den if den else 0.0


@pytest.mark.parametrize("seed", range(6))
def test_seq_max_vio_matches_a_loop_over_sequences(seed):
    """Random packed layouts: an empty segment, a one-token fragment, padding past cu[-1] (every other seed), and
    a last segment reaching past N (seed 5); routes with a skew so that sequences differ."""
    g = _gen(100 + seed)
    e, k = 16, 3
    n = int(torch.randint(40, 200, (), generator=g))
    skew = torch.randn(e, generator=g)
    topk_idx = torch.topk(torch.rand(n, e, generator=g) + skew, k, dim=-1).indices
    used = n - (int(torch.randint(1, 20, (), generator=g)) if seed % 2 else 0)
    cuts = sorted(torch.randint(1, used, (5,), generator=g).tolist())
    cu = [0] + cuts[:2] + [cuts[2], cuts[2]] + cuts[3:] + [cuts[-1] + 1, used]  # empty segment, one-token fragment
    cu = sorted(cu)
    if seed == 5:
        cu[-1] = n + 7  # a segment cut at N
    got = seq_max_vio(topk_idx, torch.tensor(cu), e)
    want = _seq_max_vio_loop(topk_idx, cu, e)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    # never below the MaxVio of the counted tokens' summed loads (the sum of maxima >= the maximum of sums)
    counted = topk_idx[: min(cu[-1], n)]
    assert got.item() >= max_vio(expert_loads(counted, e)).item() - 1e-6
    # padding's routes do not matter
    noisy = topk_idx.clone()
    noisy[min(cu[-1], n) :] = torch.arange(k)
    assert seq_max_vio(noisy, torch.tensor(cu), e).item() == got.item()


def test_seq_max_vio_hand_made():
    e = 4  # experts; each token takes k = 2 (the columns of idx)
    # sequence 0: 3 tokens on experts {0,1} -> counts [3,3,0,0], T k / E = 1.5, MaxVio 1; sequence 1: 2 tokens
    # balanced -> 0; a one-token fragment -> E / k - 1 = 1. Weighted by T: (3 * 1 + 2 * 0 + 1 * 1) / 6.
    idx = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1], [2, 3], [3, 2], [0, 0]])
    cu = torch.tensor([0, 3, 5, 6])  # the last row is padding
    assert seq_max_vio(idx, cu, e).item() == pytest.approx(4 / 6)
    assert seq_max_vio(idx, torch.tensor([0]), e).item() == 0.0  # no sequence
    assert seq_max_vio(idx, torch.tensor([0, 0, 0]), e).item() == 0.0  # only empty ones


def test_router_entropy():
    c = 0.3 + 0.4 * torch.rand((), generator=_gen(26)).item()
    assert router_entropy(torch.full((9, 12), c)).item() == pytest.approx(math.log(12), rel=1e-6)
    two = torch.tensor([[0.2, 0.6], [0.6, 0.2]])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert router_entropy(two).item() == pytest.approx(h, rel=1e-6)


def test_router_stats_loads_and_balance_metrics():
    off = _offsets(27)
    zero = torch.zeros(E)
    st0 = _stats(_batch(off, 28, 1024), zero, layer=1)
    st3 = _stats(_batch(off, 29, 1024), qb_update(_batch(off, 30, 1024), zero, K), layer=3)
    assert torch.equal(st0.loads, torch.bincount(st0.topk_idx.reshape(-1), minlength=E))
    assert st0.loads.sum().item() == 1024 * K
    m = balance_metrics([st0, st3])
    for lay, stats in ((1, st0), (3, st3)):
        assert m[f"maxvio/layer{lay}"] == pytest.approx(max_vio(stats.loads).item())
        assert m[f"drop_cf1.0/layer{lay}"] == pytest.approx(drop_fraction(stats.loads, K, 1024, 1.0).item())
        assert m[f"drop_cf1.25/layer{lay}"] == pytest.approx(drop_fraction(stats.loads, K, 1024, 1.25).item())
        assert m[f"dead/layer{lay}"] == int(dead_experts(stats.loads))
        assert m[f"entropy/layer{lay}"] == pytest.approx(router_entropy(stats.scores).item(), rel=1e-5)
    assert m["maxvio/mean"] == pytest.approx((m["maxvio/layer1"] + m["maxvio/layer3"]) / 2)
    assert m["maxvio/max"] == max(m["maxvio/layer1"], m["maxvio/layer3"])
    assert m["maxvio/layer3"] < m["maxvio/layer1"]
    # two micro-batches of one layer merge into global-batch figures
    st0b = _stats(_batch(off, 31, 1024), zero, layer=1)
    merged = balance_metrics([st0, st0b])
    assert merged["maxvio/layer1"] == pytest.approx(max_vio(st0.loads + st0b.loads).item())
    assert balance_metrics([]) == {}


# ---------------------------------------------------------------------------------------------------------------
# Balancer
# ---------------------------------------------------------------------------------------------------------------


def test_balancer_qb_updates_only_at_step_in_place():
    off = _offsets(32)
    buffers = {0: torch.zeros(E), 2: 0.05 * torch.randn(E, generator=_gen(33))}
    before = {lay: b.clone() for lay, b in buffers.items()}
    ptrs = {lay: b.data_ptr() for lay, b in buffers.items()}
    bal = Balancer("qb", E, K)
    micro = [[_stats(_batch(off, 40 + 2 * i + lay, 512), buffers[lay], lay) for lay in (0, 2)] for i in range(2)]
    for stats in micro:
        loss = bal.observe(stats)
        assert loss.item() == 0.0
        for lay in buffers:
            assert torch.equal(buffers[lay], before[lay])
    bal.step(buffers)
    for lay in buffers:
        assert buffers[lay].data_ptr() == ptrs[lay]
        assert not torch.equal(buffers[lay], before[lay])
        h = QBHistogram(E, K)
        h.accumulate(torch.cat([m[lay // 2].scores for m in micro]), before[lay])
        torch.testing.assert_close(buffers[lay], h.compute())
    after = {lay: b.clone() for lay, b in buffers.items()}
    bal.step(buffers)  # state was reset: nothing observed, nothing changes
    for lay in buffers:
        assert torch.equal(buffers[lay], after[lay])


def test_balancer_qb_exact_sign_and_reduce_fn():
    off = _offsets(34)
    b0 = 0.05 * torch.randn(E, generator=_gen(35))
    parts = [_batch(off, 50 + i, 300) for i in range(3)]
    # qb_exact == qb_update on the concatenated tokens
    buf = {5: b0.clone()}
    bal = Balancer("qb_exact", E, K)
    for p in parts:
        bal.observe([_stats(p, b0, 5)])
    bal.step(buf)
    torch.testing.assert_close(buf[5], qb_update(torch.cat(parts), b0, K))
    # sign: one reduce call on the stacked loads; scaling the loads (as a sum over equal ranks would) keeps signs
    calls = []

    def reduce_fn(t):
        calls.append(t.shape)
        t.mul_(2)

    buf = {5: b0.clone()}
    bal = Balancer("sign", E, K, gamma=1e-3)
    stats = [_stats(p, b0, 5) for p in parts]
    for st_ in stats:
        bal.observe([st_])
    bal.step(buf, reduce_fn=reduce_fn)
    total = sum(st_.loads for st_ in stats)
    torch.testing.assert_close(buf[5], sign_update(total, b0, 1e-3))
    assert calls == [torch.Size([1, E])]
    # qb with reduce_fn: one call on [layers, E, bins]; doubling all counts leaves the quantiles unchanged
    calls.clear()
    buf = {5: b0.clone(), 6: b0.clone()}
    bal = Balancer("qb", E, K, bins=200)
    bal.observe([_stats(parts[0], b0, 5), _stats(parts[1], b0, 6)])
    bal.step(buf, reduce_fn=reduce_fn)
    assert calls == [torch.Size([2, E, 200])]
    h = QBHistogram(E, K, bins=200)
    h.accumulate(parts[0], b0)
    torch.testing.assert_close(buf[5], h.compute())
    # a missing buffer is a clear error
    bal.observe([_stats(parts[0], b0, 9)])
    with pytest.raises(KeyError, match="layer 9"):
        bal.step(buf)


def test_balancer_aux_seqaux_and_none():
    off = _offsets(36)
    b0 = torch.zeros(E)
    s = _batch(off, 37, 256).requires_grad_(True)
    st_ = _stats(s, b0, 1)
    cu = torch.tensor([0, 100, 256])
    aux = Balancer("aux", E, K).observe([st_, st_])
    torch.testing.assert_close(aux, 2 * switch_aux_loss(s, st_.topk_idx, 1e-2))
    seq = Balancer("seqaux", E, K)
    loss = seq.observe([st_], cu_seqlens=cu)
    torch.testing.assert_close(loss, seq_aux_loss(s, st_.topk_idx, cu, 1e-4))
    loss.backward()
    assert s.grad.abs().sum() > 0
    buf = {1: b0.clone()}
    seq.step(buf)
    torch.testing.assert_close(buf[1], sign_update(st_.loads, b0, 1e-3))
    # aux and none never touch the bias
    for method in ("aux", "none"):
        buf = {1: b0.clone() + 0.01}
        bal = Balancer(method, E, K)
        out = bal.observe([_stats(_batch(off, 38, 256), buf[1], 1)])
        if method == "none":
            assert out.item() == 0.0
        bal.step(buf)
        assert torch.equal(buf[1], b0 + 0.01)


def test_balancer_bad_method():
    with pytest.raises(ValueError, match="unknown balancing method"):
        Balancer("quantile", E, K)


def test_histogram_takes_nan_scores_without_indexing_out_of_range():
    """A diverging step's NaN scores must not crash the histogram (the trainer skips the step and resets it)."""
    s = torch.rand(64, E, generator=_gen(40))
    s[3, 5] = float("nan")
    h = QBHistogram(E, K)
    h.accumulate(s, torch.zeros(E))
    assert int(h.counts.sum()) == 64 * E
