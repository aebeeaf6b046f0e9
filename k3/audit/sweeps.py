"""Scaling sweeps (``k3 scaling --sweep NAME``): K3-style models against a K2-like baseline at >= 4 sizes, trained
with :func:`k3.audit.runs.run_one` (resumable, one shared tokenizer) into
``OUT/runs/<label>-w<width>-l<layers>-s<seed>/``; :mod:`k3.audit.scaling` fits them.

A sweep with ``lrs`` trains every run at each of those learning rates (``...-l<layers>-lr<lr>-s<seed>/``), one
with ``ratios`` at each of those tokens per activated parameter (``...-l<layers>-tpp<ratio>-s<seed>/``), at >= 2
sizes: :mod:`k3.audit.scaling_design` then reports each arm's best rate per size and the multiplier at each
choice (one shared rate, each arm at its own best rate, each ratio)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from k3.data.corpus import PACKAGES_MIXTURE, pin_corpus
from k3.data.packing import stream_tokens

log = logging.getLogger("k3.scaling")


def size_overrides(width: int, layers: int, head_dim: int) -> dict:
    """A K3-shaped model of ``width`` and ``layers``: the ``small`` preset's ratios (heads of ``head_dim``,
    dense FFN 3d, expert width d, latent d/2, LoRA ranks d/2, rope slice head_dim/2, K3's mixer schedule)."""
    from k3.audit.mqar import k3_mla_layers

    if width % head_dim or width % 2:
        raise ValueError(f"width={width} must be even and a multiple of head_dim={head_dim}")
    heads = width // head_dim
    return {
        "hidden_size": width,
        "num_hidden_layers": layers,
        "mla_layers": k3_mla_layers(layers),
        "intermediate_size": 3 * width,
        "kda.num_heads": heads,
        "kda.head_dim": head_dim,
        "kda.v_head_dim": head_dim,
        "kda.forget_gate_rank": head_dim,
        "kda.output_gate_rank": head_dim,
        "mla.num_heads": heads,
        "mla.q_lora_rank": width // 2,
        "mla.kv_lora_rank": width // 2,
        "mla.qk_nope_head_dim": head_dim,
        "mla.qk_rope_head_dim": head_dim // 2,
        "mla.v_head_dim": head_dim,
        "moe.moe_intermediate_size": width,
        "moe.latent_size": width // 2,
    }


@dataclass
class Sweep:
    name: str
    description: str
    preset: str
    sizes: tuple[tuple[int, int], ...]  # (width, layers)
    head_dim: int
    archs: dict  # label -> ablation variant of the sized K3 model
    seeds: tuple[int, ...]
    train: dict  # TrainConfig fields shared by every run
    tokens_per_param: float | None = None  # None: train['steps'] for every size; else steps =
    #                                        ceil(tokens_per_param * N_activated(k3 at that size) / tokens per step)
    min_steps: int = 1
    run_plots: bool = False
    extra_seeds: tuple[int, ...] = ()  # more seeds for the first extra_seed_sizes sizes (the noisy small end)
    extra_seed_sizes: int = 0
    data: str | None = None  # training and validation data when the command gives none (None: stdlib)
    lrs: tuple[float, ...] = ()  # every run at each of these learning rates (empty: train['lr'] alone)
    ratios: tuple[float, ...] = ()  # every run at each of these tokens per parameter (empty: tokens_per_param)


def check_sweep(sweep: Sweep) -> None:
    """ValueError for a sweep that cannot run as asked: ``lrs`` or ``ratios`` that are not >= 2 distinct positive
    numbers (one value is the sweep's ``train['lr']`` or ``tokens_per_param``)."""
    for field in ("lrs", "ratios"):
        xs = getattr(sweep, field)
        bad = [x for x in xs if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < math.inf]
        if bad or len(set(xs)) != len(xs) or len(xs) == 1:
            raise ValueError(f"sweep {sweep.name}: {field}={list(xs)!r} must be >= 2 distinct positive numbers")


