"""The training loop behind ``k3 train``.

One step: ``grad_accum`` micro-batches of packed rows (documents never cross ``cu_seqlens`` boundaries) ->
cross-entropy summed over valid labels and divided by the step's valid-label count (so accumulation equals
one big batch) + the balancer's auxiliary loss -> skip the step if the loss is not finite -> clip -> K3Muon
(per-head Muon + AdamW) at lr * cosine(step) -> router-bias update from the whole step's statistics (QB by
default), applied from the next step -> optional QK-Clip of the MLA layers -> metrics.jsonl. With ``qat`` the
routed experts are fake-quantised (k3.quant.qat) and the optimiser updates the high-precision masters.

Divergence: a step whose loss, auxiliary loss, gradient norm or router scores are not finite is skipped. A
fused finiteness check of the weights after each update rides along the next step's one host transfer (or is
read before a save); non-finite weights are replaced by the last verified-finite state (weights, buffers and
optimizer state, kept in host memory: taken at the start and after every save, so it costs one copy of them in
RAM and no device memory) and the steps since it are lost. ``max_bad_steps`` bad steps in a row stop the run
with a finite checkpoint; a non-finite one is never saved.

The run directory holds ``train_config.json``, ``metrics.jsonl``, ``tokenizer.json``, the plots, ``.lock``
and ``checkpoints/`` (see :mod:`k3.train.checkpoint`). ``resume`` continues bitwise-identically: weights, router
biases, optimizer state, RNG states and the data position are restored, and the schedule is a function of
the step and ``schedule_steps``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from k3.config import get_preset
from k3.convert.checkpoint import from_pretrained
from k3.infer.generate import greedy_generate
from k3.model.balance import BALANCE_METHODS, Balancer, balance_metric_rows, max_vio, metrics_from_rows, seq_max_vio
from k3.model.decoder import K3ForCausalLM
from k3.model.mla import MultiheadLatentAttention
from k3.ops.segments import offsets_to, to_device
from k3.quant.mx import MODES as MX_MODES
from k3.quant.qat import RECIPES as QAT_RECIPES, enable_qat
from k3.train.activation_checkpoint import apply_activation_checkpointing
from k3.convert.atomic import atomic_write_text
from k3.convert.checkpoint import latest_checkpoint
from k3.train import plots
from k3.train.checkpoint import RunLock, clean_stray, load_trainer_state, rng_state, save_checkpoint, set_rng_state
from k3.data.text import IGNORE_INDEX, PackedDataset, load_corpus
from k3.train.optim import K3Muon, clip_grad_norm, cosine_schedule, describe_groups, mla_max_logits, \
    param_groups_for, qk_clip_
from k3.data.tokenizer import Tokenizer, train_bpe

log = logging.getLogger("k3.train")


TASKS = ("text", "vision")


class TrainingDiverged(RuntimeError):
    """Too many bad steps (non-finite loss, gradients or weights) in a row."""


# fields a resume may change: where and how often it reports and saves, the device, the step count (the schedule
# keeps its recorded length, ``schedule_steps``), and the tokenizer (a resumed run reads its checkpoint's)
RESUME_MAY_CHANGE = ("out", "device", "steps", "schedule_steps", "save_every", "eval_every", "samples",
                     "keep_checkpoints", "tokenizer")

@dataclass
class TrainConfig:
    preset: str = "small"
    task: str = "text"  # "text" (language modelling on --data) or "vision" (the embedded image Q&A task)
    overrides: dict = field(default_factory=dict)  # dotted K3Config fields, e.g. {"moe.num_experts": 16}
    data: str | None = None  # None: the Python standard library's own sources
    tokenizer: str | None = None  # tokenizer.json / directory, or a tiktoken .model file; None: train a BPE
    vocab_size: int = 8192
    tokenizer_train_bytes: int = 4_000_000  # BPE training text budget (from the training split)
    max_tokens: int | None = 3_000_000  # cap on the tokenised training stream
    steps: int = 120
    schedule_steps: int | None = None  # the cosine schedule's length (None: steps); a resume that extends keeps it
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.01
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    per_head_muon: bool = True
    balance: str = "qb"
    qk_clip: float | None = None  # tau for QK-Clip on MLA layers (K2 used 100); None = off
    qat: str | None = None  # k3.quant.qat.RECIPES key: fake-quantised routed experts (MXFP4 / MXFP8); None = off
    qat_scale_mode: str = "floor"  # MX scale rule for QAT: floor (OCP) or rceil
    activation_checkpointing: bool = False  # recompute each mixer / FFN in the backward pass (less memory)
    eval_every: int = 20
    eval_rows: int = 32  # validation rows per evaluation (all if fewer)
    save_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 3
    samples: int = 3  # greedy continuations printed at the end
    max_bad_steps: int = 3
    out: str = "runs/small"
    seed: int = 0
    device: str = "auto"

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "vocab_size", "eval_every", "eval_rows",
                     "max_bad_steps", "schedule_steps"):
            v = getattr(self, name)
            if name == "schedule_steps" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}={v!r} must be a positive integer")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"--lr={self.lr!r} must be a positive number")
        if self.task not in TASKS:
            raise ValueError(f"--task={self.task!r} must be one of {', '.join(TASKS)}")
        if self.balance not in BALANCE_METHODS:
            raise ValueError(f"--balance={self.balance!r} must be one of {', '.join(BALANCE_METHODS)}")
        if self.qat is not None and self.qat not in QAT_RECIPES:
            raise ValueError(f"--qat={self.qat!r} must be one of {', '.join(QAT_RECIPES)}")
        if self.qat_scale_mode not in MX_MODES:
            raise ValueError(f"--qat-scale-mode={self.qat_scale_mode!r} must be one of {', '.join(MX_MODES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device={self.device!r} must be auto, cpu or cuda[:N]")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={name} but no CUDA device is available")
    return torch.device(name)


def _load_tokenizer(path: str) -> Tokenizer:
    p = Path(path)
    if p.is_dir() or p.suffix == ".json":
        return Tokenizer.load(p)
    return Tokenizer.from_tiktoken(p)



def write_expert_loads(loads: dict[int, torch.Tensor], path: Path) -> None:
    """Each MoE layer's token-slots per expert since the previous write (this process's tokens), as JSON
    ``{"layers": {layer: [counts...]}}``: what ``k3 plan --loads RUN_DIR`` reads."""
    layers = {str(layer): [int(x) for x in torch.as_tensor(t).tolist()] for layer, t in sorted(loads.items())}
    atomic_write_text(path, json.dumps({"layers": layers}))

class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False, progress: bool = True):
        cfg.validate()
        self.cfg, self.progress = cfg, progress
        self.is_main = getattr(self, "is_main", True)  # the process that writes metrics, plots, configs
        self.run_dir = Path(cfg.out)
        self.device = _device(cfg.device)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.lock = RunLock(self.run_dir)
        if self.is_main:  # one holder per run (the ranks of one run share it)
            self.lock.acquire()
        try:
            self._setup(cfg, resume)
        except BaseException:
            self.lock.release()
            raise

    def _setup(self, cfg: TrainConfig, resume: bool) -> None:
        if self.is_main:
            clean_stray(self.run_dir)
        ckpt = latest_checkpoint(self.run_dir) if resume else None
        if resume and ckpt is None:
            raise FileNotFoundError(f"--resume: {self.run_dir} has no checkpoint to resume from")
        if not resume and self.metrics_path.exists():
            raise ValueError(f"{self.run_dir} already holds a run; pass --resume to continue it or another --out")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt, self.resume_from = self.model_checkpoint(ckpt), ckpt
        torch.manual_seed(cfg.seed)

        if cfg.task == "vision":
            self._setup_vision(ckpt)
        else:
            self._setup_text(ckpt)
        self.model_cfg = self.model.config
        self.model = self.parallelize(self.model)
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(self.model, self.recompute_context())
        if cfg.qat:
            weights, acts = QAT_RECIPES[cfg.qat]
            enable_qat(self.model, weights, acts, cfg.qat_scale_mode)
            log.info("QAT %s: routed experts run on %s weights and %s inputs (%s scales); checkpoints hold the "
                     "high-precision masters; export packed with k3 convert --quantize mxfp4 --scale-mode %s",
                     cfg.qat, weights, acts or "high-precision", cfg.qat_scale_mode, cfg.qat_scale_mode)
        groups = param_groups_for(self.model, cfg.lr, cfg.weight_decay, per_head=cfg.per_head_muon)
        ns_dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.optimizer = K3Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, ns_dtype=ns_dtype)
        log.info("optimizer groups:\n%s", describe_groups(self.optimizer.param_groups))
        moe = self.model_cfg.moe
        self.balancer = Balancer(cfg.balance, moe.num_experts, moe.num_experts_per_token)
        self.bias_buffers = {i: layer.block_sparse_moe.gate.e_score_correction_bias
                             for i, layer in enumerate(self.model.model.layers) if hasattr(layer, "block_sparse_moe")}
        self.step = 0
        self.bad_steps = 0
        self.history: list[dict] = []
        self.recent_loads: dict[int, torch.Tensor] = {}
        self._weights_check: torch.Tensor | None = None  # non-finite weight count after the last update
        if self.resume_from is not None:
            state = self.load_state(self.resume_from)
            check_resume_config(cfg, state.get("train_config") or {}, self.data_ranks(), state.get("data_ranks"))
            self.train_data.load_state_dict(state["data"])
            if state.get("rng") is not None:
                set_rng_state(state["rng"])
            self.step = state["step"]
            if self.step >= cfg.steps:
                raise ValueError(f"--resume: the run is already at step {self.step}; pass a larger --steps to "
                                 "extend it")
            if self.is_main:  # the one writer of metrics.jsonl (other ranks would race its rewrite)
                self.history = [h for h in read_metrics(self.metrics_path) if h["step"] < self.step]
                atomic_write_text(self.metrics_path, "".join(json.dumps(h) + "\n" for h in self.history))
            log.info("resumed %s at step %d", self.resume_from, self.step)
        if self.is_main:
            atomic_write_text(self.run_dir / "train_config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        self.snapshot()
        n = sum(p.numel() for p in self.model.parameters())
        log.info("model %s: %.2fM parameters on %s, autocast %s", self.model_cfg.name, n / 1e6, self.device.type,
                 "bf16" if self.device.type == "cuda" else "off (fp32)")

    # ------------------------------------------------------------------ hooks (k3.distributed.train overrides them)
    def model_checkpoint(self, ckpt):
        """The checkpoint directory the model and tokenizer are read from on resume (here: the latest one)."""
        return ckpt

    def parallelize(self, model):
        """Applied to the built model before the optimiser is made (single process: nothing)."""
        return model

    def recompute_context(self):
        """The ``context_fn`` activation checkpointing recomputes under (single process: none)."""
        return None

    def load_state(self, ckpt) -> dict:
        """Optimizer state loaded from ``ckpt``; returns the trainer state (step, data, rng)."""
        state = load_trainer_state(ckpt)
        self.optimizer.load_state_dict(state["optimizer"])
        return state

    # ------------------------------------------------------------------ the last verified-finite state
    def _state_tensors(self) -> list[torch.Tensor]:
        """The floating tensors a divergence can poison, as this process's local pieces: weights, buffers (router
        biases) and optimizer state, in a fixed order."""
        out = [p for p in self.model.parameters()] + [b for b in self.model.buffers() if b.is_floating_point()]
        for p in self.model.parameters():
            out += [v for v in self.optimizer.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point()]
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
        self._snap_optim = {i: {k: (_local(v).to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                                for k, v in self.optimizer.state[p].items()}
                            for i, p in enumerate(params) if p in self.optimizer.state}
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
        log.warning("step %d: the weights became non-finite; restored those of step %d (%d bad in a row)",
                    self.step, self.snapshot_step, self.bad_steps)
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

    def next_batches(self) -> list:
        """This process's micro-batches of the step."""
        return [self.train_data.next_batch(self.cfg.batch_size) for _ in range(self.cfg.grad_accum)]

    def eval_batch(self, rows: list[int]):
        return self.val_data.rows_batch(rows)

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

    def _setup_text(self, ckpt) -> None:
        cfg = self.cfg
        train_docs = load_corpus(cfg.data, "train")
        val_docs = load_corpus(cfg.data, "validation")
        if ckpt is not None:
            self.tokenizer = Tokenizer.load(ckpt)
        elif cfg.tokenizer:
            self.tokenizer = _load_tokenizer(cfg.tokenizer)
        else:
            t0 = time.perf_counter()
            self.tokenizer = train_bpe(_text_budget(train_docs, cfg.tokenizer_train_bytes), cfg.vocab_size)
            log.info("trained a byte-level BPE tokenizer (vocab %d) in %.1fs", self.tokenizer.vocab_size,
                     time.perf_counter() - t0)
        if self.is_main:
            self.tokenizer.save(self.run_dir)
        t0 = time.perf_counter()
        self.train_data = PackedDataset(train_docs, self.tokenizer, cfg.seq_len, seed=cfg.seed,
                                        max_tokens=cfg.max_tokens)
        self.val_data = PackedDataset(val_docs, self.tokenizer, cfg.seq_len, seed=cfg.seed, shuffle=False,
                                      max_tokens=cfg.eval_rows * cfg.seq_len + 1)
        self.val_docs = val_docs
        log.info("data: train %r, validation %r (%.1fs)", self.train_data, self.val_data, time.perf_counter() - t0)

        if ckpt is not None:
            self.model = from_pretrained(ckpt, device=self.device)
        else:
            model_cfg = get_preset(cfg.preset).replace(
                vocab_size=self.tokenizer.vocab_size, eos_token_id=self.tokenizer.eos_id,
                bos_token_id=self.tokenizer.bos_id, **cfg.overrides)
            self.model = K3ForCausalLM(model_cfg).to(self.device)

    def _setup_vision(self, ckpt) -> None:
        """The embedded image Q&A task: its own tiny tokenizer and the preset with its vision tower."""
        from k3.config.presets import with_vision
        from k3.model.multimodal import K3ForConditionalGeneration
        from k3.data.vision import VisionTaskData, media_ids, task_tokenizer

        cfg = self.cfg
        self.tokenizer = Tokenizer.load(ckpt) if ckpt is not None else task_tokenizer(cfg.vocab_size)
        if self.is_main:
            self.tokenizer.save(self.run_dir)
        if ckpt is not None:
            self.model = from_pretrained(ckpt, device=self.device)
        else:
            model_cfg = with_vision(get_preset(cfg.preset)).replace(
                vocab_size=self.tokenizer.vocab_size, eos_token_id=self.tokenizer.eos_id,
                bos_token_id=self.tokenizer.bos_id, **media_ids(self.tokenizer), **cfg.overrides)
            self.model = K3ForConditionalGeneration(model_cfg).to(self.device)
        vision = self.model.config.vision
        self.train_data = VisionTaskData(self.tokenizer, vision, "train", cfg.seed)
        self.val_data = VisionTaskData(self.tokenizer, vision, "validation", cfg.seed, rows=cfg.eval_rows)
        self.val_docs = []
        log.info("data: the embedded vision task (k3.vision.task), %d held-out examples", cfg.eval_rows)

    # ------------------------------------------------------------------ one step
    def _forward_loss(self, batch, record: bool = False):
        """(summed cross-entropy, a device tensor; valid labels, counted on the host; model output). The batch goes
        to the device without a host sync, its offsets with their host copy (see k3.ops.segments.offsets_to)."""
        ids = to_device(batch.input_ids, self.device)
        labels = to_device(batch.labels, self.device)
        cu = offsets_to(batch.cu_seqlens, self.device)
        images = {}
        if hasattr(batch, "pixel_patches"):
            images = {"pixel_patches": to_device(batch.pixel_patches, self.device), "grid_hws": batch.grid_hws}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            out = self.model(ids, cu_seqlens=cu, record_attn_res=record, **images)
        loss_sum = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        return loss_sum, int((batch.labels != IGNORE_INDEX).sum()), out

    def _mla_inputs_hook(self, captured: dict):
        hooks = []
        for i, layer in enumerate(self.model.model.layers):
            if isinstance(layer.self_attn, MultiheadLatentAttention):
                def hook(mod, args, i=i):
                    with torch.no_grad():
                        m = mla_max_logits(mod, args[0].detach(), args[1])
                    captured[i] = torch.maximum(captured[i], m) if i in captured else m
                hooks.append(layer.self_attn.register_forward_pre_hook(hook))
        return hooks

    def train_step(self) -> dict:
        """One optimiser step. Everything the host needs from the device (the loss and auxiliary-loss sums, the
        gradient norm, balance metrics, expert loads, the MLA logit maximum) comes back in one transfer, a single
        process's one host sync outside the model; the update is then queued without waiting for the device."""
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = cfg.lr * cosine_schedule(self.step, cfg.schedule_steps or cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        batches = self.next_batches()
        valid = int(self.all_sum(sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)))
        max_logits: dict[int, torch.Tensor] = {}
        hooks = self._mla_inputs_hook(max_logits) if cfg.qk_clip else []
        # float64 sums on the device, added in micro-batch order: the numbers Python floats would give
        total = aux_total = torch.zeros((), dtype=torch.float64, device=self.device)
        stats_all = []
        # per micro-batch and MoE layer: (micro-batch MaxVio, per-sequence MaxVio), device tensors. Both cover this
        # rank's tokens only (under data parallelism its rows, under context parallelism its slices of them); the
        # global-batch MaxVio below is over every rank.
        local_vio = []
        loads: dict[int, torch.Tensor] = {}  # this rank's, per layer
        try:
            for b in batches:
                loss_sum, _, out = self._forward_loss(b)
                cu = offsets_to(b.cu_seqlens, self.device)
                aux = self.balancer.observe(out.router_stats, cu) / (cfg.grad_accum * self.data_ranks())
                (loss_sum / valid + aux).backward()
                total = total + loss_sum.detach().double()
                aux_total = aux_total + aux.detach().double()
                stats_all += [dataclasses.replace(s, scores=s.scores.detach()) for s in out.router_stats]
                with torch.no_grad():
                    for s in out.router_stats:
                        ld = s.loads
                        loads[s.layer] = loads[s.layer] + ld if s.layer in loads else ld
                        local_vio.append(torch.stack([max_vio(ld), seq_max_vio(s.topk_idx, cu, s.num_experts)]))
        finally:
            for h in hooks:
                h.remove()
        self.after_backward()
        total, aux_total = self.all_sum(total), self.all_sum(aux_total)  # every rank skips a bad step or none
        # computed whether or not the step is skipped (a skipped step drops its gradients), so one read serves both
        grad_norm = self.clip()
        layers, rows = balance_metric_rows(stats_all, reduce_fn=self.reduce_fn())  # global batch over ranks
        wanted = {"sums": torch.stack([total, aux_total]), "grad_norm": grad_norm}
        if stats_all:
            wanted["scores_finite"] = torch.stack([torch.isfinite(s.scores).all() for s in stats_all]).all()
        if self._weights_check is not None:  # the previous update's weight check, read with this step's numbers
            wanted["weights_bad"] = self._weights_check
        if layers:
            wanted["metrics"] = rows
        if local_vio:
            wanted["local_vio"] = torch.stack(local_vio)
        if max_logits:
            wanted["mla_max_logit"] = torch.stack([m.max() for m in max_logits.values()]).max()
        wanted.update({("loads", layer): ld for layer, ld in loads.items()})
        host = to_host(wanted, self.device)
        (total, aux_total), grad_norm = host["sums"].tolist(), host["grad_norm"].item()
        loss = total / valid
        record = {"step": self.step, "loss": loss, "lr": lr, "tokens": (self.step + 1) * cfg.batch_size *
                  cfg.grad_accum * cfg.seq_len}
        weights_bad = "weights_bad" in host and host["weights_bad"].item() > 0
        self._weights_check = None
        if "weights_bad" in host and not weights_bad:  # the previous update is verified finite
            self.bad_steps = 0
        finite = (math.isfinite(loss) and math.isfinite(aux_total) and math.isfinite(grad_norm)
                  and bool(host.get("scores_finite", True)))
        if weights_bad or not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.balancer.reset()
            if weights_bad:  # the previous update made them non-finite; this step ran on them
                self._roll_back(record)
            else:
                self.bad_steps += 1
                record.update(skipped=True)
                log.warning("step %d: non-finite loss %s or gradient norm %s, step skipped (%d in a row)",
                            self.step, loss, grad_norm, self.bad_steps)
            record.update(loss=str(loss))
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.balancer.step(self.bias_buffers, reduce_fn=self.reduce_fn())
            if cfg.qk_clip:
                for i, m in max_logits.items():
                    qk_clip_(self.model.model.layers[i].self_attn, m, cfg.qk_clip)
                record["mla_max_logit"] = host["mla_max_logit"].item() if max_logits else None
            metrics = metrics_from_rows(layers, host["metrics"].tolist()) if layers else {}
            for layer in loads:
                self.recent_loads[layer] = self.recent_loads.get(layer, 0) + host["loads", layer]
            record.update(grad_norm=grad_norm, aux_loss=aux_total, maxvio=metrics.get("maxvio/mean"),
                          maxvio_max=metrics.get("maxvio/max"), dead_experts=metrics.get("dead/total"))
            if local_vio:  # means over micro-batches and MoE layers, this rank's
                micro, seq = host["local_vio"].double().mean(dim=0).tolist()
                record.update(maxvio_micro=micro, maxvio_seq=seq)
            self._weights_check = self.nonfinite_count()  # queued on the device, read with the next step
        dt = time.perf_counter() - t0
        record.update(step_time=dt, tokens_per_s=cfg.batch_size * cfg.grad_accum * cfg.seq_len / dt)
        return record

    # ------------------------------------------------------------------ evaluation, saving, plots
    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        total, count = torch.zeros((), dtype=torch.float64, device=self.device), 0
        rows, bs = min(self.cfg.eval_rows, self.val_data.num_rows), self.cfg.batch_size
        for start in range(0, rows, bs):
            loss_sum, n, _ = self._forward_loss(self.eval_batch(list(range(start, min(start + bs, rows)))))
            total, count = total + loss_sum.double(), count + n
        total, count = self.all_sum(total).item(), self.all_sum(count)
        self.model.train()
        loss = total / max(count, 1)
        out = {"val_loss": loss, "val_bpb": loss / math.log(2) / self.val_data.bytes_per_token}
        if self.cfg.task == "vision":
            out |= {f"val_acc_{k}": v for k, v in self.vision_accuracy(self.cfg.eval_rows)[0].items()}
        return out

    @torch.no_grad()
    def vision_accuracy(self, n: int) -> tuple[dict[str, float], list[tuple]]:
        """Greedy answers to the first n held-out questions (through the inference engine, images encoded once):
        exact-match accuracy per question type and overall, and (question, answer, prediction) triples."""
        from k3.infer.engine import Engine
        from k3.infer.sampling import SamplingParams
        from k3.vision.task import score

        examples = [self.val_data.example(i) for i in range(n)]
        pad = self.model_cfg.vision.media_placeholder_token_id
        engine = Engine(self.model, self.tokenizer, max_batch=min(n, 64), prefill_chunk=4096, cuda_graphs=False)
        prompts = [[pad] + self.tokenizer.encode(" " + e.question) for e in examples]
        ids = [engine.add(p, SamplingParams(max_tokens=4, temperature=0.0), images=[e.image])
               for p, e in zip(prompts, examples)]
        done = {i: "" for i in ids}
        while engine.has_work():
            for o in engine.step():
                done[o.request_id] += o.text
        preds = [done[i].strip() for i in ids]
        self.model.train()
        return score(preds, examples), [(e.question, e.answer, p) for e, p in zip(examples, preds)]

    def trainer_state(self) -> dict:
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "data": self.train_data.state_dict(),
                "rng": rng_state(), "scheduler": {"kind": "cosine", "total_steps": self.cfg.steps,
                                                  "warmup_frac": self.cfg.warmup_frac,
                                                  "min_ratio": self.cfg.min_lr_ratio},
                "train_config": dataclasses.asdict(self.cfg), "data_ranks": self.data_ranks()}

    def save(self) -> Path:
        """Checkpoint the current step, with finite weights only: a pending or fresh weight check is read first
        (non-finite: the last finite state is restored and saved); afterwards that state is the new snapshot."""
        if not self.verify_weights() and self.nonfinite_count().item() > 0:
            raise TrainingDiverged("the weights are not finite and no finite state is kept; nothing was saved")
        path = save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer, self.trainer_state(),
                               keep=self.cfg.keep_checkpoints)
        log.info("saved %s", path)
        self.snapshot()
        return path

    def write_plots(self) -> None:
        plots.loss_curves(self.history, self.run_dir / "loss.png")
        plots.maxvio_curves(self.history, self.run_dir / "maxvio.png")
        if self.recent_loads:
            plots.expert_load_heatmap(self.recent_loads, self.run_dir / "expert_load.png")
            write_expert_loads(self.recent_loads, self.run_dir / "expert_loads.json")
        if self.model_cfg.attn_res.mode != "none":
            b = self.val_data.rows_batch([0])
            self.model.eval()
            with torch.no_grad():
                _, _, out = self._forward_loss(b, record=True)
            self.model.train()
            plots.attn_res_weights(out.attn_res_weights, self.run_dir / "attn_res.png")
        self.recent_loads = {}

    def sample(self) -> list[tuple[str, str]]:
        """Greedy continuations of the openings (24 tokens) of the first validation documents (vision task: the
        first held-out questions with the expected and the predicted answer)."""
        if self.cfg.task == "vision":
            _, triples = self.vision_accuracy(max(self.cfg.samples, 1))
            return [(f"[image] {q} (expected: {a})", p) for q, a, p in triples]
        eos = self.tokenizer.eos_id
        out = []
        self.model.eval()
        for doc in self.val_docs[: self.cfg.samples]:
            prompt = self.tokenizer.encode(doc.text[:2000])[:24]
            if not prompt:
                continue
            ids = greedy_generate(self.model, torch.tensor([prompt], device=self.device), 48, eos_token_id=eos)
            out.append((self.tokenizer.decode(prompt), self.tokenizer.decode(ids[0, len(prompt):].tolist())))
        self.model.train()
        return out

    # ------------------------------------------------------------------ the loop
    def run(self, stop_at: int | None = None) -> dict:
        """Train to ``cfg.steps`` (or stop after step ``stop_at`` without the final save, as an interruption
        would), then save, plot and return {"checkpoint", "history"}."""
        if self.is_main:
            self.lock.acquire()  # released when a run ends, so the same process may resume in a new Trainer
        try:
            return self._run(stop_at)
        finally:
            self.lock.release()

    def _run(self, stop_at: int | None) -> dict:
        cfg = self.cfg
        self.model.train()
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not (self.progress and self.is_main), desc="train",
                   unit="step")
        with open(self.metrics_path, "a") if self.is_main else contextlib.nullcontext() as metrics_file:
            while self.step < cfg.steps:
                if stop_at is not None and self.step >= stop_at:
                    bar.close()
                    return {"checkpoint": None, "history": self.history}
                start = {f"{k}_init": v for k, v in self.evaluate().items()} if self.step == 0 else {}
                record = self.train_step()
                record.update(start)
                if (self.step + 1) % cfg.eval_every == 0 or self.step + 1 == cfg.steps:
                    record.update(self.evaluate())
                self.history.append(record)
                if metrics_file is not None:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}" if not record.get("skipped") else "nan",
                                tok_s=f"{record['tokens_per_s']:.0f}", lr=f"{record['lr']:.2e}",
                                maxvio=f"{record['maxvio']:.2f}" if record.get("maxvio") is not None else "-")
                self.step += 1
                if self.bad_steps >= cfg.max_bad_steps:
                    path = self.save()
                    raise TrainingDiverged(f"{self.bad_steps} bad steps in a row (non-finite loss, gradients or "
                                           f"weights) at step {self.step - 1}; stopped. The checkpoint holds the "
                                           f"last finite weights: {path}")
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save()
                    self.write_plots()
        bar.close()
        path = self.save()
        self.write_plots()
        return {"checkpoint": str(path), "history": self.history}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's piece of a (possibly distributed) tensor; itself for a plain tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def check_resume_config(cfg: TrainConfig, recorded: dict, data_ranks: int = 1,
                        recorded_ranks: int | None = None) -> None:
    """Refuse (one ValueError naming the flags) a resume whose settings differ from the checkpoint's recorded ones,
    except those in ``RESUME_MAY_CHANGE``. A per-rank ``batch_size`` may change with the number of data ranks when
    the global batch stays the same (a distributed run resumed on fewer or more GPUs)."""
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))
    differ = [k for k, v in recorded.items() if k in now and k not in RESUME_MAY_CHANGE and now[k] != v]
    if "batch_size" in differ and recorded_ranks and cfg.batch_size * data_ranks == \
            recorded["batch_size"] * recorded_ranks:
        differ.remove("batch_size")
    if differ:
        raise ValueError("--resume: " + ", ".join(f"--{k.replace('_', '-')}={now[k]!r} (recorded {recorded[k]!r})"
                                                  for k in differ) +
                         " differ from the run's recorded settings; drop them to resume, or start a new --out")


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


def to_host(tensors: dict, device: torch.device) -> dict:
    """{key: tensor} on the host through one copy, hence one host sync: flattened to float64 (exact for fp32 values
    and for integers below 2^53), concatenated on ``device``, copied, and split back into their shapes and dtypes."""
    flat = torch.cat([t.detach().reshape(-1).to(device, torch.float64) for t in tensors.values()]).cpu()
    parts = flat.split([t.numel() for t in tensors.values()])
    return {k: part.view(t.shape).to(t.dtype) for (k, t), part in zip(tensors.items(), parts)}


def _text_budget(docs, budget: int):
    used = 0
    for d in docs:
        if used >= budget:
            break
        used += len(d.text)
        yield d.text
