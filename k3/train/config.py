"""What a training run is: :class:`TrainConfig`, its checks, and which of its fields a resume may change.

Each field's ``metadata`` holds its help text (and where it has them, its choices and metavar): ``k3 train`` builds
its flags from these fields (k3.cli.train), so a field's flag, type, default and help live here once.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

TASKS = ("text", "vision", "sft")
# copies of the values some fields offer, which their modules define beside torch code: this module (and with it
# ``k3 train --help``, whose flags it defines) imports no torch. tests/cli/test_help.py keeps each equal to its source.
BALANCE_METHODS = ("qb", "qb_exact", "sign", "aux", "seqaux", "none")  # k3.model.balance.BALANCE_METHODS
DEFAULT_GAMMA = 1e-3  # k3.model.balance.DEFAULT_GAMMA
MX_MODES = ("floor", "rceil")  # k3.ops.mx.MODES
QAT_RECIPES = ("mxfp4", "mxfp4-weights")  # the names of k3.quant.qat.RECIPES

# fields a resume may change: where and how often it reports and saves, the device, the step count (the schedule
# keeps its recorded length, ``schedule_steps``), and the tokenizer (a resumed run reads its checkpoint's)
RESUME_MAY_CHANGE = (
    "out",
    "device",
    "steps",
    "schedule_steps",
    "save_every",
    "eval_every",
    "samples",
    "keep_checkpoints",
    "tokenizer",
)

# fields that choose the architecture or the tokenizer: --init-from takes both from its checkpoint, so these are
# refused beside it (one line naming them) rather than silently ignored
ARCHITECTURE_FIELDS = ("preset", "overrides", "vocab_size", "tokenizer", "tokenizer_train_bytes")

# integer fields that must be positive (``schedule_steps`` may also be None)
_POSITIVE = (
    "steps",
    "batch_size",
    "grad_accum",
    "seq_len",
    "vocab_size",
    "eval_every",
    "eval_rows",
    "max_bad_steps",
    "schedule_steps",
)


def _f(default, text: str, **meta):
    """A dataclass field with its help text (and optional ``choices`` / ``metavar``) in its metadata."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": text, **meta})
    return field(default=default, metadata={"help": text, **meta})