BASELINE = "no_kda_rope+no_attnres+no_latent+bias_sign+swiglu"  # K2-like: RoPE MLA, plain residual, SwiGLU,
#                                                                  plain MoE, sign-bias balancing
PROPORTIONAL = dict(  # gpu5's design, also cpu5's: tokens grow with the model, 3 seeds where noise is largest
    archs={"k3": "full", "baseline": BASELINE},
    seeds=(0,),
    extra_seeds=(1, 2),
    extra_seed_sizes=2,
    tokens_per_param=5.0,
    min_steps=100,
    data=PACKAGES_MIXTURE,  # gpu5 needs up to 40.2M fresh tokens a run; cpu5 reads the same mixture
)
CPU5 = Sweep(
    name="cpu5",
    description="gpu5's design at CPU scale: 5 sizes x K3-style vs the K2-like baseline, tokens = 5 x activated "
    "parameters in steps of 16 x 128, 3 seeds at the two smallest sizes, on gpu5's code + prose (~25 minutes "
    "on 2 cores with --jobs 2)",
    preset="tiny",
    sizes=((32, 4), (48, 4), (64, 4), (80, 4), (96, 4)),
    head_dim=16,
    **PROPORTIONAL,
    train=dict(
        steps=1,
        batch_size=16,
        seq_len=128,
        vocab_size=1024,
        tokenizer_train_bytes=1_000_000,
        max_tokens=3_500_000,
        eval_every=250,
        eval_rows=512,  # 65K tokens: validation documents from every part of the mixture
        keep_checkpoints=1,
        lr=1e-2,
    ),
)
CPU5_512 = dataclasses.replace(
    CPU5,
    name="cpu5_512",
    description="cpu5 in rows of 512 tokens, 4 x 512 a step (the same tokens a step, a quarter of the rows): "
    "cpu5 and gpu5 differ in row length (128 vs 512) among other things",
    train={**CPU5.train, "batch_size": 4, "seq_len": 512, "eval_rows": 128},  # 128 rows: cpu5's 65K tokens
)

SWEEPS: dict[str, Sweep] = {
    "micro": Sweep(
        name="micro",
        description="tests only: 4 tiny sizes x 2 architectures, a few steps",
        preset="tiny",
        sizes=((16, 2), (24, 2), (32, 2), (48, 2)),
        head_dim=8,
        archs={"k3": "full", "baseline": BASELINE},
        seeds=(0,),
        train=dict(
            steps=2,
            batch_size=2,
            seq_len=32,
            vocab_size=300,
            tokenizer_train_bytes=100_000,
            max_tokens=20_000,
            eval_every=2,
            eval_rows=4,
        ),
    ),
    "cpu": Sweep(
        name="cpu",
        description="4 small sizes x 2 architectures on a CPU (~1.5 minutes)",
        preset="tiny",
        sizes=((32, 4), (48, 4), (64, 4), (96, 4)),
        head_dim=16,
        archs={"k3": "full", "baseline": BASELINE},
        seeds=(0,),
        train=dict(
            steps=60,
            batch_size=8,
            seq_len=128,
            vocab_size=1024,
            tokenizer_train_bytes=1_000_000,
            max_tokens=300_000,
            eval_every=30,
            eval_rows=32,
        ),
    ),
    "cpu5": CPU5,
    "cpu5_512": CPU5_512,
    "cpu5_16x512": dataclasses.replace(
        CPU5,
        name="cpu5_16x512",
        description="cpu5 in 16 rows of 512 tokens a step: cpu5's rows per step at cpu5_512's row length (4x the "
        "tokens a step, a quarter of the steps; at least 50 steps)",
        min_steps=50,
        train={**CPU5.train, "seq_len": 512, "eval_rows": 128},
    ),
    "cpu5_512_lr": dataclasses.replace(
        CPU5_512,
        name="cpu5_512_lr",
        description="cpu5_512's design at its smallest and middle sizes, every run at 3e-3, 1e-2, 3e-2 and 1e-1 "
        "with one seed: each arm's best learning rate per size, and the multiplier at it against the one at the "
        "shared 1e-2",
        sizes=((32, 4), (64, 4)),
        extra_seeds=(),
        extra_seed_sizes=0,
        lrs=(3e-3, 1e-2, 3e-2, 1e-1),
    ),
    "cpu5_512_tpp": dataclasses.replace(
        CPU5_512,
        name="cpu5_512_tpp",
        description="cpu5_512 at 5 and at 20 tokens per activated parameter (4x the steps; the same 3.5M-token "
        "pool, so a run's first steps are its twin's at 5) at the two smallest sizes, one seed, lr 1e-2",
        sizes=((32, 4), (48, 4)),
        ratios=(5.0, 20.0),
        extra_seeds=(),
        extra_seed_sizes=0,
    ),
    "gpu": Sweep(
        name="gpu",
        description="4 sizes x 2 architectures, 300 steps of 16 x 512 tokens each (H200)",
        preset="small",
        sizes=((128, 4), (192, 4), (256, 6), (384, 8)),
        head_dim=64,
        archs={"k3": "full", "baseline": BASELINE},
        seeds=(0,),
        train=dict(
            steps=300,
            batch_size=16,
            seq_len=512,
            vocab_size=8192,
            tokenizer_train_bytes=4_000_000,
            max_tokens=None,
            eval_every=100,
            eval_rows=128,
            save_every=150,
            keep_checkpoints=1,
            lr=3e-3,
        ),
    ),
    "gpu5": Sweep(
        name="gpu5",
        description="5 sizes x K3-style vs a K2-like baseline (RoPE MLA, SwiGLU, plain MoE, sign bias), tokens = 5 x "
        "activated parameters in steps of 64 x 512, 3 seeds at the two smallest sizes, on code + prose (GPU)",
        preset="small",
        sizes=((64, 4), (96, 4), (128, 4), (192, 4), (256, 6)),
        head_dim=32,
        **PROPORTIONAL,
        train=dict(
            steps=1,
            batch_size=64,  # small models leave the GPU idle between launches: 4x the batch costs little time
            seq_len=512,
            vocab_size=8192,
            tokenizer_train_bytes=4_000_000,
            max_tokens=None,
            eval_every=250,
            eval_rows=256,
            save_every=500,
            keep_checkpoints=1,
            lr=1e-2,  # the best of 1e-3 / 3e-3 / 1e-2 for K3 and the baseline-like variants in the factorial grid
        ),
    ),
}


