"""The grouped-GEMM MoE path's routing and row movement (k3.ops.moe.grouped) on the CPU: the padded buffer's
layout, the dispatch / combine gathers against their definitions with gradients (fp64 gradcheck), and the forward
against the per-expert loop where this torch runs ``_grouped_mm`` on the CPU (its backward needs CUDA: the GPU test
tests/gpu/test_fast_paths.py covers it)."""

import pytest
import torch

from k3.model.activation import situ_glu
from k3.ops.moe import grouped
from k3.ops.moe import reference as moe_ref
from tests.helpers import rel


def routing(n=37, e=6, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    idx[:9, 0] = 2  # a busy expert; expert 5 may get few or none
    return idx


@pytest.mark.parametrize("ranks", ["counted", "sorted"])
def test_route_layout(ranks, monkeypatch):
    """Each expert's pairs sit in one contiguous group starting at a multiple of ALIGN, in token order;
    pair_rows and src_pair are inverse maps; the rest is padding (-1). Both ways of ranking pairs (counting up to
    COUNT_PAIRS pairs, a stable sort above)."""
    monkeypatch.setattr(grouped, "COUNT_PAIRS", 1 << 20 if ranks == "counted" else 0)
    e, k = 6, 3
    idx = routing(e=e, k=k)
    n = idx.shape[0]
    route = grouped._route(idx, e)
    rows = route.pair_rows.reshape(-1)
    assert rows.unique().numel() == n * k and route.src_pair.numel() == n * k + grouped.ALIGN * e
    assert torch.equal(route.src_pair[rows], torch.arange(n * k))
    assert int((route.src_pair >= 0).sum()) == n * k
    ends = route.offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    assert bool((starts % grouped.ALIGN == 0).all())
    for ex in range(e):
        pairs = (idx.reshape(-1) == ex).nonzero()[:, 0]
        want = starts[ex] + torch.arange(pairs.numel())
        assert torch.equal(rows[pairs], want), ex  # stable: token order inside the group
        assert ends[ex] - starts[ex] == (pairs.numel() + grouped.ALIGN - 1) // grouped.ALIGN * grouped.ALIGN


def test_counted_and_sorted_ranks_route_alike(monkeypatch):
    """Random top-k routings of several sizes (idle experts, every pair on one expert): the counted ranks (small
    batches) and the sorted ones give the same buffer."""
    gen = torch.Generator().manual_seed(3)
    cases = [torch.randint(0, 64, (n, 8), generator=gen) for n in (1, 5, 64)]
    cases += [torch.zeros(7, 1, dtype=torch.int64), torch.rand(33, 96, generator=gen).topk(16).indices]
    for idx in cases:
        e = int(idx.max()) + 1 + 3
        monkeypatch.setattr(grouped, "COUNT_PAIRS", 1 << 20)
        counted = grouped._route(idx, e)
        monkeypatch.setattr(grouped, "COUNT_PAIRS", 0)
        sorted_ = grouped._route(idx, e)
        for a, b in zip(counted, sorted_, strict=True):
            assert torch.equal(a, b), tuple(idx.shape)


def test_dispatch_and_combine_match_their_definitions_with_gradients():
    e, k, d = 6, 3, 5
    idx = routing(e=e, k=k)
    n = idx.shape[0]
    route = grouped._route(idx, e)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(route.src_pair.numel(), d, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(n, k, dtype=torch.float64, generator=gen, requires_grad=True)
    xs = grouped._Dispatch.apply(x, route)
    live = route.src_pair >= 0
    assert torch.equal(xs[live], x[route.src_pair[live] // k])
    out = grouped._Combine.apply(y, w, route, torch.float64)
    want = sum(w[:, j, None] * y[route.pair_rows[:, j]] for j in range(k))
    assert rel(out, want) <= 1e-15
    # padding rows copy token 0 and their gradient is dropped (moe_experts never reads their outputs)
    assert torch.autograd.gradcheck(lambda t: grouped._Dispatch.apply(t, route)[live], (x,))
    assert torch.autograd.gradcheck(lambda a, b: grouped._Combine.apply(a, b, route, torch.float64), (y, w))


def test_forward_matches_the_loop_on_cpu():
    torch.manual_seed(0)
    n, e, k, d, i = 50, 6, 3, 16, 24
    x = torch.randn(n, d, dtype=torch.bfloat16)
    idx = routing(n=n, e=e, k=k)
    w = torch.rand(n, k)
    w1, w3 = (torch.randn(e, i, d) * d**-0.5 for _ in range(2))
    w2 = torch.randn(e, d, i) * i**-0.5
    try:
        got = grouped.moe_experts(x, idx, w, w1, w2, w3, situ_glu)
    except (RuntimeError, NotImplementedError) as err:  # no CPU kernel in this torch
        pytest.skip(f"torch._grouped_mm does not run on this CPU: {err}")
    want = moe_ref.moe_experts(x.float(), idx, w, w1, w2, w3, situ_glu)
    assert got.dtype == x.dtype and rel(got, want) <= 1.5e-2  # bf16 inputs, weights and GLU output


def test_spread_rows_selects_not_multiplies():
    """A non-finite gradient row does not leak into padding rows (a mask-multiply would give inf * 0 = NaN)."""
    e, k = 6, 3
    idx = routing(e=e, k=k)
    route = grouped._route(idx, e)
    g = torch.randn(idx.shape[0], 4)
    g[0] = float("inf")
    w = torch.rand(idx.shape[0], k)
    dy = grouped.spread_rows(g, w, route.src_pair, k, torch.bfloat16)
    assert dy.dtype == torch.bfloat16
    pad = route.src_pair < 0
    assert bool((dy[pad] == 0).all()) and bool(dy[~pad][route.src_pair[~pad] // k != 0].isfinite().all())


def test_no_tokens():
    """Zero tokens give an empty output, as the loop does (the dispatch would otherwise read token 0)."""
    out = grouped.moe_experts(
        torch.randn(0, 8, dtype=torch.bfloat16),
        torch.zeros(0, 2, dtype=torch.int64),
        torch.rand(0, 2),
        torch.randn(4, 16, 8),
        torch.randn(4, 8, 16),
        torch.randn(4, 16, 8),
        situ_glu,
    )
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16
