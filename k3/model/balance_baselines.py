"""The load-balancing baselines Quantile Balancing is compared with: the loss-free sign update of the bias, the
Switch/GShard auxiliary loss and DeepSeek-V3's sequence-wise auxiliary loss (``k3 train --balance sign|aux|seqaux``,
driven by k3.model.balance)."""

from __future__ import annotations

import torch
from torch import Tensor

from k3.model.router_stats import _normalised_scores, expert_loads

__all__ = [
    "sign_update",
    "switch_aux_loss",
    "seq_aux_loss",
]


def sign_update(loads: Tensor, bias: Tensor, gamma: float = 1e-3) -> Tensor:
    """Loss-free balancing: b + gamma * sign(mean_load - load) (overloaded experts go down)."""
    load = loads.float()
    return bias + (gamma * torch.sign(load.mean() - load)).to(bias.dtype)


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
