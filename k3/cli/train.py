"""``k3 train``: train a K3 model (default: the ``small`` preset on the Python standard library), then sample.

With no arguments this is the README's main job: about 10 minutes on a 2-core CPU, saved under runs/small.
``--resume`` continues the run in ``--out`` (the directory given, wherever it was first written) from its latest
checkpoint with its recorded settings; a flag that contradicts them is refused, except those in
k3.train.config.RESUME_MAY_CHANGE: ``--device``, ``--save-every``, ``--eval-every``, ``--samples``,
``--keep-checkpoints``, ``--tokenizer``, ``--schedule-steps`` and ``--steps`` (which may extend the run: the
learning-rate schedule keeps its recorded length, so the added steps run at its final, minimum rate).
``--init-from CKPT`` starts a new run from a checkpoint's weights, config and tokenizer (k3.train.finetune); the
flags that would change the architecture or the tokenizer (k3.train.config.ARCHITECTURE_FIELDS) are refused beside it.
``--task sft`` fine-tunes it on conversations (k3.data.sft), ``--lora RANK`` trains adapters only (k3.model.lora).

The training flags are made from the fields of :class:`~k3.train.config.TrainConfig` (name, type, default, help
and choices): ``--FIELD-NAME VALUE``, a boolean field as a switch away from its default (``--no-per-head-muon``,
``--activation-checkpointing``), and ``overrides`` as the repeatable ``--set FIELD=VALUE``. Every such flag
defaults to unset, so the dataclass (or, for ``--task vision`` and ``--task sft``, VISION_DEFAULTS and SFT_DEFAULTS)
supplies the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import typing
from pathlib import Path

from k3.train.config import RESUME_MAY_CHANGE, TrainConfig, refuse_architecture_flags

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
# fine-tuning a trained model on the embedded chat set: a few epochs at a lower rate than pretraining's
SFT_DEFAULTS = {"steps": 60, "lr": 1e-3, "eval_every": 10}
# AdamW on LoRA factors that start at zero wants a higher rate than Muon on whole weights (README: fine-tune)
LORA_LR = 5e-3


# shown in --help as the default instead of the field's own (``out`` follows the preset and the task)
DEFAULT_SHOWN = {
    "out": "runs/PRESET, runs/PRESET-vision with --task vision, runs/NAME-TASK(-lora) with --init-from DIR/NAME",
}


def _value_type(hint) -> type:
    """The value type of a field's annotation: ``int`` for ``int | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _help(f: dataclasses.Field) -> str:
    """The field's help text with its default (and its ``--task vision`` / ``sft`` ones), %-escaped for argparse."""
    text = f.metadata["help"]
    if f.name in DEFAULT_SHOWN:
        text += f" (default {DEFAULT_SHOWN[f.name]})"
    elif f.default is not None and f.default is not dataclasses.MISSING and not isinstance(f.default, bool):
        vision = f"; vision: {VISION_DEFAULTS[f.name]}" if f.name in VISION_DEFAULTS else ""
        sft = f"; sft: {SFT_DEFAULTS[f.name]}" if f.name in SFT_DEFAULTS else ""
        sft += f"; --lora: {LORA_LR}" if f.name == "lr" else ""
        text += f" (default {f.default}{vision}{sft})"
    return text.replace("%", "%%")


def add_config_flags(parser) -> None:
    """One flag per TrainConfig field, each defaulting to None (unset: see :func:`_given`)."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        kind, flag = _value_type(hints[f.name]), "--" + f.name.replace("_", "-")
        if f.name == "overrides":
            parser.add_argument(
                "--set",
                dest="overrides",
                type=_override,
                action="append",
                default=[],
                metavar=f.metadata["metavar"],
                help=_help(f),
            )
        elif kind is bool:  # a switch away from the default
            parser.add_argument(
                flag.replace("--", "--no-") if f.default else flag,
                dest=f.name,
                default=None,
                action="store_false" if f.default else "store_true",
                help=_help(f),
            )
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                type=kind,
                default=None,
                choices=f.metadata.get("choices"),
                metavar=f.metadata.get("metavar"),
                help=_help(f),
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flags(p.add_argument_group("training settings (k3.train.config.TrainConfig)"))
    run_flags = p.add_argument_group("run")
    run_flags.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    run_flags.add_argument(
        "--vision-eval", type=int, default=400, help="held-out questions scored at the end (vision; default 400)"
    )
    run_flags.add_argument("--dp", type=int, default=None, help="data-parallel ranks (under torchrun; default: all)")
    run_flags.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, carved out of --dp")
    run_flags.add_argument(
        "--cp", type=int, default=1, help="context-parallel ranks (each sequence split in --cp pieces)"
    )
    run_flags.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _given(args: argparse.Namespace) -> dict:
    """The TrainConfig fields given on the command line (every such flag defaults to None: unset)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields - {"overrides"} and v is not None}
    if args.overrides:
        given["overrides"] = dict(args.overrides)
    return given