def get_sweep(name: str) -> Sweep:
    try:
        return copy.deepcopy(SWEEPS[name])  # its dicts too: the sweeps share some
    except KeyError:
        raise ValueError(f"unknown sweep {name!r}; choose one of: {', '.join(SWEEPS)}") from None


def check_epochs(sweep: Sweep, plan: list, data: str | None, tok) -> None:
    """Refuse a sweep whose runs would see their training data more than once: a scaling fit needs fresh tokens
    (a run that repeats its data memorises it, and its validation loss then rises with compute). ValueError naming
    the runs, the tokens they need and the tokens the data holds."""
    from k3.data.corpus import load_corpus
    from k3.data.packing import PackedDataset

    rows_per_step = sweep.train["batch_size"] * sweep.train.get("grad_accum", 1)
    ctx = sweep.train.get("seq_len", 512)
    rows = len(PackedDataset(load_corpus(data, "train"), tok, ctx, max_tokens=sweep.train.get("max_tokens")))
    over = sorted(
        {(width, layers, steps) for _, _, _, width, layers, steps, *_ in plan if steps * rows_per_step > rows}
    )
    if over:
        sizes = ", ".join(f"w{w} l{n}: {s * rows_per_step * ctx / 1e6:.1f}M" for w, n, s in over)
        raise ValueError(
            f"sweep {sweep.name}: runs would repeat their training data ({data or 'stdlib'}: "
            f"{rows * ctx / 1e6:.2f}M tokens in rows of {ctx}); tokens needed by size: {sizes}. "
            "Pass --data with more text, or use a sweep with fewer tokens per parameter"
        )