@dataclass
class TrainConfig:
    preset: str = _f("small", "model preset (k3.config.presets)")
    task: str = _f(
        "text",
        "text: language modelling on --data; vision: the embedded image question-answering task; sft: supervised "
        "fine-tuning of --init-from on chat JSONL (--data, default an embedded set), loss on the assistant's tokens",
        choices=TASKS,
    )
    overrides: dict = _f(
        {}, "override a config field, e.g. --set moe.num_experts=16 (repeatable)", metavar="FIELD=VALUE"
    )
    init_from: str | None = _f(
        None,
        "start from a checkpoint's weights, config and tokenizer (optimizer fresh): a k3 run directory (its latest "
        "checkpoint), a checkpoint directory or an HF-layout K3 / Kimi-Linear release (default: random weights)",
        metavar="CKPT",
    )
    lora: int | None = _f(
        None,
        "train rank-RANK LoRA adapters on the attention projections of --init-from's model, every other weight "
        "frozen (the router's bias still balanced); checkpoints hold the adapters only (k3 convert --merge-lora)",
        metavar="RANK",
    )
    lora_alpha: float | None = _f(None, "LoRA scale: the adapted weight is W + (alpha / rank) B A (default: the rank)")
    lora_shared_experts: bool = _f(False, "--lora also adapts the shared experts and the dense FFN layers")
    data: str | None = _f(
        None,
        "text file, directory, .jsonl (field text) or .parquet, or a built-in corpus: stdlib, pydoc-topics (Python's "
        "help topics' prose), packages:NAME[==VERSION],... (installed distributions' text files), joined by +; "
        'default: the Python standard library\'s own sources; --task sft: a .jsonl of {"messages": [...]} '
        "conversations (default: the embedded chat set)",
    )
    tokenizer: str | None = _f(
        None, "tokenizer.json (or its directory) or a tiktoken BPE file (default: train a byte-level BPE)"
    )
    vocab_size: int = _f(8192, "BPE vocabulary when training one")
    tokenizer_train_bytes: int = _f(
        4_000_000, "BPE training text budget in characters (whole training documents in a fixed shuffled order)"
    )
    max_tokens: int | None = _f(3_000_000, "cap on the tokenised training stream")
    steps: int = _f(120, "optimizer steps")
    schedule_steps: int | None = _f(
        None,
        "length of the cosine learning-rate schedule (default: --steps; a resume "
        "keeps the recorded length unless this is given)",
    )
    batch_size: int = _f(8, "rows (vision: examples) per micro-batch")
    grad_accum: int = _f(1, "micro-batches per step")
    seq_len: int = _f(256, "tokens per packed row")
    lr: float = _f(3e-3, "peak learning rate")
    weight_decay: float = _f(0.1, "decoupled weight decay")
    warmup_frac: float = _f(0.01, "share of the schedule spent warming up the learning rate")
    min_lr_ratio: float = _f(0.1, "the schedule's final learning rate, as a fraction of --lr")
    clip: float = _f(1.0, "gradient-norm clip")
    per_head_muon: bool = _f(
        True, "Muon per head for the head-structured projections (--no-per-head-muon: whole-matrix Muon)"
    )
    balance: str = _f("qb", "router balancing (K3: qb)", choices=BALANCE_METHODS)
    balance_gamma: float = _f(DEFAULT_GAMMA, "router-bias step of sign and seqaux balancing")
    balance_alpha: float | None = _f(None, "auxiliary-loss weight of aux / seqaux balancing (default 1e-2 / 1e-4)")
    qk_clip: float | None = _f(None, "QK-Clip MLA logits at TAU (K2: 100; default: off)", metavar="TAU")
    qat: str | None = _f(
        None,
        "quantisation-aware training of the routed experts: mxfp4 = MXFP4 weights + MXFP8 "
        "activations (K3), mxfp4-weights = weights only (default: off)",
        choices=tuple(sorted(QAT_RECIPES)),
    )
    qat_scale_mode: str = _f("floor", "MX scale rule for --qat: floor (OCP) or rceil", choices=MX_MODES)
    fp8_experts: bool = _f(
        False,
        "routed experts' matmuls in FP8 (e4m3, row-wise scales; torchao on GPUs of compute capability >= 8.9, "
        "emulated elsewhere); not with --qat",
    )
    activation_checkpointing: bool = _f(
        False, "recompute each mixer and FFN in the backward pass: less activation memory, ~1/3 more compute"
    )
    eval_every: int = _f(20, "steps between evaluations")
    eval_rows: int = _f(
        32,
        "validation rows (vision: questions) per evaluation (all if fewer), from the validation documents in a fixed "
        "shuffled order: the same rows for every seed",
    )
    save_every: int = _f(0, "also checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(3, "newest checkpoints kept in the run directory (0: all)")
    samples: int = _f(3, "continuations of held-out openings sampled at the end (their settings printed with them)")
    max_bad_steps: int = _f(3, "bad steps (non-finite loss, gradients or weights) in a row that stop the run")
    out: str = _f("runs/small", "run directory")
    seed: int = _f(0, "seed of the initial weights and the data order")
    device: str = _f("auto", "auto, cpu or cuda[:N]")

    def validate(self) -> None:
        for name in _POSITIVE:
            v = getattr(self, name)
            if name == "schedule_steps" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}={v!r} must be a positive integer")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"--lr={self.lr!r} must be a positive number")
        for name in ("balance_gamma", "balance_alpha"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
                raise ValueError(f"--{name.replace('_', '-')}={v!r} must be a positive number")
        for f in dataclasses.fields(self):
            choices, v = f.metadata.get("choices"), getattr(self, f.name)
            if choices is not None and v not in choices and not (v is None and f.default is None):
                raise ValueError(f"--{f.name.replace('_', '-')}={v!r} must be one of {', '.join(choices)}")
        if self.fp8_experts and self.qat:
            raise ValueError(f"--fp8-experts and --qat={self.qat} do not combine: choose one")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device={self.device!r} must be auto, cpu or cuda[:N]")
        self._validate_lora()
        if self.task == "sft" and not self.init_from:
            raise ValueError("--task sft fine-tunes a trained model: give it with --init-from CKPT")
        if self.init_from is not None:
            if self.task == "vision":
                raise ValueError(
                    "--init-from starts a text model (--task text or sft); --task vision builds its own model"
                )
            if self.overrides or self.tokenizer:
                refuse_architecture_flags([k for k in ("overrides", "tokenizer") if getattr(self, k)])

    def _validate_lora(self) -> None:
        if self.lora is None:
            if self.lora_alpha is not None or self.lora_shared_experts:
                raise ValueError("--lora-alpha and --lora-shared-experts set up --lora RANK: give it too, or drop them")
            return
        if isinstance(self.lora, bool) or not isinstance(self.lora, int) or self.lora < 1:
            raise ValueError(f"--lora={self.lora!r} must be a positive integer (the adapters' rank)")
        a = self.lora_alpha
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < math.inf):
            raise ValueError(f"--lora-alpha={a!r} must be a positive number")
        if not self.init_from:
            raise ValueError("--lora adapts a trained model: give it with --init-from CKPT")
        if self.qk_clip:
            raise ValueError("--qk-clip rescales MLA's query and key weights, which --lora keeps frozen: drop it")


def refuse_architecture_flags(given) -> None:
    """One ValueError naming the ARCHITECTURE_FIELDS among ``given`` (field names), if any: beside --init-from the
    architecture and the tokenizer are the checkpoint's."""
    named = [k for k in ARCHITECTURE_FIELDS if k in given]
    if named:
        flags = ", ".join("--set" if k == "overrides" else "--" + k.replace("_", "-") for k in named)
        raise ValueError(
            f"--init-from takes the architecture and the tokenizer from its checkpoint: drop {flags}, or train "
            "from random weights without --init-from"
        )


def check_resume_config(
    cfg: TrainConfig, recorded: dict, data_ranks: int = 1, recorded_ranks: int | None = None
) -> None:
    """Refuse (one ValueError naming the flags) a resume whose settings differ from the checkpoint's recorded ones,
    except those in ``RESUME_MAY_CHANGE``. A per-rank ``batch_size`` may change with the number of data ranks when
    the global batch stays the same (a distributed run resumed on fewer or more GPUs)."""
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))
    differ = [k for k, v in recorded.items() if k in now and k not in RESUME_MAY_CHANGE and now[k] != v]
    if (
        "batch_size" in differ
        and recorded_ranks
        and cfg.batch_size * data_ranks == recorded["batch_size"] * recorded_ranks
    ):
        differ.remove("batch_size")
    if differ:
        raise ValueError(
            "--resume: "
            + ", ".join(f"--{k.replace('_', '-')}={now[k]!r} (recorded {recorded[k]!r})" for k in differ)
            + " differ from the run's recorded settings; drop them to resume, or start a new --out"
        )
