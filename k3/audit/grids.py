"""Ablation grids (``k3 ablate --grid NAME``): a base model, its variants (k3.audit.ablate's transforms), seeds,
learning rates and shared training settings. ``micro`` is for tests; ``smoke`` runs on a CPU; the others are GPU
grids: ``default`` (every removal and pair), ``factorial`` (the 16 combinations of K3's four mechanisms, no-KDA
with RoPE, a learning rate per variant, 3 seeds, matched FLOPs) and ``balance896`` (the balancing methods at K3's
expert count); ``balance896_cpu`` is balance896 on the tiny preset, for a CPU."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from k3.config import K3Config, get_preset


@dataclass
class MQARSettings:
    variants: tuple[str, ...] = ("full", "no_kda", "no_mla")
    num_pairs: tuple[int, ...] = (8,)
    num_keys: int = 16
    num_values: int = 16
    layers: int = 2
    steps: int = 250
    batch_size: int = 32
    lr: float = 3e-3
    eval_size: int = 256
    seeds: tuple[int, ...] = (0,)


@dataclass
class Grid:
    name: str
    description: str
    preset: str
    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    train: dict  # TrainConfig fields shared by every run
    overrides: dict = field(default_factory=dict)  # base model overrides on the preset
    mqar: MQARSettings | None = None
    run_plots: bool = True  # each run's own loss / expert-load / AttnRes plots
    lrs: tuple[float, ...] = ()  # learning rates swept per variant at the first seed (empty: grid.train's lr)
    match: str = "tokens"  # "tokens": the same steps for every variant; "flops": full's training FLOPs

    def __post_init__(self) -> None:
        if self.match not in ("tokens", "flops"):
            raise ValueError(f"grid {self.name}: match={self.match!r} must be 'tokens' or 'flops'")
        if any(not (isinstance(lr, float) and lr > 0) for lr in self.lrs):
            raise ValueError(f"grid {self.name}: lrs={self.lrs!r} must be positive floats")

    def base_config(self) -> K3Config:
        return get_preset(self.preset).replace(**self.overrides)


ARCH_REMOVALS = ("no_kda", "no_mla", "no_attnres", "no_latent")
ALL_VARIANTS = ("full",) + ARCH_REMOVALS + ("bias_sign", "aux", "none")
FACTORS = ("no_kda", "no_attnres", "no_latent", "bias_sign")  # K3's KDA, AttnRes, latent experts, QB: off or on
FACTORIAL = tuple(
    "+".join(c) or "full" for r in range(len(FACTORS) + 1) for c in itertools.combinations(FACTORS, r)
)  # all 16 combinations
PAIRS = tuple(
    f"{a}+{b}" for i, a in enumerate(ARCH_REMOVALS) for b in ARCH_REMOVALS[i + 1 :] if {a, b} != {"no_kda", "no_mla"}
)

BALANCING_896 = (  # QB, sign bias at three steps, the auxiliary loss at three weights, none
    "full",
    "bias_sign",
    "bias_sign+gamma_div10",
    "bias_sign+gamma_x10",
    "aux",
    "aux+alpha_div10",
    "aux+alpha_x10",
    "none",
)
GPU_TRAIN = dict(  # the GPU grids' runs: 300 steps of 16 x 512 tokens
    steps=300,
    batch_size=16,
    seq_len=512,
    vocab_size=8192,
    tokenizer_train_bytes=4_000_000,
    max_tokens=None,
    eval_every=100,
    eval_rows=256,
    save_every=100,
    keep_checkpoints=1,  # ~85 runs side by side: three checkpoints each would fill a 64 GB disk
    lr=3e-3,
)
GRIDS: dict[str, Grid] = {
    "micro": Grid(
        name="micro",
        description="tests only: seconds on a CPU",
        preset="tiny",
        variants=("full", "no_kda", "bias_sign"),
        seeds=(0, 1),
        train=dict(
            steps=3,
            batch_size=2,
            seq_len=32,
            vocab_size=300,
            tokenizer_train_bytes=100_000,
            max_tokens=20_000,
            eval_every=3,
            eval_rows=4,
        ),
        mqar=MQARSettings(
            variants=("full", "no_mla"), num_pairs=(2,), num_keys=4, num_values=4, steps=3, batch_size=4, eval_size=16
        ),
        run_plots=False,
    ),
    "smoke": Grid(
        name="smoke",
        description="every variant kind on the tiny preset, 2 seeds; ~10 minutes on a 2-core CPU",
        preset="tiny",
        variants=ALL_VARIANTS + ("no_kda+no_attnres",),
        seeds=(0, 1),
        train=dict(
            steps=150,
            batch_size=8,
            seq_len=128,
            vocab_size=1024,
            tokenizer_train_bytes=1_000_000,
            max_tokens=300_000,
            eval_every=30,
            eval_rows=32,
            lr=3e-3,
        ),
        mqar=MQARSettings(
            variants=("full", "no_kda", "no_mla"), num_pairs=(8,), num_keys=16, num_values=16, steps=250, batch_size=32
        ),
    ),
    "default": Grid(
        name="default",
        description="small preset, every variant and pair of removals, 2 seeds (GPU)",
        preset="small",
        variants=ALL_VARIANTS + PAIRS,
        seeds=(0, 1),
        train=dict(
            steps=200,
            batch_size=16,
            seq_len=512,
            vocab_size=8192,
            tokenizer_train_bytes=4_000_000,
            max_tokens=None,
            eval_every=50,
            eval_rows=128,
            save_every=100,
            keep_checkpoints=1,
            lr=3e-3,
        ),
        mqar=MQARSettings(
            variants=("full", "no_kda", "no_mla", "no_attnres"),
            num_pairs=(16, 64),
            num_keys=256,
            num_values=256,
            steps=800,
            batch_size=64,
            eval_size=1024,
            seeds=(0,),
        ),
    ),
    "factorial": Grid(
        name="factorial",
        description="all 16 combinations of KDA, AttnRes, latent experts and QB, and no-KDA with RoPE; a "
        "learning rate per variant (best of 4 at seed 0), 3 seeds at it, matched training FLOPs (GPU)",
        preset="small",
        variants=FACTORIAL + ("no_kda_rope",),
        seeds=(0, 1, 2),
        lrs=(1e-3, 3e-3, 1e-2, 3e-2),
        match="flops",
        train=dict(GPU_TRAIN),
        run_plots=False,
    ),
    "balance896": Grid(
        name="balance896",
        description="QB vs sign-bias (three steps) vs auxiliary-loss (three weights) balancing vs none at K3's 896 "
        "experts / top-16 in a narrow model (3 seeds, GPU): the router frontier from trained routers",
        preset="small",
        overrides={"moe.num_experts": 896, "moe.num_experts_per_token": 16, "moe.moe_intermediate_size": 64},
        variants=BALANCING_896,
        seeds=(0, 1, 2),
        train=dict(GPU_TRAIN, lr=1e-2),  # the factorial grid's best rate for `full`
        run_plots=False,
    ),
    "balance896_cpu": Grid(
        name="balance896_cpu",
        description="balance896's methods at 896 experts / top-16 on the tiny preset (d = 64), 3 seeds, on a CPU "
        "(~50 minutes on 2 cores with --jobs 2 --threads 1)",
        preset="tiny",
        overrides={"moe.num_experts": 896, "moe.num_experts_per_token": 16, "moe.moe_intermediate_size": 8},
        variants=BALANCING_896,
        seeds=(0, 1, 2),
        train=dict(
            steps=200,
            batch_size=16,
            seq_len=128,
            vocab_size=1024,
            tokenizer_train_bytes=1_000_000,
            max_tokens=1_000_000,
            eval_every=100,
            eval_rows=64,
            lr=1e-2,
        ),
        run_plots=False,
    ),
}


def get_grid(name: str) -> Grid:
    try:
        return dataclasses.replace(GRIDS[name])
    except KeyError:
        raise ValueError(f"unknown grid {name!r}; choose one of: {', '.join(GRIDS)}") from None
