"""``k3 train``: train a K3 model (default: the ``small`` preset on the Python standard library), then sample.

With no arguments this is the README's main job: about 10 minutes on a 2-core CPU, saved under runs/small.
``--resume`` continues the run in ``--out`` (the directory given, wherever it was first written) from its latest
checkpoint with its recorded settings; a flag that contradicts them is refused, except ``--device``,
``--save-every``, ``--eval-every``, ``--samples`` and ``--steps`` (which may extend the run: the learning-rate
schedule keeps its recorded length, so the added steps run at its final, minimum rate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

from k3.model.balance import BALANCE_METHODS
from k3.quant.mx import MODES as MX_MODES
from k3.quant.qat import RECIPES as QAT_RECIPES
from k3.train.trainer import RESUME_MAY_CHANGE, TASKS, TrainConfig, Trainer, TrainingDiverged

log = logging.getLogger("k3.train")


def _override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected FIELD=VALUE, e.g. moe.num_experts=16")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


VISION_DEFAULTS = {"steps": 220, "batch_size": 32, "eval_every": 55, "eval_rows": 64}


def add_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="train a model (default: small preset on the stdlib corpus), then sample")
    p.add_argument("--preset", default=None)
    p.add_argument("--task", choices=TASKS, default=None,
                   help="text: language modelling on --data; vision: the embedded image question-answering task")
    p.add_argument("--vision-eval", type=int, default=400, help="held-out questions scored at the end (vision)")
    p.add_argument("--set", dest="overrides", type=_override, action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field, e.g. --set moe.num_experts=16 (repeatable)")
    p.add_argument("--data", default=None, help="text file, directory, .jsonl (field text) or .parquet")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or its directory) or a tiktoken BPE file")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary when training one")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on the tokenised training stream")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (default {d.steps}; vision: {VISION_DEFAULTS['steps']})")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"rows per micro-batch (default {d.batch_size}; "
                        f"vision: {VISION_DEFAULTS['batch_size']} examples)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--clip", type=float, default=None, help="gradient-norm clip")
    p.add_argument("--no-per-head-muon", dest="per_head_muon", action="store_false", default=None,
                   help="whole-matrix Muon for the head-structured projections")
    p.add_argument("--balance", choices=BALANCE_METHODS, default=None, help="router balancing (K3: qb)")
    p.add_argument("--qk-clip", type=float, default=None, metavar="TAU", help="QK-Clip MLA logits at TAU (K2: 100)")
    p.add_argument("--qat", choices=sorted(QAT_RECIPES), default=None,
                   help="quantisation-aware training of the routed experts: mxfp4 = MXFP4 weights + MXFP8 "
                        "activations (K3), mxfp4-weights = weights only")
    p.add_argument("--qat-scale-mode", choices=MX_MODES, default=None, help="MX scale rule for --qat")
    p.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="recompute each mixer and FFN in the backward pass: less activation memory, ~1/3 more compute")
    p.add_argument("--eval-every", type=int, default=None, help=f"steps between evaluations (default {d.eval_every})")
    p.add_argument("--eval-rows", type=int, default=None,
                   help=f"validation rows (vision: questions) per evaluation (default {d.eval_rows})")
    p.add_argument("--save-every", type=int, default=None, help="also checkpoint every N steps (0: end)")
    p.add_argument("--samples", type=int, default=None, help="greedy continuations printed at the end")
    p.add_argument("--out", default=None, help="run directory (default runs/PRESET)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="auto, cpu or cuda[:N]")
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (under torchrun; default: all)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, carved out of --dp")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (each sequence split in --cp pieces)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)


def _given(args: argparse.Namespace) -> dict:
    """The TrainConfig fields given on the command line (every such flag defaults to None: unset)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields - {"overrides"} and v is not None}
    if args.overrides:
        given["overrides"] = dict(args.overrides)
    return given


