"""One comparison of a router kernel's routing with the torch reference's, for the Triton top-k kernel's tests
(Triton's interpreter: tests/ops/test_router.py; GPU: tests/gpu/test_router_kernel.py)."""

from __future__ import annotations

import torch


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest element-wise relative error |a - b| / |b|, in fp64."""
    return ((a.double() - b.double()).abs() / b.double().abs()).max().item()


def assert_same_routing(got, want, bias: torch.Tensor, k: int, tol: float, tie_gap: float = 0.0) -> None:
    """A kernel's (scores, idx, weight) against the reference's: idx in descending order of score + bias, the same
    experts per row (sorted: the reference's order is unspecified), scores and weights aligned by expert within a
    relative ``tol``, element by element. With ``tie_gap``, rows whose k-th and (k+1)-th keys are within it may
    choose either (at most one such row; their experts and weights are not compared)."""
    (s, i, w), (rs, ri, rw) = got, want
    keys = (s + bias).gather(1, i)
    assert (keys[:, :-1] >= keys[:, 1:]).all(), keys  # descending by score + bias
    clear = torch.ones(s.shape[0], dtype=torch.bool, device=s.device)
    if tie_gap:
        cut = (rs + bias).topk(k + 1).values
        clear = cut[:, k - 1] - cut[:, k] > tie_gap
        assert clear.sum() >= s.shape[0] - 1, clear
    mine, mine_at = i[clear].sort(1)
    ref, ref_at = ri[clear].sort(1)
    assert torch.equal(mine, ref), (mine, ref)
    assert max_rel(s, rs) <= tol, ("scores", max_rel(s, rs))
    err = max_rel(w[clear].gather(1, mine_at), rw[clear].gather(1, ref_at))
    assert err <= tol, ("weights", err)
