"""The training loop behind ``k3 train``.

One step (k3.train.step): ``grad_accum`` micro-batches of packed rows (documents never cross ``cu_seqlens``
boundaries) -> cross-entropy summed over valid labels and divided by the step's valid-label count (so accumulation
equals one big batch) + the balancer's auxiliary loss -> skip the step if the loss is not finite -> clip -> K3Muon
(per-head Muon + AdamW) at lr * cosine(step) -> router-bias update from the whole step's statistics (QB by
default), applied from the next step -> optional QK-Clip of the MLA layers -> metrics.jsonl. With ``qat`` the
routed experts are fake-quantised (k3.quant.qat) and the optimiser updates the high-precision masters.

Divergence (k3.train.state): a step whose loss, auxiliary loss, gradient norm or router scores are not finite is
skipped; weights made non-finite by an update are replaced by the last verified-finite state and the steps since it
are lost. ``max_bad_steps`` bad steps in a row stop the run with a finite checkpoint; a non-finite one is never
saved.

The run directory holds ``train_config.json``, ``metrics.jsonl``, ``tokenizer.json``, the plots, ``.lock``
and ``checkpoints/`` (see :mod:`k3.checkpoint.run`). ``resume`` continues bitwise-identically: weights, router
biases, optimizer state, RNG states and the data position are restored, and the schedule is a function of
the step and ``schedule_steps``.

This module holds :class:`Trainer` (set-up, evaluation, plots, samples and the loop); the run's settings are in
k3.train.config, the step in k3.train.step, resume / save / roll-back in k3.train.state. Their public names are
importable from here too.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from k3.config import get_preset
from k3.fs import atomic_write_text, make_directory
from k3.checkpoint.format import write_pretrained
from k3.checkpoint.load import from_pretrained
from k3.data.sft import DEFAULT_NAME as DEFAULT_CHAT, chat_dataset, load_conversations, reply_prompts
from k3.data.corpus import load_corpus, tokenizer_texts
from k3.data.packing import PackedDataset
from k3.data.tokenizer import Tokenizer, train_bpe
from k3.infer.sampling import SamplingParams
from k3.model.balance import Balancer
from k3.model.decoder import K3ForCausalLM
from k3.train.step_loads import STEP_LOADS, STEP_WINDOW, StepLoads, read_step_loads, write_step_loads
from k3.ops.fp8 import fp8_available
from k3.quant.fp8 import enable_fp8_experts
from k3.quant.qat import RECIPES as QAT_RECIPES, enable_qat
from k3.train import plots
from k3.train.activation_checkpoint import apply_activation_checkpointing
from k3.checkpoint.run import RunLock, clean_stray, resume_checkpoint
from k3.train.config import RESUME_MAY_CHANGE, TASKS, TrainConfig, check_resume_config
from k3.train.finetune import adapt, init_checkpoint, init_model, init_tokenizer
from k3.train.muon import K3Muon
from k3.train.param_groups import describe_groups, param_groups_for
from k3.train.state import RunState, TrainingDiverged, read_metrics
from k3.train.step import TrainStep, to_host

log = logging.getLogger("k3.train")
# The evaluation rows come from validation documents in an order shuffled with this fixed seed: drawn from the
# whole split (every part of a mixture, not its first documents) and the same rows for every run and seed.
VALIDATION_SEED = 0
# How the end-of-run samples are drawn: a model trained for minutes repeats one phrase when decoded greedily, so
# they are sampled, with a repetition penalty (seeded with the run's seed: the same run prints the same samples).
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.3}
SAMPLE_PROMPT_TOKENS, SAMPLE_TOKENS = 24, 48

__all__ = [
    "RESUME_MAY_CHANGE",
    "TASKS",
    "TrainConfig",
    "Trainer",
    "TrainingDiverged",
    "check_resume_config",
    "read_metrics",
    "to_host",
    "write_expert_loads",
]


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


class Trainer(TrainStep, RunState):
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
        ckpt = self._open_run_dir(resume)
        ckpt, self.resume_from = self.model_checkpoint(ckpt), ckpt
        # --init-from: a new run from a checkpoint's weights (a resumed run reads its own checkpoint, and a --lora
        # run its frozen base from --init-from again)
        starts = cfg.init_from and (self.resume_from is None or cfg.lora)
        self.init_from = init_checkpoint(cfg.init_from) if starts else None
        self.write_model = write_pretrained  # what a checkpoint holds of the model: all of it, or its adapters
        torch.manual_seed(cfg.seed)
        if cfg.task == "vision":
            self._setup_vision(ckpt)
        else:
            self._setup_text(ckpt)
        self.model_cfg = self.model.config
        if cfg.init_from:  # the run records the model it trains (its checkpoint's), not the default preset
            self.cfg = cfg = dataclasses.replace(cfg, preset=self.model_cfg.name)
        if cfg.lora:
            self.write_model = adapt(self.model, cfg, self.init_from, self.resume_from)
        self._prepare_model()
        self._setup_optimizer()
        self.step = 0
        self.bad_steps = 0
        self.history: list[dict] = []
        self.recent_loads: dict[int, torch.Tensor] = {}
        # (step, micro-batch, MoE layers, counts [layers, E]) of the last STEP_WINDOW micro-batches
        self.step_loads: collections.deque = collections.deque(maxlen=STEP_WINDOW)
        self.figures = True  # write_plots draws the figures (False: only expert_loads.json, e.g. many small runs)
        self._weights_check: torch.Tensor | None = None  # non-finite weight count after the last update
        if self.resume_from is not None:
            self.resume_run()
            self._resume_step_loads()
        if self.is_main:
            atomic_write_text(self.run_dir / "train_config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        self.snapshot()
        n = sum(p.numel() for p in self.model.parameters())
        log.info(
            "model %s: %.2fM parameters on %s, autocast %s",
            self.model_cfg.name,
            n / 1e6,
            self.device.type,
            "bf16" if self.device.type == "cuda" else "off (fp32)",
        )

    def _open_run_dir(self, resume: bool):
        """Check the run directory against ``resume`` and create it; returns the checkpoint to resume from."""
        if self.is_main:
            clean_stray(self.run_dir)
        ckpt = resume_checkpoint(self.run_dir) if resume else None
        if resume and ckpt is None:
            raise FileNotFoundError(f"--resume: {self.run_dir} has no checkpoint to resume from")
        if not resume and self.metrics_path.exists():
            raise ValueError(f"{self.run_dir} already holds a run; pass --resume to continue it or another --out")
        make_directory(self.run_dir)
        return ckpt

    def _prepare_model(self) -> None:
        """Parallelise the built model, then wrap it for activation checkpointing, FP8 experts and QAT as
        configured."""
        cfg = self.cfg
        self.model = self.parallelize(self.model)
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        if cfg.fp8_experts:
            why = fp8_available(self.device)
            if why:
                raise ValueError(f"--fp8-experts: {why}")
            enable_fp8_experts(self.model)
            log.info(
                "FP8 experts: the routed experts' matmuls take e4m3 inputs with row-wise scales (%s)",
                "torchao's FP8 grouped GEMM" if self.device.type == "cuda" else "emulated",
            )
        if cfg.qat:
            weights, acts = QAT_RECIPES[cfg.qat]
            enable_qat(self.model, weights, acts, cfg.qat_scale_mode)
            log.info(
                "QAT %s: routed experts run on %s weights and %s inputs (%s scales); checkpoints hold the "
                "high-precision masters; export packed with k3 convert --quantize mxfp4 --scale-mode %s",
                cfg.qat,
                weights,
                acts or "high-precision",
                cfg.qat_scale_mode,
                cfg.qat_scale_mode,
            )

    def _setup_optimizer(self) -> None:
        """K3Muon over the model's parameter groups, and the router balancer with the bias buffers it updates."""
        cfg = self.cfg
        groups = param_groups_for(self.model, cfg.lr, cfg.weight_decay, per_head=cfg.per_head_muon)
        ns_dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.optimizer = K3Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, ns_dtype=ns_dtype)
        log.debug("optimizer groups:\n%s", describe_groups(self.optimizer.param_groups))
        moe = self.model_cfg.moe
        self.balancer = Balancer(
            cfg.balance, moe.num_experts, moe.num_experts_per_token, gamma=cfg.balance_gamma, alpha=cfg.balance_alpha
        )
        self.bias_buffers = {
            i: layer.block_sparse_moe.gate.e_score_correction_bias
            for i, layer in enumerate(self.model.model.layers)
            if hasattr(layer, "block_sparse_moe")
        }

    # -------------------------------------------------------- set-up hooks (k3.distributed.train overrides them)
    def model_checkpoint(self, ckpt):
        """The checkpoint directory the model and tokenizer are read from on resume (here: the latest one)."""
        return ckpt

    def parallelize(self, model):
        """Applied to the built model before the optimiser is made (single process: nothing)."""
        return model

    # ------------------------------------------------------------------ data, tokenizer and model of each task
    def _setup_text(self, ckpt) -> None:
        """Language modelling on documents, or (``--task sft``) on conversations with the loss on the assistant's
        tokens (k3.data.sft): both packed into rows the same way."""
        cfg = self.cfg
        sft = cfg.task == "sft"
        load, pack = (load_conversations, chat_dataset) if sft else (load_corpus, PackedDataset)
        train_docs = load(cfg.data, "train")
        val_docs = load(cfg.data, "validation")
        self.tokenizer = self._text_tokenizer(ckpt, train_docs)
        if self.is_main:
            self.tokenizer.save(self.run_dir)
        t0 = time.perf_counter()
        self.train_data = pack(train_docs, self.tokenizer, cfg.seq_len, seed=cfg.seed, max_tokens=cfg.max_tokens)
        self.val_data = pack(
            val_docs, self.tokenizer, cfg.seq_len, seed=VALIDATION_SEED, max_tokens=cfg.eval_rows * cfg.seq_len + 1
        )
        self.val_docs = val_docs
        seconds, train, val = time.perf_counter() - t0, self.train_data, self.val_data
        log.info(
            "data %s: %.2fM training tokens (%d %s%s), %d validation rows of %d tokens (%.1fs)",
            cfg.data or (DEFAULT_CHAT if sft else "stdlib"),
            train.tokens.numel() / 1e6,
            train.num_documents,
            "conversations" if sft else "documents",
            f", {train.num_labels / train.tokens.numel():.0%} of the tokens the assistant's" if sft else "",
            min(cfg.eval_rows, val.num_rows),
            cfg.seq_len,
            seconds,
        )
        log.debug("data: train %r, validation %r", train, val)
        if ckpt is not None and not cfg.lora:
            self.model = from_pretrained(ckpt, dtype=torch.float32, device=self.device, packed="dequantize")
        elif self.init_from is not None:
            self.model = init_model(self.init_from, self.tokenizer, self.device)
        else:
            model_cfg = get_preset(cfg.preset).replace(
                vocab_size=self.tokenizer.vocab_size,
                eos_token_id=self.tokenizer.eos_id,
                bos_token_id=self.tokenizer.bos_id,
                **cfg.overrides,
            )
            self.model = K3ForCausalLM(model_cfg).to(self.device)

    def _text_tokenizer(self, ckpt, train_docs) -> Tokenizer:
        """The checkpoint's tokenizer on resume or with ``--init-from``, else ``cfg.tokenizer``, else a byte-level
        BPE trained here."""
        cfg = self.cfg
        if ckpt is not None:
            return Tokenizer.load(ckpt)
        if self.init_from is not None:
            return init_tokenizer(cfg.init_from)
        if cfg.tokenizer:
            return _load_tokenizer(cfg.tokenizer)
        t0 = time.perf_counter()
        tokenizer = train_bpe(tokenizer_texts(train_docs, cfg.tokenizer_train_bytes), cfg.vocab_size)
        log.info(
            "trained a byte-level BPE tokenizer (vocab %d) in %.1fs", tokenizer.vocab_size, time.perf_counter() - t0
        )
        return tokenizer

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
            self.model = from_pretrained(ckpt, dtype=torch.float32, device=self.device, packed="dequantize")
        else:
            model_cfg = with_vision(get_preset(cfg.preset)).replace(
                vocab_size=self.tokenizer.vocab_size,
                eos_token_id=self.tokenizer.eos_id,
                bos_token_id=self.tokenizer.bos_id,
                **media_ids(self.tokenizer),
                **cfg.overrides,
            )
            self.model = K3ForConditionalGeneration(model_cfg).to(self.device)
        vision = self.model.config.vision
        self.train_data = VisionTaskData(self.tokenizer, vision, "train", cfg.seed)
        self.val_data = VisionTaskData(self.tokenizer, vision, "validation", cfg.seed, rows=cfg.eval_rows)
        self.val_docs = []
        log.info("data: the embedded vision task (k3.vision.task), %d held-out examples", cfg.eval_rows)

    def eval_batch(self, rows: list[int]):
        return self.val_data.rows_batch(rows)

    # ------------------------------------------------------------------ evaluation, plots, samples
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
        engine = Engine(
            self.model, self.tokenizer, max_batch=min(n, 64), max_num_batched_tokens=4096, cuda_graphs=False
        )
        prompts = [[pad] + self.tokenizer.encode(" " + e.question) for e in examples]
        ids = [
            engine.add(p, SamplingParams(max_tokens=4, temperature=0.0), images=[e.image])
            for p, e in zip(prompts, examples)
        ]
        done = {i: "" for i in ids}
        while engine.has_work():
            for o in engine.step():
                done[o.request_id] += o.text
        preds = [done[i].strip() for i in ids]
        self.model.train()
        return score(preds, examples), [(e.question, e.answer, p) for e, p in zip(examples, preds)]

    def _resume_step_loads(self) -> None:
        """The window of per micro-batch loads goes on from the run's file: its records before the resumed step
        (later ones belong to steps that run again). A file that cannot be read is left alone and the window
        starts empty."""
        try:
            old = read_step_loads(self.run_dir / STEP_LOADS)
        except ValueError as e:
            log.warning("%s; the per-step loads start afresh", e)
            return
        if old is None:
            return
        layers = tuple(int(x) for x in old.layers)
        for step, micro, counts in zip(old.steps, old.micro, old.counts):
            if step < self.step:
                self.step_loads.append((int(step), int(micro), layers, counts))

    def write_loads(self) -> None:
        """``expert_loads.json`` (the counts since the last write, summed) and ``expert_loads_steps.npz`` (the last
        STEP_WINDOW micro-batches' counts, k3.plan.loads.StepLoads), both atomically."""
        if self.recent_loads:
            write_expert_loads(self.recent_loads, self.run_dir / "expert_loads.json")
        if self.step_loads:
            records = list(self.step_loads)
            loads = StepLoads(
                counts=np.stack([r[3] for r in records]),
                steps=np.array([r[0] for r in records]),
                micro=np.array([r[1] for r in records]),
                layers=np.array(records[-1][2]),
                top_k=self.model_cfg.moe.num_experts_per_token,
            )
            write_step_loads(self.run_dir / STEP_LOADS, loads)

    def write_plots(self) -> None:
        self.write_loads()
        if not self.figures:
            self.recent_loads = {}
            return
        plots.loss_curves(self.history, self.run_dir / "loss.png")
        plots.maxvio_curves(self.history, self.run_dir / "maxvio.png")
        if self.recent_loads:
            plots.expert_load_heatmap(self.recent_loads, self.run_dir / "expert_load.png")
        if self.model_cfg.attn_res.mode != "none":
            b = self.val_data.rows_batch([0])
            self.model.eval()
            with torch.no_grad():
                _, _, out = self._forward_loss(b, record=True)
            self.model.train()
            plots.attn_res_weights(out.attn_res_weights, self.run_dir / "attn_res.png")
        self.recent_loads = {}

    def sample_params(self) -> SamplingParams:
        """The settings :meth:`sample` draws the text task's continuations with (SAMPLING, the run's seed)."""
        return SamplingParams(max_tokens=SAMPLE_TOKENS, seed=self.cfg.seed, **SAMPLING)

    def sample(self) -> list[tuple[str, str]]:
        """Continuations of the openings (SAMPLE_PROMPT_TOKENS tokens) of the first validation documents, drawn by
        the serving engine with :meth:`sample_params` (sft: replies to the first held-out conversations, prompted
        and stopped in the chat format; vision: the first held-out questions with the expected and the predicted
        answer)."""
        if self.cfg.task == "vision":
            _, triples = self.vision_accuracy(max(self.cfg.samples, 1))
            return [(f"[image] {q} (expected: {a})", p) for q, a, p in triples]
        from k3.infer.engine import Engine

        params = [self.sample_params()] * self.cfg.samples
        if self.cfg.task == "sft":  # replies to held-out conversations, ended as the chat format ends them
            chats = reply_prompts(self.val_docs, self.tokenizer, self.cfg.samples)
            shown, prompts = [asked for asked, _ in chats], [chat.token_ids for _, chat in chats]
            params = [
                dataclasses.replace(params[0], stop=chat.stop, stop_token_ids=chat.stop_token_ids) for _, chat in chats
            ]
        else:
            openings = [
                self.tokenizer.encode(doc.text[:2000])[:SAMPLE_PROMPT_TOKENS]
                for doc in self.val_docs[: self.cfg.samples]
            ]
            prompts = [p for p in openings if p]
            shown = [self.tokenizer.decode(p) for p in prompts]
        if not prompts:
            return []
        # the engine's start-up and kernel lines describe a server, not these few samples: warnings only
        quiet = {name: logging.getLogger(name) for name in ("k3.infer", "k3.ops")}
        levels = {name: logger.level for name, logger in quiet.items()}
        for logger in quiet.values():
            logger.setLevel(logging.WARNING)
        try:
            engine = Engine(
                self.model, self.tokenizer, max_batch=len(prompts), cuda_graphs=False, warm_up=False, overlap=False
            )
            outs = engine.generate(prompts, params[: len(prompts)])
        finally:
            for name, logger in quiet.items():
                logger.setLevel(levels[name])
            self.model.train()
        return [(text, out["text"]) for text, out in zip(shown, outs)]

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
        bar = tqdm(
            total=cfg.steps, initial=self.step, disable=not (self.progress and self.is_main), desc="train", unit="step"
        )
        with open(self.metrics_path, "a") if self.is_main else contextlib.nullcontext() as metrics_file:
            while self.step < cfg.steps:
                if stop_at is not None and self.step >= stop_at:
                    bar.close()
                    return {"checkpoint": None, "history": self.history}
                record = self._step_with_evaluations()
                self._log(record, metrics_file, bar)
                self.step += 1
                self._stop_if_diverged()
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save()
                    self.write_plots()
        bar.close()
        path = self.save()
        self.write_plots()
        return {"checkpoint": str(path), "history": self.history}

    def _step_with_evaluations(self) -> dict:
        """One step's record, with the validation numbers before the first step (``*_init``) and after every
        ``eval_every``-th and the last step."""
        start = {f"{k}_init": v for k, v in self.evaluate().items()} if self.step == 0 else {}
        record = self.train_step()
        record.update(start)
        if (self.step + 1) % self.cfg.eval_every == 0 or self.step + 1 == self.cfg.steps:
            record.update(self.evaluate())
        return record

    def _log(self, record: dict, metrics_file, bar) -> None:
        """Keep the record in the history, append it to metrics.jsonl (main process) and show it on the bar."""
        self.history.append(record)
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        bar.update(1)
        bar.set_postfix(
            loss=f"{record['loss']:.3f}" if not record.get("skipped") else str(record["loss"]),
            tok_s=f"{record['tokens_per_s']:.0f}",
            lr=f"{record['lr']:.2e}",
            maxvio=f"{record['maxvio']:.2f}" if record.get("maxvio") is not None else "-",
        )

    def _stop_if_diverged(self) -> None:
        """After ``max_bad_steps`` bad steps in a row: save the last finite state and raise TrainingDiverged."""
        if self.bad_steps >= self.cfg.max_bad_steps:
            path = self.save()
            raise TrainingDiverged(
                f"{self.bad_steps} bad steps in a row (non-finite loss, gradients or "
                f"weights) at step {self.step - 1}; stopped. The checkpoint holds the "
                f"last finite weights: {path}"
            )
