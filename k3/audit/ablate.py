"""Ablations (``k3 ablate``): named variants of a base preset, grids of matched runs, and their report.

Grids are in :mod:`k3.audit.grids`. Variants are config transforms of the grid's base model (preset + the grid's
overrides). Every variant keeps the number of layers and the width; a ``+`` composes transforms left to right
(``no_kda+no_attnres``).

    full         K3 as is: KDA + MLA, AttnRes, Stable LatentMoE, QB balancing
    no_kda       every layer MLA (``mla_layers`` = all), NoPE as K3's MLA: no position signal left at all
    no_kda_rope  every layer MLA with RoPE on its rope slice (``mla.rope_theta`` 10000): "no KDA" without also
                 taking the model's only source of positions away
    no_mla       every layer KDA (``mla_layers`` = none)
    no_attnres   ``attn_res.mode = none`` (plain pre-norm residual stream)
    no_latent    plain MoE at matched activated cost (rule below)
    swiglu       SwiGLU (``hidden_act`` silu) instead of SiTU-GLU, as K2
    bias_sign    same model, loss-free sign-bias balancing (``--balance sign``, DeepSeek-V3 / K2)
    aux          same model, Switch auxiliary loss (alpha 1e-2), no bias
    seqaux       same model, sign bias + sequence-wise auxiliary loss (DeepSeek-V3)
    none         same model, no balancing at all
    gamma_x10    (with bias_sign / seqaux) the sign-bias step x10; ``gamma_div10``: / 10
    alpha_x10    (with aux / seqaux) the auxiliary-loss weight x10; ``alpha_div10``: / 10

``no_latent`` rule. Latent experts live in width l with a down/up projection (d x l each) and an RMSNorm (l)
around the routed sum; a plain expert lives in width d. The shared experts are left as they are (their width is
pinned by ``moe.shared_intermediate_size``), and so are the number of experts E and the top-k k (the routing and
the balancing problem stay the same); the one integer I' for the routed experts is the one that best matches the
activated parameters of the routed path per token:

    latent:  3 l I k + 2 d l + l [norm]      (top-k routed experts + projections + norm)
    plain:   3 d I' k                        ->  I' = round(latent / (3 d k))

so the model's activated parameters (and matmul FLOPs per token) match to within 3 d k / 2 (half a unit of I'),
and the shared path is the same model for model; the total parameters differ (plain experts are d / l times
wider). The report lists both counts for every variant.

A grid (:data:`k3.audit.grids.GRIDS`) is a base model, a list of variants, seeds and shared training settings. Every
run is a :class:`~k3.train.trainer.Trainer` run in ``OUT/runs/<variant>-s<seed>/`` with one tokenizer trained once
into ``OUT/tokenizer.json``; a run whose final checkpoint exists is skipped, a run with a checkpoint short of the
end is resumed, a run killed before its first checkpoint starts over. A grid with ``lrs`` gives every variant its
own learning rate: each variant runs at each of them with the first seed (``OUT/runs/<variant>-lr<lr>-s<seed>/``),
the lowest final validation loss picks its rate, and the other seeds run at that rate. ``match="flops"`` trains
every variant for the training FLOPs of ``full`` (attention counted, k3.audit.accounting) instead of the same number
of tokens. The report gives each variant's difference to ``full`` with a paired t 95% interval over seeds, and for
the 16 variants of :data:`FACTORIAL` the main effects and two-factor interactions of a pooled-variance model of
every run (:mod:`k3.audit.stats`).
MQAR recall (:mod:`k3.audit.mqar`) runs next (``OUT/mqar/*.json``, skipped when present), then ``OUT/report.md``,
``OUT/results.json`` and the plots are written from whatever is on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


from k3.audit import accounting
from k3.audit.ablate_report import finite
from k3.audit.frontier import trained_frontier
from k3.audit.grids import FACTORIAL, FACTORS, Grid
from k3.audit.runs import check_jobs, ensure_tokenizer, finished_summary, run_job, run_jobs
from k3.audit.mqar import MQARTask, MQARTrainConfig, mqar_config, train_mqar
from k3.config import K3Config
from k3.model.balance import DEFAULT_ALPHA, DEFAULT_GAMMA

log = logging.getLogger("k3.ablate")

BASE_BALANCE = "qb"


# ---------------------------------------------------------------------------------------------------- variants
def _no_kda(cfg: K3Config) -> dict:
    return {"mla_layers": list(range(cfg.num_hidden_layers))}


def _no_kda_rope(cfg: K3Config) -> dict:
    if cfg.mla.qk_rope_head_dim == 0:
        raise ValueError("no_kda_rope: mla.qk_rope_head_dim is 0, there is no slice to rotate")
    return _no_kda(cfg) | {"mla.rope_theta": cfg.mla.rope_theta or 10000.0}


def _swiglu(cfg: K3Config) -> dict:
    if cfg.hidden_act == "silu":
        raise ValueError("swiglu: the base model already uses SwiGLU")
    return {"hidden_act": "silu"}


def _no_mla(cfg: K3Config) -> dict:
    return {"mla_layers": []}


def _no_attnres(cfg: K3Config) -> dict:
    if cfg.attn_res.mode == "none":
        raise ValueError("no_attnres: the base model has no AttnRes")
    return {"attn_res.mode": "none"}


def routed_activated(cfg: K3Config) -> float:
    """Activated parameters of one MoE block's routed path per token, router excluded (see the module docstring)."""
    m, d = cfg.moe, cfg.hidden_size
    k, i = m.num_experts_per_token, m.moe_intermediate_size
    if m.latent_size is None:
        return 3 * d * i * k
    lat = m.latent_size
    return 3 * lat * i * k + 2 * d * lat + (lat if m.latent_norm else 0)


