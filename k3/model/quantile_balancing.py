"""Quantile Balancing (docs/architecture.md#quantile-balancing): the bias update that balances K3's MoE routing
without an auxiliary loss, in its exact form and in the histogram form that sums across micro-batches and ranks.

Quantile Balancing (QB) reads the balanced-assignment problem "every token takes k experts, every expert takes
q = N k / E tokens" through its dual. For each token the (k+1)-th largest biased score is the cutoff c_t; a token
would pick expert j under a new bias b'_j iff s_tj + b'_j > c_t, i.e. iff b'_j > r_tj with r_tj = c_t - s_tj.
Setting b'_j to the (q+1)-th smallest of the column r_{:,j} (its (k/E)-quantile as an order statistic, K3's
exact form) gives every expert exactly q tokens *under the old cutoffs* (the (q+1)-th on a tie); after
re-routing the cutoffs move, so the balance is approximate (and improves step by step).

Everything on the update paths is vectorised and free of host syncs (no ``.item()``; counts use ``scatter_add_``,
not ``bincount``, which reads min/max back to the host on CUDA). The trainer drives it through k3.model.balance.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from k3.model.router_stats import _as_2d
from k3.ops.dtypes import upcast

__all__ = [
    "qb_required_bias",
    "qb_target_bias",
    "qb_quota",
    "qb_update",
    "QBHistogram",
]


def _check_k(k: int, num_experts: int) -> None:
    if not 0 < k < num_experts:
        raise ValueError(f"need 0 < k < num_experts for quantile balancing, got k={k}, E={num_experts}")


# --------------------------------------------------------------------------------------------------------------
# Quantile Balancing, exact form
# --------------------------------------------------------------------------------------------------------------


def qb_required_bias(scores: Tensor, bias: Tensor, k: int) -> Tensor:
    """r_tj = c_t - s_tj [N, E], in promote(scores dtype, fp32): the bias expert j would need to clear token t's cutoff.

    c_t is the (k+1)-th largest of s_t + b (the best expert the token did *not* take); s is the raw score.
    With sigmoid scores (0 < s < 1) every r lies inside (min(b) - 1, max(b) + 1). No gradient.
    """
    s = upcast(_as_2d(scores).detach())
    b = bias.detach().to(s.dtype)
    _check_k(k, s.shape[-1])
    cutoff = torch.topk(s + b, k + 1, dim=-1, sorted=False).values.amin(dim=-1)
    return cutoff.unsqueeze(-1) - s


def qb_quota(num_tokens: int, k: int, num_experts: int) -> int:
    """q = N k / E rounded to the nearest integer (halves up), at most N - 1: the tokens each expert should take
    (docs/architecture.md#quantile-balancing: "round q"; the bias takes the (q+1)-th order statistic, so q < N)."""
    return min(math.floor(num_tokens * k / num_experts + 0.5), num_tokens - 1)


def _order_statistic_bias(r: Tensor, k: int) -> Tensor:
    """b^_j = the (q+1)-th smallest of column r_{:,j} (q = :func:`qb_quota`) for r [N, E] -> [E] in r's dtype.

    Written with ``topk`` (the q+1 smallest, then their maximum): no input-size cap (``torch.quantile`` refuses
    over 2^24 elements), a partial sort only, and no host sync (q comes from the shape)."""
    q = qb_quota(r.shape[0], k, r.shape[1])
    return torch.topk(r, q + 1, dim=0, largest=False, sorted=False).values.amax(dim=0)


def qb_target_bias(scores: Tensor, bias: Tensor, k: int) -> Tensor:
    """The pre-centring QB bias b^_j = -((q+1)-th largest of s_{:,j} - c) = (q+1)-th smallest of r_{:,j}, [E] in
    promote(scores dtype, fp32); q = N k / E rounded (:func:`qb_quota`).

    This is K3's order statistic (docs/architecture.md#quantile-balancing), not an interpolated quantile. Under the old
    cutoffs the q tokens with r_tj < b^_j clear expert j's new threshold, and token (q+1) sits exactly on its cutoff
    (s_tj + b^_j = c_t), a tie its top-k breaks either way; after re-routing the cutoffs move, so the balance is
    approximate.
    Ties: every column has an atom at r_tj = b_j (up to rounding) from the tokens whose (k+1)-th pick is j itself
    (about N/E of them); when the order statistic lands in it, b^_j = b_j and the count under the old cutoffs is
    the current load, off from q by at most the atom's size. Exact ties in s (sigmoid saturating to 1.0 in fp32)
    act the same way. Either way #{r < b^} <= q < #{r <= b^}.
    """
    return _order_statistic_bias(qb_required_bias(scores, bias, k), k)


def qb_update(scores: Tensor, bias: Tensor, k: int) -> Tensor:
    """Exact Quantile Balancing step: new bias = b^ - mean(b^), [E] (fp32 for fp32 scores). Apply it from the next
    step.

    The result depends on ``bias`` only through the cutoffs, so it is invariant to a constant shift of ``bias``.
    """
    b_hat = qb_target_bias(scores, bias, k)
    return b_hat - b_hat.mean()


# --------------------------------------------------------------------------------------------------------------
# Quantile Balancing, histogram form (K3 report App. D)
# --------------------------------------------------------------------------------------------------------------


class QBHistogram:
    """Per-expert histograms of r = c - s, accumulated over micro-batches, for the distributed QB update.

    The bin range [min(b) - 1, max(b) + 1] is fixed by the bias passed to the first :meth:`accumulate` after a
    reset; the bias is replicated, so the range (and the bins) agree across micro-batches and ranks and
    ``counts`` (int64 [E, bins]) can simply be summed (``all_reduce(SUM)``) before :meth:`compute`. Values
    outside the range (impossible for sigmoid scores) are clamped into the edge bins. :meth:`compute` takes the
    token count from ``counts`` itself (every row sums to the number of tokens), so a reduced histogram needs no
    separate token all-reduce; :attr:`num_tokens` is the local count, for information.
    """

    def __init__(self, num_experts: int, k: int, bins: int = 1000, device: torch.device | str | None = None):
        _check_k(k, num_experts)
        if bins < 1:
            raise ValueError(f"bins must be positive, got {bins}")
        self.num_experts = num_experts
        self.k = k
        self.bins = bins
        self.counts = torch.zeros(num_experts, bins, dtype=torch.int64, device=device)
        self.lo: Tensor | None = None  # 0-dim fp32 tensors, set at the first accumulate
        self.hi: Tensor | None = None
        self.num_tokens = 0

    @property
    def bin_width(self) -> Tensor:
        if self.lo is None:
            raise RuntimeError("QBHistogram has no range yet: call accumulate() first")
        return (self.hi - self.lo) / self.bins

    def reset(self) -> None:
        self.counts.zero_()
        self.lo = self.hi = None
        self.num_tokens = 0

    @torch.no_grad()
    def accumulate(self, scores: Tensor, bias: Tensor) -> None:
        """Add one micro-batch: scores [N, E] (or [..., E]) and the bias used to route it."""
        s = _as_2d(scores)
        if s.shape[-1] != self.num_experts:
            raise ValueError(f"scores have {s.shape[-1]} experts, histogram has {self.num_experts}")
        r = qb_required_bias(s, bias, self.k)
        if self.lo is None:
            b = bias.detach().float().to(r.device)
            self.lo = b.amin() - 1.0
            self.hi = b.amax() + 1.0
            if self.counts.device != r.device:
                self.counts = self.counts.to(r.device)
        scale = self.bins / (self.hi - self.lo)
        # NaN (the scores of a diverging step, which the trainer then drops) lands in bin 0 instead of indexing
        # out of range
        idx = ((r - self.lo) * scale).nan_to_num_(0.0).floor_().clamp_(0, self.bins - 1).to(torch.int64)
        idx += torch.arange(self.num_experts, device=r.device, dtype=torch.int64) * self.bins
        flat = idx.reshape(-1)
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat))
        self.num_tokens += s.shape[0]

    @torch.no_grad()
    def quantiles(self) -> Tensor:
        """Pre-centring b^ [E] fp32: the (k/E)-quantile of each expert's histogram.

        Target: the point below which q = n k / E of the n tokens lie (the balanced-assignment target), with the
        counts spread uniformly inside each bin. The bin holding it also holds the q-th smallest r, so the result
        is within one bin width of the exact quantile unless the gap r_(q+1) - r_(q) itself exceeds a bin.
        """
        if self.lo is None:
            raise RuntimeError("QBHistogram.quantiles() before any accumulate()")
        counts = self.counts.to(torch.float64)
        cum = counts.cumsum(dim=1)
        target = cum[:, -1] * (self.k / self.num_experts)  # [E]
        b = (cum < target.unsqueeze(1)).sum(dim=1).clamp_(max=self.bins - 1)  # first bin with cum >= target
        in_bin = counts.gather(1, b.unsqueeze(1)).squeeze(1)
        below = cum.gather(1, b.unsqueeze(1)).squeeze(1) - in_bin
        frac = ((target - below) / in_bin.clamp(min=1.0)).clamp_(0.0, 1.0)
        width = (self.hi - self.lo).double() / self.bins
        return (self.lo.double() + (b.double() + frac) * width).float()

    def compute(self) -> Tensor:
        """New mean-centred bias [E] fp32 (does not reset)."""
        b_hat = self.quantiles()
        return b_hat - b_hat.mean()
