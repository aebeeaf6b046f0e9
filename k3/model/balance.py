"""MoE load balancing: Quantile Balancing (exact and histogram forms), baselines and metrics.

Router convention (docs/architecture.md#latentmoe, #quantile-balancing): scores s = sigmoid(W_r x) [N, E] in fp32;
selection is the top-k of (s + b) with b = ``e_score_correction_bias`` (an fp32 buffer without gradient); gate
weights use s only. Each MoE layer reports a :class:`RouterStats` per forward.

Quantile Balancing (QB) reads the balanced-assignment problem "every token takes k experts, every expert takes
q = N k / E tokens" through its dual. For each token the (k+1)-th largest biased score is the cutoff c_t; a token
would pick expert j under a new bias b'_j iff s_tj + b'_j > c_t, i.e. iff b'_j > r_tj with r_tj = c_t - s_tj.
Setting b'_j to the (q+1)-th smallest of the column r_{:,j} (its (k/E)-quantile as an order statistic, K3's
exact form) gives every expert exactly q tokens *under the old cutoffs* (the (q+1)-th on a tie); after
re-routing the cutoffs move, so the balance is approximate (and improves step by step).

Everything on the update paths is vectorised and free of host syncs (no ``.item()``, no ``bincount``: on CUDA
``torch.bincount`` reads min/max back to the host to size its output, so loads use ``scatter_add_``). Only
:func:`balance_metrics` (a logging helper) syncs, once; its device half :func:`balance_metric_rows` does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from k3.ops.dtypes import upcast

__all__ = [
    "RouterStats",
    "expert_loads",
    "qb_required_bias",
    "qb_target_bias",
    "qb_quota",
    "qb_update",
    "QBHistogram",
    "sign_update",
    "switch_aux_loss",
    "seq_aux_loss",
    "max_vio",
    "seq_max_vio",
    "drop_fraction",
    "dead_experts",
    "router_entropy",
    "balance_metrics",
    "balance_metric_rows",
    "metrics_from_rows",
    "Balancer",
    "BALANCE_METHODS",
]

BALANCE_METHODS = ("qb", "qb_exact", "sign", "aux", "seqaux", "none")
DEFAULT_GAMMA = 1e-3  # the sign update's bias step (sign, seqaux)
DEFAULT_ALPHA = {"aux": 1e-2, "seqaux": 1e-4}  # the auxiliary-loss weights


# --------------------------------------------------------------------------------------------------------------
# Router statistics
# --------------------------------------------------------------------------------------------------------------


def expert_loads(topk_idx: Tensor, num_experts: int) -> Tensor:
    """int64 [E]: how many token-slots selected each expert (sync-free ``scatter_add_``, not ``bincount``)."""
    idx = topk_idx.reshape(-1).to(torch.int64)
    out = torch.zeros(num_experts, dtype=torch.int64, device=idx.device)
    return out.scatter_add_(0, idx, torch.ones_like(idx))


@dataclass
class RouterStats:
    """What one MoE layer's router did on one micro-batch.

    scores [N, E] fp32 sigmoid scores (carries grad during training); topk_idx [N, k] int64 selected experts;
    bias [E] the (detached) bias used for this selection; layer the decoder layer index.
    """

    scores: Tensor
    topk_idx: Tensor
    bias: Tensor
    layer: int

    @property
    def num_tokens(self) -> int:
        return self.scores.shape[0]

    @property
    def num_experts(self) -> int:
        return self.scores.shape[-1]

    @property
    def k(self) -> int:
        return self.topk_idx.shape[-1]

    @property
    def loads(self) -> Tensor:
        """int64 [E] selections per expert (no host sync)."""
        return expert_loads(self.topk_idx, self.num_experts)


def _check_k(k: int, num_experts: int) -> None:
    if not 0 < k < num_experts:
        raise ValueError(f"need 0 < k < num_experts for quantile balancing, got k={k}, E={num_experts}")


def _as_2d(scores: Tensor) -> Tensor:
    return scores.reshape(-1, scores.shape[-1])


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


# --------------------------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------------------------


def sign_update(loads: Tensor, bias: Tensor, gamma: float = 1e-3) -> Tensor:
    """Loss-free balancing: b + gamma * sign(mean_load - load) (overloaded experts go down)."""
    load = loads.float()
    return bias + (gamma * torch.sign(load.mean() - load)).to(bias.dtype)


def _normalised_scores(scores: Tensor) -> Tensor:
    """s_i / sum_j s_j per token, fp32. Sigmoid scores are not a distribution; this makes P one."""
    s = _as_2d(scores).float()
    return s / s.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def switch_aux_loss(scores: Tensor, topk_idx: Tensor, alpha: float = 1e-2) -> Tensor:
    """Switch/GShard top-k auxiliary loss alpha * E * sum_i f_i P_i.

    f_i = count_i / (N k) (fraction of token-slots routed to i, no gradient); P_i = mean_t s_ti / sum_j s_tj
    (the sigmoid scores normalised per token, as DeepSeek-V3 does, so P sums to 1 like Switch's softmax). For
    balanced f (f_i = 1/E) the loss is alpha whatever P is; the gradient flows to ``scores`` through P.
    """
    s = _normalised_scores(scores)
    n, e = s.shape
    k = topk_idx.shape[-1]
    f = expert_loads(topk_idx, e).float() / (n * k)
    return alpha * e * (f * s.mean(dim=0)).sum()


def seq_aux_loss(scores: Tensor, topk_idx: Tensor, cu_seqlens: Tensor | None = None, alpha: float = 1e-4) -> Tensor:
    """DeepSeek-V3 sequence-wise auxiliary loss, alpha * mean_seq sum_i f_i P_i.

    Per sequence of length T: f_i = E / (k T) * count_i, P_i = mean_t s_ti / sum_j s_tj. ``cu_seqlens``
    (int [S + 1], packed layout, cu[0] = 0) delimits the sequences; None means one sequence of all N tokens.
    Tokens at or past cu_seqlens[-1] (padding) are ignored; empty sequences are left out of the mean.
    Vectorised with segment ids (``searchsorted``), no host sync.
    """
    s = _normalised_scores(scores)
    n, e = s.shape
    k = topk_idx.shape[-1]
    idx = topk_idx.reshape(n, k).to(torch.int64)
    if cu_seqlens is None:
        cu = torch.full((2,), n, dtype=torch.int64, device=s.device)  # no host-to-device copy
        cu[0] = 0
    else:
        cu = cu_seqlens.to(device=s.device, dtype=torch.int64)
    num_seq = cu.numel() - 1
    seg = torch.searchsorted(cu[1:], torch.arange(n, device=s.device, dtype=torch.int64), right=True)
    # seg == num_seq marks padding: it goes to a spare row that is dropped.
    slot = (seg.unsqueeze(1) * e + idx).reshape(-1)
    counts = torch.zeros((num_seq + 1) * e, dtype=torch.int64, device=s.device)
    counts = counts.scatter_add_(0, slot, torch.ones_like(slot)).view(num_seq + 1, e)[:num_seq]
    p_sum = torch.zeros(num_seq + 1, e, dtype=s.dtype, device=s.device).index_add(0, seg, s)[:num_seq]
    length = cu[1:] - cu[:-1]
    t = length.clamp(min=1).to(s.dtype).unsqueeze(1)
    f = counts.to(s.dtype) * (e / k) / t
    per_seq = (f * (p_sum / t)).sum(dim=1)
    valid = (length > 0).to(s.dtype)
    return alpha * (per_seq * valid).sum() / valid.sum().clamp(min=1.0)


# --------------------------------------------------------------------------------------------------------------
# Metrics (0-dim tensors, no host sync)
# --------------------------------------------------------------------------------------------------------------


def max_vio(loads: Tensor) -> Tensor:
    """MaxVio = max_i load_i / mean(load) - 1 (fp32 0-dim); 0 when there is no load at all."""
    load = loads.float()
    mean = load.mean()
    return torch.where(mean > 0, load.amax() / mean.clamp_min(1e-30) - 1.0, torch.zeros_like(mean))


def seq_max_vio(topk_idx: Tensor, cu_seqlens: Tensor, num_experts: int) -> Tensor:
    """Per-sequence MaxVio: the mean over sequences of max_i count_i / (T k / E) - 1, weighted by T (fp32 0-dim).

    topk_idx [N, k] selected experts; cu_seqlens int [S + 1] (packed layout, cu[0] = 0) delimits the sequences.
    Tokens at or past cu_seqlens[-1] (padding) are ignored; a sequence's T counts its tokens below N, so
    segments reaching past N are cut there, and empty ones are left out. 0 when no sequence has a token.

    Weighted by length T: the unweighted mean would let the one- or few-token fragments that packing leaves at row
    ends dominate (one token always scores E / k - 1). With this weighting the figure equals
    E sum_s max_i count_si / (N k) - 1 over the N counted tokens, so it is never below the MaxVio of their summed
    loads (:func:`max_vio`), the sum of maxima being at least the maximum of sums. Counts per (sequence, expert)
    with ``scatter_add_`` on segment ids (``searchsorted``): no host sync.
    """
    k = topk_idx.shape[-1]
    idx = topk_idx.reshape(-1, k).to(torch.int64)
    n, dev = idx.shape[0], idx.device
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    num_seq = cu.numel() - 1
    seg = torch.searchsorted(cu[1:], torch.arange(n, device=dev, dtype=torch.int64), right=True)
    # seg == num_seq marks padding: it goes to a spare row that is dropped.
    slot = (seg.unsqueeze(1) * num_experts + idx).reshape(-1)
    counts = torch.zeros((num_seq + 1) * num_experts, dtype=torch.int64, device=dev)
    counts = counts.scatter_add_(0, slot, torch.ones_like(slot)).view(num_seq + 1, num_experts)[:num_seq].float()
    slots = counts.sum(dim=1)  # T k per sequence
    # T * MaxVio_s = T (E max_i count_si / (T k) - 1) = (E max_i count_si - T k) / k; empty sequences give 0
    weighted = (num_experts * counts.amax(dim=1) - slots) / k
    total = slots.sum() / k
    return torch.where(total > 0, weighted.sum() / total.clamp_min(1.0), torch.zeros_like(total))


def expert_capacity(capacity_factor: float, num_tokens: int, k: int, num_experts: int) -> int:
    x = capacity_factor * num_tokens * k / num_experts
    return math.ceil(x - 1e-9 * max(1.0, x))  # guard against 563.0000000001 -> 564


def drop_fraction(loads: Tensor, k: int, num_tokens: int, capacity_factor: float = 1.0) -> Tensor:
    """Fraction of token-slots over capacity C = ceil(cf * N k / E): sum_i max(0, load_i - C) / (N k)."""
    e = loads.shape[-1]
    cap = expert_capacity(capacity_factor, num_tokens, k, e)
    return (loads.float() - cap).clamp_min(0.0).sum() / max(num_tokens * k, 1)


def dead_experts(loads: Tensor) -> Tensor:
    """int64 0-dim: the number of experts with zero load."""
    return (loads == 0).sum()


def router_entropy(scores: Tensor) -> Tensor:
    """Mean over tokens of the entropy (nats) of s / sum(s); log(E) is the uniform maximum."""
    p = _normalised_scores(scores.detach())
    return -torch.special.xlogy(p, p).sum(dim=-1).mean()


METRIC_NAMES = ("maxvio", "drop_cf1.0", "drop_cf1.25", "dead", "entropy")


def balance_metrics(
    stats_list: Iterable[RouterStats], reduce_fn: Callable[[Tensor], None] | None = None
) -> dict[str, float]:
    """Per-layer and mean MaxVio, drop fraction at cf 1.0 and 1.25, dead experts and router entropy.

    Entries sharing a layer (micro-batches of one step) are merged: their loads are summed, giving the
    global-batch figures; ``reduce_fn`` (an in-place sum over data-parallel ranks) extends them to the batch of
    every rank. Keys: ``maxvio/layer{L}``, ``drop_cf1.0/layer{L}``, ``drop_cf1.25/layer{L}``,
    ``dead/layer{L}``, ``entropy/layer{L}`` and the same names with ``mean`` for the mean over layers, plus
    ``maxvio/max`` and ``dead/total``. Returns Python numbers (one host sync, two with ``reduce_fn``: this is
    for logging). :func:`balance_metric_rows` and :func:`metrics_from_rows` are its device and host halves, for
    a caller that reads the rows with other numbers in one transfer.
    """
    layers, rows = balance_metric_rows(stats_list, reduce_fn)
    return metrics_from_rows(layers, rows.tolist()) if layers else {}


def balance_metric_rows(
    stats_list: Iterable[RouterStats], reduce_fn: Callable[[Tensor], None] | None = None
) -> tuple[list[int], Tensor | None]:
    """The device half of :func:`balance_metrics`: (sorted layers, fp32 rows [L, 5] of :data:`METRIC_NAMES`),
    or ([], None) without statistics. No host sync without ``reduce_fn`` (one with it: the token counts)."""
    loads: dict[int, Tensor] = {}
    tokens: dict[int, int] = {}
    k_of: dict[int, int] = {}
    ent: dict[int, Tensor] = {}
    with torch.no_grad():
        for st in stats_list:
            lay = int(st.layer)
            n = st.num_tokens
            loads[lay] = loads[lay] + st.loads if lay in loads else st.loads
            h = router_entropy(st.scores) * n
            ent[lay] = ent[lay] + h if lay in ent else h
            tokens[lay] = tokens.get(lay, 0) + n
            k_of[lay] = st.k
        if not loads:
            return [], None
        layers = sorted(loads)
        if reduce_fn is not None:
            dev = loads[layers[0]].device
            packed = torch.stack(
                [
                    torch.cat(
                        [
                            loads[lay].double(),
                            ent[lay].double().reshape(1),
                            torch.full((1,), tokens[lay], dtype=torch.float64, device=dev),
                        ]
                    )
                    for lay in layers
                ]
            )
            reduce_fn(packed)
            counts = packed[:, -1].tolist()
            for i, lay in enumerate(layers):
                loads[lay], ent[lay], tokens[lay] = packed[i, :-2].round().long(), packed[i, -2], int(counts[i])
        rows = torch.stack(
            [
                torch.stack(
                    [
                        max_vio(loads[lay]),
                        drop_fraction(loads[lay], k_of[lay], tokens[lay], 1.0),
                        drop_fraction(loads[lay], k_of[lay], tokens[lay], 1.25),
                        dead_experts(loads[lay]).float(),
                        ent[lay] / max(tokens[lay], 1),
                    ]
                )
                for lay in layers
            ]
        )
    return layers, rows


def metrics_from_rows(layers: Sequence[int], values: Sequence[Sequence[float]]) -> dict[str, float]:
    """The host half of :func:`balance_metrics`: its dict from the layers and the rows read as Python numbers."""
    out: dict[str, float] = {}
    for lay, row in zip(layers, values):
        for name, v in zip(METRIC_NAMES, row):
            out[f"{name}/layer{lay}"] = int(v) if name == "dead" else v
    for j, name in enumerate(METRIC_NAMES):
        col = [row[j] for row in values]
        out[f"{name}/mean"] = sum(col) / len(col)
    out["maxvio/max"] = max(row[0] for row in values)
    out["dead/total"] = int(sum(row[3] for row in values))
    return out


# --------------------------------------------------------------------------------------------------------------
# Trainer front-end
# --------------------------------------------------------------------------------------------------------------


class Balancer:
    """Load-balancing front-end for the trainer.

    Per micro-batch call :meth:`observe` with the MoE layers' :class:`RouterStats` (add the returned auxiliary
    loss to the training loss; it is 0 for the bias-only methods); after the optimizer step call :meth:`step`
    with the layers' bias buffers, which are updated in place from the whole step's statistics and the
    accumulated state is reset.

    methods: ``qb`` (K3: histogram QB, distributed-friendly), ``qb_exact`` (exact QB on the concatenated
    tokens, single process), ``sign`` (loss-free sign update, gamma), ``aux`` (Switch/GShard loss, alpha
    default 1e-2, no bias update), ``seqaux`` (DeepSeek-V3: sign update + sequence-wise loss, alpha default
    1e-4), ``none``. Auxiliary losses are summed over layers; with gradient accumulation scale them like the
    main loss.
    """

    def __init__(
        self,
        method: str,
        num_experts: int,
        k: int,
        *,
        gamma: float = DEFAULT_GAMMA,
        alpha: float | None = None,
        bins: int = 1000,
    ):
        if method not in BALANCE_METHODS:
            raise ValueError(f"unknown balancing method {method!r}; expected one of {', '.join(BALANCE_METHODS)}")
        if method in ("qb", "qb_exact"):
            _check_k(k, num_experts)
        self.method = method
        self.num_experts = num_experts
        self.k = k
        self.gamma = gamma
        self.alpha = alpha if alpha is not None else DEFAULT_ALPHA.get(method, 0.0)
        self.bins = bins
        self._hist: dict[int, QBHistogram] = {}
        self._required: dict[int, list[Tensor]] = {}
        self._loads: dict[int, Tensor] = {}

    @property
    def has_aux_loss(self) -> bool:
        return self.method in ("aux", "seqaux")

    @property
    def updates_bias(self) -> bool:
        return self.method in ("qb", "qb_exact", "sign", "seqaux")

    def reset(self) -> None:
        self._hist.clear()
        self._required.clear()
        self._loads.clear()

    def observe(self, stats_list: Sequence[RouterStats], cu_seqlens: Tensor | None = None) -> Tensor:
        """Record one micro-batch; returns the auxiliary loss (0-dim fp32; zero for non-aux methods)."""
        loss: Tensor | None = None
        for st in stats_list:
            if st.num_experts != self.num_experts or st.k != self.k:
                raise ValueError(
                    f"layer {st.layer}: router has E={st.num_experts}, k={st.k}; "
                    f"balancer expects E={self.num_experts}, k={self.k}"
                )
            lay = int(st.layer)
            if self.method == "qb":
                if lay not in self._hist:
                    self._hist[lay] = QBHistogram(self.num_experts, self.k, self.bins, device=st.scores.device)
                self._hist[lay].accumulate(st.scores, st.bias)
            elif self.method == "qb_exact":
                self._required.setdefault(lay, []).append(qb_required_bias(st.scores, st.bias, self.k))
            elif self.method in ("sign", "seqaux"):
                ld = st.loads
                self._loads[lay] = self._loads[lay] + ld if lay in self._loads else ld
            if self.method == "aux":
                term = switch_aux_loss(st.scores, st.topk_idx, self.alpha)
            elif self.method == "seqaux":
                term = seq_aux_loss(st.scores, st.topk_idx, cu_seqlens, self.alpha)
            else:
                continue
            loss = term if loss is None else loss + term
        if loss is None:
            device = stats_list[0].scores.device if len(stats_list) else None
            loss = torch.zeros((), dtype=torch.float32, device=device)
        return loss

    @torch.no_grad()
    def step(self, bias_buffers: Mapping[int, Tensor], reduce_fn: Callable[[Tensor], None] | None = None) -> None:
        """Update ``bias_buffers[layer]`` in place from the accumulated statistics, then reset.

        ``reduce_fn`` (optional) sums a tensor in place across data/context-parallel ranks, e.g.
        ``lambda t: torch.distributed.all_reduce(t)``; it is called once on all layers' stacked histograms
        (qb) or loads (sign, seqaux). Layers without observations are left alone.
        """
        if self.method == "qb" and self._hist:
            layers = sorted(self._hist)
            if reduce_fn is not None:
                stacked = torch.stack([self._hist[lay].counts for lay in layers])
                reduce_fn(stacked)
                for lay, c in zip(layers, stacked):
                    self._hist[lay].counts = c
            for lay in layers:
                self._write(bias_buffers, lay, self._hist[lay].compute())
        elif self.method == "qb_exact" and self._required:
            if reduce_fn is not None:
                raise NotImplementedError("qb_exact is single-process; use 'qb' (histograms) when distributed")
            for lay, parts in sorted(self._required.items()):
                b_hat = _order_statistic_bias(torch.cat(parts), self.k)
                self._write(bias_buffers, lay, b_hat - b_hat.mean())
        elif self.method in ("sign", "seqaux") and self._loads:
            layers = sorted(self._loads)
            stacked = torch.stack([self._loads[lay] for lay in layers])
            if reduce_fn is not None:
                reduce_fn(stacked)
            for lay, ld in zip(layers, stacked):
                buf = self._buffer(bias_buffers, lay)
                self._write(bias_buffers, lay, sign_update(ld.to(buf.device), buf.float(), self.gamma))
        self.reset()

    @staticmethod
    def _buffer(bias_buffers: Mapping[int, Tensor], layer: int) -> Tensor:
        if layer not in bias_buffers:
            raise KeyError(f"no bias buffer given for MoE layer {layer}")
        return bias_buffers[layer]

    @classmethod
    def _write(cls, bias_buffers: Mapping[int, Tensor], layer: int, new: Tensor) -> None:
        buf = cls._buffer(bias_buffers, layer)
        buf.copy_(new.to(device=buf.device, dtype=buf.dtype))