def resume_config(args: argparse.Namespace, out: str) -> TrainConfig:
    """The recorded settings of the run in ``out``, resumed into ``out``; flags that contradict them are refused
    (one error naming them) unless the trainer can honour them (k3.train.config.RESUME_MAY_CHANGE)."""
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
        raise ValueError(
            "--resume keeps the run's recorded settings; "
            + ", ".join(f"--{k.replace('_', '-')} {given[k]!r} (recorded {plain[k]!r})" for k in conflicts)
            + " conflict with them: drop them, or start a new run with another --out"
        )
    honoured = {k: v for k, v in given.items() if k in RESUME_MAY_CHANGE and k != "out"}
    return dataclasses.replace(
        cfg, **{"steps": cfg.steps, "schedule_steps": cfg.schedule_steps or cfg.steps, **honoured, "out": out}
    )


def default_out(args: argparse.Namespace) -> str:
    """Where a run goes without ``--out``: runs/PRESET (runs/PRESET-vision for the vision task); a run initialised
    from DIR/NAME goes to runs/NAME-TASK, beside its source rather than into it."""
    task = args.task or TrainConfig.task
    if args.init_from:
        return f"runs/{Path(args.init_from).resolve().name}-{task}" + ("-lora" if args.lora else "")
    return f"runs/{args.preset or TrainConfig.preset}" + ("-vision" if task == "vision" else "")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    task = args.task or TrainConfig.task
    out = args.out or default_out(args)
    if args.resume:
        return resume_config(args, out)
    values = _given(args)
    if args.init_from:
        refuse_architecture_flags(values)
    if task == "vision":  # ~13 minutes on 2 CPU cores with the small preset
        values = {**VISION_DEFAULTS, **values}
    elif task == "sft":
        values = {**SFT_DEFAULTS, **values}
    if values.get("lora") is not None and "lr" not in _given(args):
        values["lr"] = LORA_LR
    values["out"] = out
    return TrainConfig(**values)


def run(args: argparse.Namespace) -> int:
    from k3.train.trainer import Trainer, TrainingDiverged

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
    if int(os.environ.get("RANK", "0")) == 0:
        from k3.ops.kernel_plan import plan_report

        print(plan_report(trainer.device, args.verbose), flush=True)
        log.info(
            "%d of %d steps to run; the run goes to %s (metrics.jsonl, *.png, checkpoints/)",
            cfg.steps - trainer.step,
            cfg.steps,
            trainer.run_dir,
        )
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
        print(
            f"validation loss {init[0]['val_loss_init']:.3f} at start -> {evals[-1]['val_loss']:.3f} after "
            f"{evals[-1]['step'] + 1} steps ({init[0]['val_bpb_init']:.3f} -> {evals[-1]['val_bpb']:.3f} bits/byte)"
        )
    print(f"checkpoint: {result['checkpoint']}  metrics: {trainer.metrics_path}  plots: {trainer.run_dir}/*.png")
    if cfg.task == "vision":
        from k3.vision.task import chance_accuracy

        acc, _ = trainer.vision_accuracy(args.vision_eval)
        (trainer.run_dir / "vision_eval.json").write_text(json.dumps({"examples": args.vision_eval, **acc}, indent=2))
        print(
            f"held-out accuracy on {args.vision_eval} questions: "
            + ", ".join(
                f"{k} {v:.2f}" + (f" (chance {chance_accuracy(k):.2f})" if k != "all" else "") for k, v in acc.items()
            )
        )
    samples = trainer.sample()
    if samples and cfg.task != "vision":
        print(sample_heading(trainer, history))
    for prompt, continuation in samples:
        print("-" * 72)
        print(prompt + "\u2502" + continuation)
    return 0


def sample_heading(trainer, history: list[dict]) -> str:
    """What the samples below it are: a small model's, after how many steps and minutes, drawn how."""
    p = trainer.sample_params()
    seconds = sum(h.get("step_time", 0.0) for h in history)
    took = f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
    return (
        f"samples (prompt\u2502continuation) of the {trainer.cfg.preset} model after {trainer.step} steps ({took} of "
        f"training), drawn at temperature {p.temperature:g}, top-p {p.top_p:g}, repetition penalty "
        f"{p.repetition_penalty:g}, seed {p.seed}"
    )