def run_sweep(
    sweep: Sweep,
    out: str | Path,
    data: str | None = None,
    device: str = "auto",
    progress: bool = False,
    jobs: int = 1,
    warm_first: bool = True,
) -> list[dict]:
    """Train every (architecture, size, seed) of ``sweep`` into ``OUT/runs`` (resumable); returns summaries.

    ``jobs > 1`` trains that many runs side by side (:func:`k3.audit.runs.run_jobs`)."""
    from k3.audit.runs import check_jobs, ensure_tokenizer, run_job, run_jobs

    check_jobs(jobs)
    check_sweep(sweep)
    data = pin_corpus(sweep.data if data is None else data)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({**dataclasses.asdict(sweep), "data": data}, indent=2))
    tok_path = ensure_tokenizer(
        out, data, sweep.train.get("vocab_size", 8192), sweep.train.get("tokenizer_train_bytes", 4_000_000)
    )
    work = plan_sweep(sweep, out, data, tok_path, device)
    if jobs > 1:  # longest first, so the pool does not end waiting on the largest size alone ...
        work.sort(key=lambda w: -w[0].steps)
        if warm_first:  # ... after the run that goes alone to fill the kernel caches: the shortest
            work.insert(0, work.pop())

    def done(i: int, s: dict) -> None:
        log.info(
            "[%d/%d] %s: %sval loss %s",
            i + 1,
            len(work),
            Path(work[i][0].out).name,
            "skipped, " if s.get("skipped") else "",
            s.get("val_loss"),
        )

    return run_jobs(
        functools.partial(run_job, progress=progress and jobs == 1),
        work,
        jobs,
        done,
        warm_first,
        [f"run {Path(cfg.out).name}" for cfg, _, _ in work],
    )


def plan_sweep(sweep: Sweep, out: Path, data: str | None, tok_path: Path, device: str = "auto") -> list[tuple]:
    """The ``(TrainConfig, meta, plots)`` job of every run of ``sweep`` (size x ratio x arm x rate x seed), in
    that order, after checking them all (:func:`check_sweep`, :func:`check_epochs`): nothing is trained."""
    from k3.audit.ablate import make_variant, params_of, variant_config, variant_train_config
    from k3.config import get_preset
    from k3.data.tokenizer import Tokenizer

    check_sweep(sweep)
    tok = Tokenizer.load(tok_path)
    plan = []
    ctx = sweep.train.get("seq_len", 512)
    for width, layers in sweep.sizes:  # validate everything before training anything
        sized_ov = size_overrides(width, layers, sweep.head_dim)
        base = get_preset(sweep.preset).replace(**sized_ov)
        full_vocab = base.replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
        n_k3 = params_of(full_vocab, ctx)["params_activated"]
        per_step = sweep.train["batch_size"] * sweep.train.get("grad_accum", 1) * ctx
        for ratio in sweep.ratios or (sweep.tokens_per_param,):
            steps = max(sweep.min_steps, math.ceil(ratio * n_k3 / per_step)) if ratio else sweep.train.get("steps")
            for label, vname in sweep.archs.items():
                v = make_variant(vname, base)
                params = params_of(variant_config(full_vocab, v), ctx)
                small_end = (width, layers) in sweep.sizes[: sweep.extra_seed_sizes]
                seeds = sweep.seeds + (sweep.extra_seeds if small_end else ())
                for lr in sweep.lrs or (None,):
                    tag = (f"-tpp{ratio:g}" if sweep.ratios else "") + (f"-lr{lr:g}" if sweep.lrs else "")
                    plan += [(label, v, sized_ov, width, layers, steps, seed, params, lr, ratio, tag) for seed in seeds]
    check_epochs(sweep, plan, data, tok)
    work = []
    for label, v, sized_ov, width, layers, steps, seed, params, lr, ratio, tag in plan:
        run_dir = out / "runs" / f"{label}-w{width}-l{layers}{tag}-s{seed}"
        train = {**sweep.train, "steps": steps, **({} if lr is None else {"lr": lr})}
        if ratio and train.get("max_tokens") is None:  # tokenise only what the run reads
            train["max_tokens"] = stream_tokens(steps, train["batch_size"] * train.get("grad_accum", 1), ctx)
        train["eval_every"] = min(train.get("eval_every", 20), steps)
        cfg = variant_train_config(sweep.preset, sized_ov, train, v, label, seed, run_dir, tok_path, data, device)
        meta = {
            "label": label,
            "variant": v.name,
            "width": width,
            "layers": layers,
            "seed": seed,
            "lr": cfg.lr,
            "tokens_per_param": ratio,
            "balance": v.balance,
            **params,
        }
        work.append((cfg, meta, sweep.run_plots))
    return work
