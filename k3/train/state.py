"""The run's state of :class:`k3.train.trainer.Trainer`: resume, checkpoints, and the last verified-finite state.

A fused finiteness check of the weights after each update rides along the next step's one host transfer (or is read
before a save); non-finite weights are replaced by the last verified-finite state (weights, buffers and optimizer
state, kept in host memory: taken at the start and after every save, so it costs one copy of them in RAM and no
device memory) and the steps since it are lost. A non-finite checkpoint is never saved. See
``docs/architecture.md#checkpoints`` for the checkpoint layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from k3.fs import atomic_write_text
from k3.checkpoint.run import load_trainer_state, rng_state, save_checkpoint, set_rng_state
from k3.train.config import check_resume_config

log = logging.getLogger("k3.train")


class TrainingDiverged(RuntimeError):
    """Too many bad steps (non-finite loss, gradients or weights) in a row."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's piece of a (possibly distributed) tensor; itself for a plain tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (``path``: the file or the run directory; none: []); a partial last line
    (a kill mid-write) is dropped with a warning, a bad line elsewhere is an error."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                log.warning("%s: ignored a partial last line (an interrupted write): %r", path, line[:80])
                continue
            raise ValueError(f"{path}: line {i + 1} is not valid JSON; the metrics file is damaged") from None
    return out


class RunState:
    """Resume, save and the finite-state guard, mixed into :class:`k3.train.trainer.Trainer`
    (``load_state`` and ``trainer_state`` are hooks k3.distributed.train overrides)."""

    # ------------------------------------------------------------------ resume
    def load_state(self, ckpt) -> dict:
        """Optimizer state loaded from ``ckpt``; returns the trainer state (step, data, rng)."""
        state = load_trainer_state(ckpt)
        self.optimizer.load_state_dict(state["optimizer"])
        return state

    def resume_run(self) -> None:
        """Continue from ``self.resume_from``: optimizer state, data position, RNG states and step; the metrics past
        that step are dropped from metrics.jsonl."""
        cfg = self.cfg
        state = self.load_state(self.resume_from)
        check_resume_config(cfg, state.get("train_config") or {}, self.data_ranks(), state.get("data_ranks"))
        self.train_data.load_state_dict(state["data"])
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        self.step = state["step"]
        if self.step >= cfg.steps:
            raise ValueError(f"--resume: the run is already at step {self.step}; pass a larger --steps to extend it")
        if self.is_main:  # the one writer of metrics.jsonl (other ranks would race its rewrite)
            self.history = [h for h in read_metrics(self.metrics_path) if h["step"] < self.step]
            atomic_write_text(self.metrics_path, "".join(json.dumps(h) + "\n" for h in self.history))
        log.info("resumed %s at step %d", self.resume_from, self.step)

    # ------------------------------------------------------------------ saving
    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "data": self.train_data.state_dict(),
            "rng": rng_state(),
            "scheduler": {
                "kind": "cosine",
                "total_steps": self.cfg.steps,
                "warmup_frac": self.cfg.warmup_frac,
                "min_ratio": self.cfg.min_lr_ratio,
            },
            "train_config": dataclasses.asdict(self.cfg),
            "data_ranks": self.data_ranks(),
        }

    def save(self) -> Path:
        """Checkpoint the current step, with finite weights only: a pending or fresh weight check is read first
        (non-finite: the last finite state is restored and saved); afterwards that state is the new snapshot."""
        if not self.verify_weights() and self.nonfinite_count().item() > 0:
            raise TrainingDiverged("the weights are not finite and no finite state is kept; nothing was saved")
        path = save_checkpoint(
            self.run_dir,
            self.step,
            self.model,
            self.tokenizer,
            self.trainer_state(),
            keep=self.cfg.keep_checkpoints,
            write=self.write_model,
        )
        log.info("saved %s", path)
        self.snapshot()
        return path

    # ------------------------------------------------------------------ the last verified-finite state
    def _state_tensors(self) -> list[torch.Tensor]:
        """The floating tensors a divergence can poison, as this process's local pieces: weights, buffers (router
        biases) and optimizer state, in a fixed order."""
        out = [p for p in self.model.parameters()] + [b for b in self.model.buffers() if b.is_floating_point()]
        for p in self.model.parameters():
            out += [
                v
                for v in self.optimizer.state.get(p, {}).values()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
            ]
        return [_local(t) for t in out]

    @torch.no_grad()
    def nonfinite_count(self) -> torch.Tensor:
        """How many of the weights / buffers / optimizer-state tensors hold a NaN or inf, summed over processes: a
        device tensor, no host sync (one fused max-abs per tensor list; NaN and inf both make it non-finite)."""
        tensors = [t for t in self._state_tensors() if t.numel()]
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        if tensors:
            norms = torch._foreach_norm(tensors, float("inf"))
            count = count + (~torch.isfinite(torch.stack([n.float() for n in norms]))).sum().double()
        return self.all_sum(count)

    @torch.no_grad()
    def snapshot(self) -> None:
        """Keep the current (finite) state in host memory, to come back to if an update makes it non-finite."""
        params = list(self.model.parameters())
        self._snap_params = [_local(t).to("cpu", copy=True) for t in params]
        self._snap_buffers = [_local(b).to("cpu", copy=True) for b in self.model.buffers()]
        self._snap_optim = {
            i: {
                k: (_local(v).to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                for k, v in self.optimizer.state[p].items()
            }
            for i, p in enumerate(params)
            if p in self.optimizer.state
        }
        self.snapshot_step = self.step

    @torch.no_grad()
    def restore_snapshot(self) -> None:
        """Put back the state :meth:`snapshot` kept (in place: the optimizer keeps its parameters)."""
        params = list(self.model.parameters())
        for t, saved in zip(params, self._snap_params):
            _local(t).copy_(saved)
        for b, saved in zip(self.model.buffers(), self._snap_buffers):
            _local(b).copy_(saved)
        for i, p in enumerate(params):
            saved = self._snap_optim.get(i)
            if saved is None:
                self.optimizer.state.pop(p, None)
                continue
            state = self.optimizer.state[p]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(state.get(k), torch.Tensor):
                    _local(state[k]).copy_(v)
                else:
                    state[k] = v.to(_local(p).device) if isinstance(v, torch.Tensor) else v
        self._weights_check = None

    def _roll_back(self, record: dict | None) -> None:
        self.restore_snapshot()
        self.bad_steps += 1
        log.warning(
            "step %d: the weights became non-finite; restored those of step %d (%d bad in a row)",
            self.step,
            self.snapshot_step,
            self.bad_steps,
        )
        if record is not None:
            record.update(skipped="non-finite weights", restored_step=self.snapshot_step)

    def verify_weights(self) -> bool:
        """Read the weight check of the last update (or check now); roll back if non-finite. True: they were
        finite."""
        verifies_update = self._weights_check is not None
        pending = self._weights_check if verifies_update else self.nonfinite_count()
        self._weights_check = None
        if pending.item() > 0:
            self._roll_back(None)
            return False
        if verifies_update:
            self.bad_steps = 0
        return True
