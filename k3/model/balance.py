"""MoE load balancing for the trainer: :class:`Balancer` picks a method (:data:`BALANCE_METHODS`), feeds it
every micro-batch's router statistics and updates the layers' bias buffers once per optimiser step.

The methods live in their own modules: Quantile Balancing, K3's (k3.model.quantile_balancing), the baselines it
is compared with (k3.model.balance_baselines); the statistics and load figures are k3.model.router_stats.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from k3.model.balance_baselines import seq_aux_loss, sign_update, switch_aux_loss
from k3.model.quantile_balancing import QBHistogram, _check_k, _order_statistic_bias, qb_required_bias
from k3.model.router_stats import RouterStats

__all__ = ["Balancer", "BALANCE_METHODS"]

BALANCE_METHODS = ("qb", "qb_exact", "sign", "aux", "seqaux", "none")
DEFAULT_GAMMA = 1e-3  # the sign update's bias step (sign, seqaux)
DEFAULT_ALPHA = {"aux": 1e-2, "seqaux": 1e-4}  # the auxiliary-loss weights


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