def resume_config(args: argparse.Namespace, out: str) -> TrainConfig:
    """The recorded settings of the run in ``out``, resumed into ``out``; flags that contradict them are refused
    (one error naming them) unless the trainer can honour them (k3.train.trainer.RESUME_MAY_CHANGE)."""
    saved = Path(out) / "train_config.json"
    if not saved.is_file():
        raise FileNotFoundError(f"--resume: {saved} not found: {out} is not a training run")
    try:
        recorded = json.loads(saved.read_text())
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        cfg = TrainConfig(**{k: v for k, v in recorded.items() if k in known})
    except (json.JSONDecodeError, TypeError, AttributeError) as e:
        raise ValueError(f"--resume: {saved} is malformed: {e}") from None
    given = _given(args)
    plain = json.loads(json.dumps(dataclasses.asdict(cfg)))
    conflicts = [k for k, v in given.items() if k not in RESUME_MAY_CHANGE and json.loads(json.dumps(v)) != plain[k]]
    if conflicts:
        raise ValueError("--resume keeps the run's recorded settings; " + ", ".join(
            f"--{k.replace('_', '-')} {given[k]!r} (recorded {plain[k]!r})" for k in conflicts)
            + " conflict with them: drop them, or start a new run with another --out")
    steps = given.get("steps", cfg.steps)
    honoured = {k: v for k, v in given.items() if k in RESUME_MAY_CHANGE and k not in ("steps", "out")}
    return dataclasses.replace(cfg, **honoured, out=out, steps=steps,
                               schedule_steps=cfg.schedule_steps or cfg.steps)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    task = args.task or TrainConfig.task
    out = args.out or (f"runs/{args.preset or TrainConfig.preset}" + ("-vision" if task == "vision" else ""))
    if args.resume:
        return resume_config(args, out)
    values = _given(args)
    if task == "vision":  # ~13 minutes on 2 CPU cores with the small preset
        values = {**VISION_DEFAULTS, **values}
    values["out"] = out
    return TrainConfig(**values)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.task == "vision" and args.vision_eval < 1:  # checked before training, not after it
        raise ValueError(f"--vision-eval={args.vision_eval} must be a positive number of questions")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or (args.dp or 1) > 1 or args.ep > 1 or args.cp > 1:
        from k3.distributed.mesh import ParallelDims
        from k3.distributed.train import DistributedTrainer

        dims = ParallelDims(dp=args.dp or world // args.cp, ep=args.ep, cp=args.cp)
        dims.validate(world)
        trainer = DistributedTrainer(cfg, dims, resume=args.resume, progress=args.progress)
    else:
        trainer = Trainer(cfg, resume=args.resume, progress=args.progress)
    try:
        result = trainer.run()
    except TrainingDiverged as e:
        print(f"k3 train: stopped: {e}")
        return 3
    if not trainer.is_main:
        return 0
    history = result["history"]
    init = [h for h in history if "val_loss_init" in h]
    evals = [h for h in history if "val_loss" in h]
    if init and evals:
        print(f"validation loss {init[0]['val_loss_init']:.3f} at start -> {evals[-1]['val_loss']:.3f} after "
              f"{evals[-1]['step'] + 1} steps ({init[0]['val_bpb_init']:.3f} -> {evals[-1]['val_bpb']:.3f} bits/byte)")
    print(f"checkpoint: {result['checkpoint']}  metrics: {trainer.metrics_path}  plots: {trainer.run_dir}/*.png")
    if cfg.task == "vision":
        from k3.vision.task import chance_accuracy

        acc, _ = trainer.vision_accuracy(args.vision_eval)
        (trainer.run_dir / "vision_eval.json").write_text(json.dumps({"examples": args.vision_eval, **acc}, indent=2))
        print(f"held-out accuracy on {args.vision_eval} questions: " + ", ".join(
            f"{k} {v:.2f}" + (f" (chance {chance_accuracy(k):.2f})" if k != "all" else "") for k, v in acc.items()))
    for prompt, continuation in trainer.sample():
        print("-" * 72)
        print(prompt + "\u2502" + continuation)
    return 0