def matched_plain_intermediate(cfg: K3Config) -> int:
    """The plain-MoE routed ``moe_intermediate_size`` whose activated routed-path parameters best match ``cfg``'s."""
    return max(1, round(routed_activated(cfg) / (3 * cfg.hidden_size * cfg.moe.num_experts_per_token)))


def _no_latent(cfg: K3Config) -> dict:
    if cfg.moe.latent_size is None:
        raise ValueError("no_latent: the base model already has plain (non-latent) experts")
    shared = cfg.moe.shared_intermediate_size or cfg.moe.moe_intermediate_size
    return {
        "moe.latent_size": None,
        "moe.moe_intermediate_size": matched_plain_intermediate(cfg),
        "moe.shared_intermediate_size": shared,
    }


def _gamma(scale: float) -> Callable[[str], dict]:
    def train(method: str) -> dict:
        if method not in ("sign", "seqaux"):
            raise ValueError(f"the sign-bias step scales sign or seqaux balancing, not {method!r}")
        return {"balance_gamma": DEFAULT_GAMMA * scale}

    return train


def _alpha(scale: float) -> Callable[[str], dict]:
    def train(method: str) -> dict:
        if method not in DEFAULT_ALPHA:
            raise ValueError(f"the auxiliary-loss weight scales aux or seqaux balancing, not {method!r}")
        return {"balance_alpha": DEFAULT_ALPHA[method] * scale}

    return train


@dataclass(frozen=True)
class Transform:
    description: str
    overrides: Callable[[K3Config], dict] | None = None  # model change (dotted K3Config fields)
    balance: str | None = None  # balancing change
    train: Callable[[str], dict] | None = None  # TrainConfig changes, given the variant's balancing method


