"""``torchrun --nproc-per-node N -m k3 train ... --dp D --ep E --cp C``: the trainer on a DeviceMesh.

Same loop as :class:`k3.train.trainer.Trainer`, with the parallelisms applied to the built model (in this order:
expert parallelism, FSDP2; then the optimiser; context parallelism shards the batches instead, see
k3.distributed.context_parallel) and these differences:

* Batches. ``--batch-size`` is rows per data-parallel rank (global batch = dp x batch-size rows). Every rank
  reads the same global batch from the same stream (so the data position is one number), keeps the rows of its
  ``dp`` rank and, under CP, the contiguous columns of its ``cp`` rank (offsets carrying the CP shard). The
  step's loss is the sum of token losses over every rank divided by the GLOBAL count of valid labels, so gradients
  summed over ranks (FSDP with divide factor 1, :func:`k3.distributed.fsdp.reduce_expert_grads`) are those of one
  process on the whole batch.
* Router balancing. QB histograms (and sign-update loads) are all-reduced over every rank before the bias update
  (docs/architecture.md#quantile-balancing), so the bias equals the single-process QB of the same global batch up to
  the histogram's bin.
  Auxiliary losses are averaged over ranks. ``qb_exact`` and QK-Clip are single-process only.
* Checkpoints are torch.distributed.checkpoint directories (``checkpoints/step-N``, resharding on load: resume
  with another dp / ep, or load on one process with :func:`k3.checkpoint.dcp.load_into_single`), plus
  ``config.json`` and ``tokenizer.json`` beside them. Rank 0 writes metrics and the loss / expert-load plots;
  greedy samples and the AttnRes plot are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from k3.config.hf import to_hf_config
from k3.checkpoint.dcp import load as dcp_load
from k3.checkpoint.dcp import save as dcp_save
from k3.distributed.context_parallel import ContextParallel
from k3.distributed.expert_parallel import apply_expert_parallel, comm_stats
from k3.distributed.fsdp import apply_fsdp, clip_grad_norm_, reduce_expert_grads
from k3.distributed.mesh import ParallelDims, init_distributed
from k3.train import plots
from k3.checkpoint.run import publish_checkpoint
from k3.data.batch import Batch
from k3.train.trainer import Trainer, TrainConfig

log = logging.getLogger("k3.train")


def select_rows(batch: Batch, start: int, count: int) -> Batch:
    """Rows [start, start + count) of a [B, T] batch, with cu_seqlens cut to them (every row boundary is one)."""
    t = batch.input_ids.shape[1]
    lo, hi = start * t, (start + count) * t
    cu = [c - lo for c in batch.cu_seqlens.tolist() if lo <= c <= hi]
    return Batch(batch.input_ids[start : start + count], batch.labels[start : start + count], torch.tensor(cu))


class DistributedTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, dims: ParallelDims, resume: bool = False, progress: bool = True):
        if cfg.task != "text":
            raise ValueError(f"distributed training runs --task text (--task {cfg.task} is single-process)")
        if cfg.init_from:
            raise ValueError("--init-from is single-process (distributed runs build their model from the preset)")
        if cfg.qk_clip:
            raise ValueError("--qk-clip is single-process only (its per-head logit maxima are not reduced)")
        if cfg.balance == "qb_exact":
            raise ValueError("--balance qb_exact is single-process; use qb (histograms, all-reduced)")
        if dims.cp > 1 and cfg.seq_len % dims.cp:
            raise ValueError(f"--seq-len={cfg.seq_len} must be divisible by --cp={dims.cp}")
        self.dims = dims
        self.meshes = init_distributed(dims)
        self.context_parallel = ContextParallel(self.meshes.cp.get_group()) if dims.cp > 1 else None
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        if resume and cfg.tokenizer is None and (Path(cfg.out) / "tokenizer.json").is_file():
            cfg = dataclasses.replace(cfg, tokenizer=str(Path(cfg.out) / "tokenizer.json"))
        if cfg.device == "auto":
            cfg = dataclasses.replace(
                cfg, device=f"cuda:{torch.cuda.current_device()}" if self.meshes.device_type == "cuda" else "cpu"
            )
        super().__init__(cfg, resume=resume, progress=progress)
        log.info(
            "rank %d of %d: dp %d (ep %d), cp %d on %s",
            self.rank,
            dist.get_world_size(),
            dims.dp,
            dims.ep,
            dims.cp,
            self.meshes.device_type,
        )

    # ------------------------------------------------------------------ set-up hooks
    def model_checkpoint(self, ckpt):
        return None  # the model is built fresh and filled from the DCP checkpoint after parallelize()

    def parallelize(self, model):
        apply_expert_parallel(model, self.meshes)
        return apply_fsdp(model, self.meshes)

    def load_state(self, ckpt) -> dict:
        return dcp_load(ckpt, self.model, self.optimizer)

    # ------------------------------------------------------------------ step hooks
    def _local(self, batch: Batch) -> Batch:
        """This rank's rows (dp) and columns (cp) of a global batch; under CP its offsets are Segments that carry
        the shard (k3.distributed.context_parallel), which the model's layers then run."""
        rows = batch.input_ids.shape[0] // self.dims.dp
        local = select_rows(batch, self.meshes.dp.get_local_rank() * rows, rows)
        if self.context_parallel is not None:
            local = Batch(*self.context_parallel.shard(local.input_ids, local.labels, local.cu_seqlens))
        return local

    def next_batches(self) -> list:
        return [
            self._local(self.train_data.next_batch(self.cfg.batch_size * self.dims.dp))
            for _ in range(self.cfg.grad_accum)
        ]

    def eval_batch(self, rows: list[int]):
        # pad the row list to a multiple of dp with repeats that carry no labels
        batch = self.val_data.rows_batch(rows + rows[:1] * (-len(rows) % self.dims.dp))
        if len(rows) % self.dims.dp:
            batch.labels[len(rows) :] = -100
        return self._local(batch)

    def all_sum(self, value):
        """A device tensor is summed on the device (no host sync); a number through a float64 device tensor
        (nccl: on the GPU), made by a fill rather than a host-to-device copy, so its read is the one sync."""
        tensor = isinstance(value, torch.Tensor)
        t = value.clone() if tensor else torch.full((), float(value), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.meshes.dp_cp.get_group())
        if tensor:
            return t
        return t.item() if isinstance(value, float) else int(round(t.item()))

    def data_ranks(self) -> int:
        return self.dims.dp * self.dims.cp

    def reduce_fn(self):
        group = self.meshes.dp_cp.get_group()
        return lambda t: dist.all_reduce(t, group=group)

    def after_backward(self) -> None:
        reduce_expert_grads(self.model, self.meshes)

    def clip(self) -> torch.Tensor:
        return clip_grad_norm_(self.model, self.cfg.clip, self.meshes)

    def train_step(self) -> dict:
        """The base step; tokens and tokens/s for the global batch, tokens/s per GPU, and under expert parallelism
        the seconds each rank spent in all-to-alls (``a2a_s_per_rank``; ``a2a_share`` = the slowest rank's share
        of the step) and the latent rows each rank's experts received (``ep_rows_per_rank``, forward)."""
        stats = comm_stats(self.model)
        if stats is not None:
            stats.take()  # drop what evaluation or sampling sent since the last step
        record = super().train_step()
        record["tokens"] *= self.dims.dp
        record["tokens_per_s"] *= self.dims.dp
        world = dist.get_world_size()
        record["tokens_per_s_per_gpu"] = record["tokens_per_s"] / world
        if stats is not None:
            c = stats.take()
            mine = torch.tensor([c["a2a_s"], c["rows_received"]], dtype=torch.float64, device=self.device)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            a2a, rows = torch.stack(every).cpu().unbind(1)
            record["a2a_s_per_rank"] = [round(x, 6) for x in a2a.tolist()]
            record["a2a_share"] = float(a2a.max()) / record["step_time"]
            record["ep_rows_per_rank"] = [int(x) for x in rows.tolist()]
            record["ep_rows_imbalance"] = float(rows.max() / rows.mean().clamp_min(1))
        return record

    # ------------------------------------------------------------------ saving, plots, samples
    def trainer_state(self) -> dict:
        state = super().trainer_state()
        state.pop("optimizer")  # in the DCP state
        state["rng"] = None  # per-rank RNG states are not one value; dropout-free training does not need them
        return state

    def save(self) -> Path:
        """DCP state on every rank, then (rank 0) config.json + tokenizer.json beside it and the ``latest``
        pointer, so the directory counts as complete only once all of it is written."""
        path = self.run_dir / "checkpoints" / f"step-{self.step:06d}"
        dcp_save(path, self.model, self.optimizer, {**self.trainer_state(), "parallel": dataclasses.asdict(self.dims)})
        if self.is_main:
            (path / "config.json").write_text(json.dumps(to_hf_config(self.model_cfg), indent=2))
            self.tokenizer.save(path)
            publish_checkpoint(path, self.cfg.keep_checkpoints)
        dist.barrier()
        log.info("saved %s (DCP, %d ranks)", path, dist.get_world_size())
        return path

    def write_plots(self) -> None:
        if self.is_main:
            plots.loss_curves(self.history, self.run_dir / "loss.png")
            plots.maxvio_curves(self.history, self.run_dir / "maxvio.png")
            if self.recent_loads:  # this rank's loads
                plots.expert_load_heatmap(self.recent_loads, self.run_dir / "expert_load.png")
            self.write_loads()
        self.recent_loads = {}

    def sample(self) -> list[tuple[str, str]]:
        return []
