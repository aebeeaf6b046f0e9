"""One optimiser step of :class:`k3.train.trainer.Trainer`: forward / backward over the micro-batches, clip, one
host read of everything the step logs, then the update (or, for a non-finite step, the skip or the roll-back).

The step's device numbers (loss and auxiliary-loss sums, gradient norm, balance metrics, expert loads, the MLA logit
maximum, the previous update's weight check) come back in one :func:`to_host`: a single process's one host sync
outside the model. The update is queued after it without waiting for the device. See ``docs/architecture.md#muon``
for the optimiser and ``docs/architecture.md#quantile-balancing`` for the router-bias update.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from k3.data.batch import IGNORE_INDEX
from k3.model.mla import MultiheadLatentAttention
from k3.model.router_stats import balance_metric_rows, max_vio, metrics_from_rows, seq_max_vio
from k3.ops.segments import as_segments, to_device
from k3.train.qk_clip import mla_max_logits, qk_clip_
from k3.train.schedule import clip_grad_norm, cosine_schedule

log = logging.getLogger("k3.train")


def to_host(tensors: dict, device: torch.device) -> dict:
    """{key: tensor} on the host through one copy, hence one host sync: flattened to float64 (exact for fp32 values
    and for integers below 2^53), concatenated on ``device``, copied, and split back into their shapes and dtypes."""
    flat = torch.cat([t.detach().reshape(-1).to(device, torch.float64) for t in tensors.values()]).cpu()
    parts = flat.split([t.numel() for t in tensors.values()])
    return {k: part.view(t.shape).to(t.dtype) for (k, t), part in zip(tensors.items(), parts)}


@dataclass
class StepSums:
    """What a step's micro-batches leave on the device, all device tensors: float64 sums added in micro-batch order
    (the numbers Python floats would give), and the statistics the balancer and the metrics read."""

    total: torch.Tensor  # summed cross-entropy
    aux: torch.Tensor  # summed auxiliary (balance) loss
    stats: list = field(default_factory=list)  # router statistics of every micro-batch and MoE layer, scores detached
    # per micro-batch and MoE layer: (micro-batch MaxVio, per-sequence MaxVio). Both cover this rank's tokens only
    # (under data parallelism its rows, under context parallelism its slices of them); the global-batch MaxVio of
    # the metrics is over every rank.
    local_vio: list = field(default_factory=list)
    loads: dict = field(default_factory=dict)  # this rank's token-slots per expert, per MoE layer
    micro_loads: list = field(default_factory=list)  # per micro-batch: [MoE layers, E] of the same, layer order
    max_logits: dict = field(default_factory=dict)  # per MLA layer, its largest attention logit (QK-Clip only)


class TrainStep:
    """The step and its hooks, mixed into :class:`k3.train.trainer.Trainer`. The hooks are the single-process
    ones; k3.distributed.train overrides them (batches per rank, sums over ranks, sharded clipping)."""

    # ---------------------------------------------------------- step hooks (k3.distributed.train overrides them)
    def next_batches(self) -> list:
        """This process's micro-batches of the step."""
        return [self.train_data.next_batch(self.cfg.batch_size) for _ in range(self.cfg.grad_accum)]

    def all_sum(self, value):
        """Sum of a number or a device tensor over the processes (single process: itself)."""
        return value

    def data_ranks(self) -> int:
        """Processes whose gradients are summed (single process: 1); per-rank auxiliary losses are divided by it,
        so the summed gradient is that of their mean."""
        return 1

    def reduce_fn(self):
        """In-place sum over the processes for the balancer's statistics (None: single process)."""
        return None

    def after_backward(self) -> None:
        """Gradient reductions beyond the parallelism wrappers' own (single process: none)."""

    def clip(self) -> torch.Tensor:
        """Clip the gradients; returns their norm before clipping (a device tensor, read with the step's numbers)."""
        return clip_grad_norm(self.model, self.cfg.clip)

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict:
        """One optimiser step; returns its metrics record."""
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = self._set_lr()
        batches = self.next_batches()
        valid = int(self.all_sum(sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)))
        if valid == 0:  # chat rows may hold context only (e.g. a long tool declaration): nothing to learn from
            log.info("step %d: the batch has no trained labels; step skipped", self.step)
            dt = time.perf_counter() - t0
            tokens = (self.step + 1) * cfg.batch_size * cfg.grad_accum * cfg.seq_len
            return {
                "step": self.step,
                "loss": "no labels",
                "lr": lr,
                "tokens": tokens,
                "skipped": "no labels",
                "step_time": dt,
                "tokens_per_s": cfg.batch_size * cfg.grad_accum * cfg.seq_len / dt,
            }
        sums = self._forward_backward(batches, valid)
        self.after_backward()
        sums.total, sums.aux = self.all_sum(sums.total), self.all_sum(sums.aux)  # every rank skips a bad step or none
        # computed whether or not the step is skipped (a skipped step drops its gradients), so one read serves both
        grad_norm = self.clip()
        layers, rows = balance_metric_rows(sums.stats, reduce_fn=self.reduce_fn())  # global batch over ranks
        host = to_host(self._readout(sums, grad_norm, layers, rows), self.device)
        (total, aux_total), grad_norm = host["sums"].tolist(), host["grad_norm"].item()
        loss = total / valid
        record = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "tokens": (self.step + 1) * cfg.batch_size * cfg.grad_accum * cfg.seq_len,
        }
        weights_bad = self._previous_update_bad(host)
        finite = (
            math.isfinite(loss)
            and math.isfinite(aux_total)
            and math.isfinite(grad_norm)
            and bool(host.get("scores_finite", True))
        )
        if weights_bad or not finite:
            self._drop_step(record, weights_bad, loss, grad_norm)
        else:
            self._update(record, sums, host, layers, grad_norm, aux_total)
        dt = time.perf_counter() - t0
        record.update(step_time=dt, tokens_per_s=cfg.batch_size * cfg.grad_accum * cfg.seq_len / dt)
        return record

    def _set_lr(self) -> float:
        """The cosine schedule's learning rate at this step (over ``schedule_steps``), set on every group."""
        cfg = self.cfg
        lr = cfg.lr * cosine_schedule(self.step, cfg.schedule_steps or cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def _forward_backward(self, batches: list, valid: int) -> StepSums:
        """Forward and backward of each micro-batch: cross-entropy over the step's ``valid`` labels (so accumulation
        equals one big batch) plus the balancer's auxiliary loss; the statistics accumulate on the device."""
        cfg = self.cfg
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = StepSums(total=zero, aux=zero)
        hooks = self._mla_inputs_hook(sums.max_logits) if cfg.qk_clip else []
        try:
            for b in batches:
                loss_sum, _, out = self._forward_loss(b)
                cu = as_segments(b.cu_seqlens, self.device).offsets
                aux = self.balancer.observe(out.router_stats, cu) / (cfg.grad_accum * self.data_ranks())
                (loss_sum / valid + aux).backward()
                sums.total = sums.total + loss_sum.detach().double()
                sums.aux = sums.aux + aux.detach().double()
                sums.stats += [dataclasses.replace(s, scores=s.scores.detach()) for s in out.router_stats]
                with torch.no_grad():
                    micro = {}
                    for s in out.router_stats:
                        ld = micro[s.layer] = s.loads
                        sums.loads[s.layer] = sums.loads[s.layer] + ld if s.layer in sums.loads else ld
                        sums.local_vio.append(torch.stack([max_vio(ld), seq_max_vio(s.topk_idx, cu, s.num_experts)]))
                    if micro:
                        sums.micro_loads.append(torch.stack([micro[i] for i in sorted(micro)]))
        finally:
            for h in hooks:
                h.remove()
        return sums

    def _readout(self, sums: StepSums, grad_norm: torch.Tensor, layers: list, rows) -> dict:
        """Every device number the host needs after the step, keyed for the one :func:`to_host`."""
        wanted = {"sums": torch.stack([sums.total, sums.aux]), "grad_norm": grad_norm}
        if sums.stats:
            wanted["scores_finite"] = torch.stack([torch.isfinite(s.scores).all() for s in sums.stats]).all()
        if self._weights_check is not None:  # the previous update's weight check, read with this step's numbers
            wanted["weights_bad"] = self._weights_check
        if layers:
            wanted["metrics"] = rows
        if sums.local_vio:
            wanted["local_vio"] = torch.stack(sums.local_vio)
        if sums.max_logits:
            wanted["mla_max_logit"] = torch.stack([m.max() for m in sums.max_logits.values()]).max()
        if sums.micro_loads:  # the step's summed loads are their sum, taken on the host
            wanted["micro_loads"] = torch.stack(sums.micro_loads)
        return wanted

    def _record_loads(self, layers: list[int], micro: torch.Tensor) -> None:
        """A finite step's router counts (micro [micro-batches, MoE layers, E], host): summed per layer into
        ``recent_loads`` (``expert_loads.json``), and each micro-batch into the window of ``step_loads``
        (``expert_loads_steps.npz``)."""
        total = micro.sum(dim=0)
        for i, layer in enumerate(layers):
            self.recent_loads[layer] = self.recent_loads.get(layer, 0) + total[i]
        for m in range(micro.shape[0]):
            self.step_loads.append((self.step, m, tuple(layers), micro[m].numpy().astype("int64")))

    def _previous_update_bad(self, host: dict) -> bool:
        """Whether the previous update made the weights non-finite; a verified-finite one ends a run of bad steps."""
        weights_bad = "weights_bad" in host and host["weights_bad"].item() > 0
        self._weights_check = None
        if "weights_bad" in host and not weights_bad:  # the previous update is verified finite
            self.bad_steps = 0
        return weights_bad

    def _drop_step(self, record: dict, weights_bad: bool, loss: float, grad_norm: float) -> None:
        """A bad step: its gradients and balance statistics are dropped; non-finite weights are rolled back."""
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.reset()
        if weights_bad:  # the previous update made them non-finite; this step ran on them
            self._roll_back(record)
        else:
            self.bad_steps += 1
            record.update(skipped=True)
            log.warning(
                "step %d: non-finite loss %s or gradient norm %s, step skipped (%d in a row)",
                self.step,
                loss,
                grad_norm,
                self.bad_steps,
            )
        record.update(loss=str(loss))

    def _update(
        self, record: dict, sums: StepSums, host: dict, layers: list, grad_norm: float, aux_total: float
    ) -> None:
        """A finite step: the optimiser update, the router-bias update (applied from the next step), QK-Clip, the
        step's metrics, and a weight check queued on the device to read with the next step."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.step(self.bias_buffers, reduce_fn=self.reduce_fn())
        if self.cfg.qk_clip:
            for i, m in sums.max_logits.items():
                qk_clip_(self.model.model.layers[i].self_attn, m, self.cfg.qk_clip)
            record["mla_max_logit"] = host["mla_max_logit"].item() if sums.max_logits else None
        metrics = metrics_from_rows(layers, host["metrics"].tolist()) if layers else {}
        if sums.micro_loads:
            self._record_loads(sorted(sums.loads), host["micro_loads"])
        record.update(
            grad_norm=grad_norm,
            aux_loss=aux_total,
            maxvio=metrics.get("maxvio/mean"),
            maxvio_max=metrics.get("maxvio/max"),
            dead_experts=metrics.get("dead/total"),
            drop_cf1=metrics.get("drop_cf1.0/mean"),  # token-slots over capacity 1.0 / 1.25 (global batch)
            drop_cf125=metrics.get("drop_cf1.25/mean"),
        )
        if sums.local_vio:  # means over micro-batches and MoE layers, this rank's
            micro, seq = host["local_vio"].double().mean(dim=0).tolist()
            record.update(maxvio_micro=micro, maxvio_seq=seq)
        self._weights_check = self.nonfinite_count()  # queued on the device, read with the next step

    # ------------------------------------------------------------------ forward
    def _forward_loss(self, batch, record: bool = False):
        """(summed cross-entropy, a device tensor; valid labels, counted on the host; model output). The batch goes
        to the device without a host sync, its offsets as k3.ops.segments.Segments (read on the host: no sync)."""
        ids = to_device(batch.input_ids, self.device)
        labels = to_device(batch.labels, self.device)
        cu = as_segments(batch.cu_seqlens, self.device)
        images = {}
        if hasattr(batch, "pixel_patches"):
            images = {"pixel_patches": to_device(batch.pixel_patches, self.device), "grid_hws": batch.grid_hws}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            out = self.model(ids, cu_seqlens=cu, record_attn_res=record, **images)
        loss_sum = F.cross_entropy(
            out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss_sum, int((batch.labels != IGNORE_INDEX).sum()), out

    def _mla_inputs_hook(self, captured: dict) -> list:
        """Forward pre-hooks on the MLA layers that keep each layer's largest attention logit in ``captured`` (for
        QK-Clip, ``docs/architecture.md#mla``); returns the hook handles."""
        hooks = []
        for i, layer in enumerate(self.model.model.layers):
            if isinstance(layer.self_attn, MultiheadLatentAttention):

                def hook(mod, args, i=i):
                    with torch.no_grad():
                        m = mla_max_logits(mod, args[0].detach(), args[1])
                    captured[i] = torch.maximum(captured[i], m) if i in captured else m

                hooks.append(layer.self_attn.register_forward_pre_hook(hook))
        return hooks