TRANSFORMS: dict[str, Transform] = {
    "full": Transform("K3 as is: KDA + MLA, AttnRes, latent MoE, QB"),
    "no_kda": Transform("all layers MLA", _no_kda),
    "no_kda_rope": Transform("all layers MLA with RoPE", _no_kda_rope),
    "no_mla": Transform("all layers KDA", _no_mla),
    "no_attnres": Transform("plain residual stream (attn_res.mode none)", _no_attnres),
    "no_latent": Transform("plain MoE at matched activated parameters", _no_latent),
    "swiglu": Transform("SwiGLU instead of SiTU-GLU", _swiglu),
    "bias_sign": Transform("sign-bias balancing instead of QB", balance="sign"),
    "aux": Transform("auxiliary-loss balancing instead of QB", balance="aux"),
    "seqaux": Transform("sign bias + sequence-wise aux loss instead of QB", balance="seqaux"),
    "none": Transform("no load balancing", balance="none"),
    "gamma_x10": Transform("sign-bias step x10", train=_gamma(10.0)),
    "gamma_div10": Transform("sign-bias step / 10", train=_gamma(0.1)),
    "alpha_x10": Transform("auxiliary-loss weight x10", train=_alpha(10.0)),
    "alpha_div10": Transform("auxiliary-loss weight / 10", train=_alpha(0.1)),
}


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    overrides: dict  # dotted K3Config fields on top of the base (its own changes only)
    balance: str
    train: dict = dataclasses.field(default_factory=dict)  # TrainConfig fields (balancing strength)

    @property
    def changes_model(self) -> bool:
        return bool(self.overrides)


def make_variant(name: str, base: K3Config, base_balance: str = BASE_BALANCE) -> Variant:
    """Compose the transforms named in ``name`` (``a+b+...``) on ``base``; conflicts raise ValueError."""
    parts = [p.strip() for p in name.split("+")]
    if not all(parts):
        raise ValueError(f"variant {name!r}: empty component")
    unknown = [p for p in parts if p not in TRANSFORMS]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r}; choose from {', '.join(TRANSFORMS)} (compose with +)")
    if len(set(parts)) != len(parts):
        raise ValueError(f"variant {name!r} repeats a component")
    if "full" in parts and len(parts) > 1:
        raise ValueError(f"variant {name!r}: 'full' does not compose")
    cfg, overrides, balance, descriptions = base, {}, None, []
    for p in parts:
        t = TRANSFORMS[p]
        descriptions.append(t.description)
        if t.overrides is not None:
            ov = t.overrides(cfg)
            clash = sorted(set(ov) & set(overrides))
            if clash:
                raise ValueError(f"variant {name!r}: {p} conflicts with an earlier component on {', '.join(clash)}")
            overrides.update(ov)
            cfg = base.replace(**overrides)  # validates the composed model
        if t.balance is not None:
            if balance is not None:
                raise ValueError(f"variant {name!r}: two balancing changes")
            balance = t.balance
    if cfg.num_hidden_layers != base.num_hidden_layers or cfg.hidden_size != base.hidden_size:
        raise AssertionError("variants keep depth and width")  # pragma: no cover - guarded by the transforms
    method = balance or base_balance
    train = {}
    for p in parts:
        if TRANSFORMS[p].train is not None:
            change = TRANSFORMS[p].train(method)
            if set(change) & set(train):
                raise ValueError(f"variant {name!r}: {p} changes {', '.join(sorted(set(change) & set(train)))} again")
            train.update(change)
    return Variant(name, "; ".join(descriptions), overrides, method, train)


def variant_config(base: K3Config, variant: Variant) -> K3Config:
    return base.replace(**variant.overrides)


def params_of(config: K3Config, context: int = 4096) -> dict:
    """Total and activated parameters (meta device; activated excludes the input embedding) and the forward FLOPs
    per token at ``context`` (matmuls and attention, k3.audit.accounting)."""
    r = accounting.report(config, context=context)
    act = r["params_activated_by_path"]
    return {
        "params_total": int(r["params_total"]),
        "params_activated": float(r["params_activated"]),
        "params_moe_activated": float(act["routed_experts"] + act["latent_proj"] + act["shared_experts"]),
        "flops_per_token": float(r["flops_per_token_forward"]),
    }


def _run_tagged(job: tuple, progress: bool = False) -> dict:
    kind, payload = job
    return run_job(payload, progress) if kind == "train" else _run_mqar_job(payload)


