"""What an MoE router did on one micro-batch (:class:`RouterStats`) and the load figures read from it: expert
loads, MaxVio (whole batch and per sequence), drop fractions at a capacity, dead experts and router entropy.

Router convention (docs/architecture.md#latentmoe, #quantile-balancing): scores s = sigmoid(W_r x) [N, E] in fp32;
selection is the top-k of (s + b) with b = ``e_score_correction_bias`` (an fp32 buffer without gradient); gate
weights use s only. Each MoE layer reports a :class:`RouterStats` per forward; the balancers (k3.model.balance)
update b from them and the trainer logs the figures here.

Loads are counted with ``scatter_add_``, not ``bincount`` (on CUDA ``torch.bincount`` reads min/max back to the
host to size its output), so every figure is a device tensor without a host sync. Only :func:`balance_metrics`
(a logging helper) syncs, once; its device half :func:`balance_metric_rows` does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "RouterStats",
    "expert_loads",
    "max_vio",
    "seq_max_vio",
    "drop_fraction",
    "dead_experts",
    "router_entropy",
    "balance_metrics",
    "balance_metric_rows",
    "metrics_from_rows",
]


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


def _as_2d(scores: Tensor) -> Tensor:
    return scores.reshape(-1, scores.shape[-1])


def _normalised_scores(scores: Tensor) -> Tensor:
    """s_i / sum_j s_j per token, fp32. Sigmoid scores are not a distribution; this makes P one."""
    s = _as_2d(scores).float()
    return s / s.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


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