def variant_train_config(
    preset: str,
    overrides: dict,
    train: dict,
    variant: Variant,
    name: str,
    seed: int,
    run_dir: Path,
    tokenizer: Path,
    data,
    device: str,
):
    """The TrainConfig of one run of ``variant``: ``overrides`` (the grid's or the sweep size's) under the
    variant's own, ``train`` under the variant's training fields (its balancing strength)."""
    from k3.train.trainer import TrainConfig

    return TrainConfig(
        preset=preset,
        overrides={**overrides, **variant.overrides, "name": name},
        data=data,
        tokenizer=str(tokenizer),
        balance=variant.balance,
        out=str(run_dir),
        seed=seed,
        device=device,
        samples=0,
        **{**train, **variant.train},
    )


def variant_steps(grid: Grid, full_flops: float, counted: dict[str, dict]) -> dict[str, int]:
    """Training steps per variant (``counted``: name -> :func:`params_of` at the grid's sequence length):
    grid.train's for ``match="tokens"``; for ``"flops"`` scaled by full's forward FLOPs per token
    (``full_flops``) over the variant's (attention counted), rounded."""
    steps = grid.train.get("steps", 1000)
    if grid.match == "tokens":
        return dict.fromkeys(counted, steps)
    return {name: max(1, round(steps * full_flops / c["flops_per_token"])) for name, c in counted.items()}


def best_lrs(sweep: list[dict]) -> dict[str, float]:
    """Per variant, the swept learning rate whose run (first seed) ended with the lowest finite validation loss."""
    best: dict[str, tuple[float, float]] = {}
    for s in sweep:
        loss = s.get("val_loss")
        if s.get("status") == "done" and finite(loss) and (s["variant"] not in best or loss < best[s["variant"]][0]):
            best[s["variant"]] = (loss, s["lr"])
    return {v: lr for v, (_, lr) in best.items()}


def run_grid(
    grid: Grid,
    out: str | Path,
    data: str | None = None,
    device: str = "auto",
    progress: bool = False,
    mqar: bool = True,
    jobs: int = 1,
    report_only: bool = False,
    warm_first: bool = True,
) -> dict:
    """Run (or resume) every run of ``grid`` under ``out``, then MQAR, then write the report. Returns results.

    ``jobs``: runs side by side (:func:`run_jobs`). ``report_only``: train nothing; report the finished runs on
    disk (the report lists the missing ones).
    """
    from k3.audit.ablate_report import _fmt, aggregate, ci_evidence, write_report

    check_jobs(jobs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    base = grid.base_config()
    variants = [make_variant(v, base) for v in grid.variants]  # validate every variant before any training
    mqar_plan = mqar_runs(grid, base) if grid.mqar and mqar else []  # validated before any training
    (out / "grid.json").write_text(json.dumps({**dataclasses.asdict(grid), "data": data}, indent=2, default=str))
    tok_path = ensure_tokenizer(
        out, data, grid.train.get("vocab_size", 8192), grid.train.get("tokenizer_train_bytes", 4_000_000)
    )
    from k3.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tok_path)
    sized = base.replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
    ctx = grid.train.get("seq_len", 512)
    counted = {v.name: params_of(variant_config(sized, v), ctx) for v in variants}
    full = counted["full"] if "full" in counted else params_of(sized, ctx)
    steps = variant_steps(grid, full["flops_per_token"], counted)

    def job(v: Variant, seed: int, lr: float) -> tuple:
        name = f"{v.name}-lr{lr:g}-s{seed}" if grid.lrs else f"{v.name}-s{seed}"
        train = {**grid.train, "lr": lr, "steps": steps[v.name]}
        cfg = variant_train_config(
            grid.preset, grid.overrides, train, v, v.name, seed, out / "runs" / name, tok_path, data, device
        )
        meta = {
            "variant": v.name,
            "label": v.name,
            "seed": seed,
            "lr": lr,
            "balance": v.balance,
            "description": v.description,
            "train_overrides": v.train,
            "overrides": v.overrides,
            **counted[v.name],
        }
        return cfg, meta, grid.run_plots

    missing: list[str] = []
    mqar_results, mqar_todo = mqar_jobs(grid, mqar_plan, out, device, report_only, missing) if mqar_plan else ([], [])

    def run_phase(plan: list, mqar_todo: list) -> tuple[list[dict], list[dict]]:
        """(MQAR results, run summaries) of ``plan``: run now, or with ``report_only`` read from disk."""
        if report_only:
            summaries = []
            for cfg, _meta, _ in plan:
                s = finished_summary(cfg)
                if s is None:
                    missing.append(Path(cfg.out).name)
                else:
                    summaries.append(s)
            return [], summaries

        def done(i: int, r: dict) -> None:
            if i < len(mqar_todo):
                log.info(
                    "MQAR %s pairs %d seed %d: accuracy %.3f (chance %.3f, %.0fs)",
                    r["variant"],
                    r["task"]["num_pairs"],
                    r["seed"],
                    r["accuracy"],
                    r["chance"],
                    r["train_s"],
                )
            else:
                log.info(
                    "[%d/%d] %s seed %d lr %g: %s val loss %s (%.0fs)",
                    i - len(mqar_todo) + 1,
                    len(plan),
                    r["variant"],
                    r["seed"],
                    r.get("lr", float("nan")),
                    "skipped," if r.get("skipped") else "",
                    _fmt(r.get("val_loss")),
                    r.get("wall_s") or 0,
                )

        # the MQAR runs go first: single long runs that would otherwise finish last, alone
        work = [("mqar", j) for j in mqar_todo] + [("train", j) for j in plan]
        labels = [f"MQAR {j[-1].stem}" for j in mqar_todo] + [f"run {Path(j[0].out).name}" for j in plan]
        out_all = run_jobs(
            functools.partial(_run_tagged, progress=progress and jobs == 1), work, jobs, done, warm_first, labels
        )
        return out_all[: len(mqar_todo)], out_all[len(mqar_todo) :]

    lr0 = grid.train.get("lr", 3e-3)
    sweep: list[dict] = []
    if grid.lrs:  # the first seed at every rate, then the other seeds at each variant's best
        done_mqar, sweep = run_phase([job(v, grid.seeds[0], lr) for v in variants for lr in grid.lrs], mqar_todo)
        lr_of = best_lrs(sweep)
        rest = [job(v, seed, lr_of[v.name]) for seed in grid.seeds[1:] for v in variants if v.name in lr_of]
        unpicked = [v.name for v in variants if v.name not in lr_of]
        missing += [f"{name}-s{seed} (no learning rate chosen)" for name in unpicked for seed in grid.seeds[1:]]
        summaries = [s for s in sweep if lr_of.get(s["variant"]) == s["lr"]] + run_phase(rest, [])[1]
    else:  # seed-major: a grid stopped early has every variant at its first seeds
        done_mqar, summaries = run_phase([job(v, seed, lr0) for seed in grid.seeds for v in variants], mqar_todo)
    mqar_results += done_mqar
    if missing:
        log.warning("%d runs are not finished (report written without them): %s", len(missing), ", ".join(missing))
    results = aggregate(summaries)
    evidence = ci_evidence(summaries, sweep, FACTORS if set(FACTORIAL) <= {v.name for v in variants} else ())
    report = {
        "grid": grid.name,
        "out": str(out),
        "runs": summaries,
        "variants": results,
        "lr_sweep": sweep,
        "evidence": evidence,
        "mqar": mqar_results,
        "missing": missing,
        "wall_s_this_invocation": time.perf_counter() - t_start,
    }
    moe, t = sized.moe, grid.train
    report["router_frontier"] = trained_frontier(
        [s for s in summaries if not s.get("overrides")],
        t.get("batch_size", 8) * t.get("seq_len", 512),
        moe.num_experts_per_token,
        moe.latent_size or sized.hidden_size,
    )
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    write_report(out, grid, summaries, results, mqar_results, data, missing, evidence, report["router_frontier"])
    return report


def grid_from_json(path: Path) -> tuple[Grid, str | None]:
    """(the grid, its data) recorded in a grid's ``grid.json`` (what :func:`run_grid` wrote)."""
    from k3.audit.grids import MQARSettings

    d = json.loads(Path(path).read_text())
    data = d.pop("data", None)
    known = {f.name for f in dataclasses.fields(Grid)}
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
    if fields.get("mqar") is not None:
        mq = {k: tuple(v) if isinstance(v, list) else v for k, v in fields["mqar"].items()}
        fields["mqar"] = MQARSettings(**mq)
    return Grid(**fields), data


def rerender_from_results(out: str | Path) -> dict:
    """Recompute a grid's statistics from the run summaries in ``OUT/results.json`` and rewrite ``report.md``,
    ``results.json`` and the plots that need no run directory, training and reading no runs: for a report whose
    runs are not on disk (with them, :func:`run_grid` with ``report_only`` reads the runs themselves)."""
    from k3.audit.ablate_report import aggregate, ci_evidence, write_report
    from k3.fs import atomic_write_text

    out = Path(out)
    for name in ("results.json", "grid.json"):
        if not (out / name).is_file():
            raise FileNotFoundError(f"{out}: no {name} to re-render from")
    report = json.loads((out / "results.json").read_text())
    grid, data = grid_from_json(out / "grid.json")
    summaries, sweep = report["runs"], report.get("lr_sweep", [])
    report["variants"] = aggregate(summaries)
    factors = FACTORS if set(FACTORIAL) <= set(grid.variants) else ()
    report["evidence"] = ci_evidence(summaries, sweep, factors)
    atomic_write_text(out / "results.json", json.dumps(report, indent=2, default=str))
    write_report(
        out,
        grid,
        summaries,
        report["variants"],
        report.get("mqar", []),
        data,
        report.get("missing"),
        report["evidence"],
        report.get("router_frontier"),
    )
    return report


def mqar_runs(grid: Grid, base: K3Config) -> list[tuple[Variant, MQARTask, K3Config, int]]:
    """(variant, task, model config, seed) for every MQAR run of ``grid``; variants act on the MQAR model."""
    st = grid.mqar
    plan = []
    for name in st.variants:
        for pairs in st.num_pairs:
            task = MQARTask(num_keys=st.num_keys, num_values=st.num_values, num_pairs=pairs)
            mbase = mqar_config(base, task, st.layers)
            v = make_variant(name, mbase)
            if v.balance != BASE_BALANCE or any(k.startswith("moe.") for k in v.overrides):
                raise ValueError(
                    f"MQAR variant {name!r}: the MQAR models are dense (no router); use mixer / AttnRes variants"
                )
            plan += [(v, task, variant_config(mbase, v), seed) for seed in st.seeds]
    return plan


def _run_mqar_job(job: tuple) -> dict:
    """Train one MQAR model and write its result file (module level: pool worker)."""
    name, task, cfg, tcfg, path = job
    r = {"variant": name, **train_mqar(cfg, task, tcfg)}
    path.write_text(json.dumps(r, indent=2))
    return r


def mqar_jobs(
    grid: Grid, plan: list, out: Path, device: str, report_only: bool = False, missing: list | None = None
) -> tuple[list[dict], list[tuple]]:
    """(results already in ``OUT/mqar``, jobs for :func:`_run_mqar_job` still to run) for the MQAR ``plan``;
    with ``report_only`` nothing is to run and the unfinished ones are named in ``missing``."""
    from k3.infer.load import resolve_device

    st = grid.mqar
    mdir = out / "mqar"
    mdir.mkdir(exist_ok=True)
    dev = str(resolve_device(device))
    results, todo = [], []
    for v, task, cfg, seed in plan:
        path = mdir / f"{v.name}-p{task.num_pairs}-s{seed}.json"
        if path.is_file():
            r = json.loads(path.read_text())
            if r.get("steps") == st.steps and r.get("task") == dataclasses.asdict(task):
                results.append(r)
                continue
        if report_only:
            if missing is not None:
                missing.append(f"mqar/{path.stem}")
            continue
        tcfg = MQARTrainConfig(
            steps=st.steps, batch_size=st.batch_size, lr=st.lr, eval_size=st.eval_size, seed=seed, device=dev
        )
        todo.append((v.name, task, cfg, tcfg, path))
    return results, todo
