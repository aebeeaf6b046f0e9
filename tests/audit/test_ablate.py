"""k3 ablate: variant transforms, the MQAR task, and the micro grid end to end (report, plots, resumability)."""

import dataclasses
import json
import shutil
import time

import pytest
import torch

from k3.audit import ablate
from k3.audit import runs
from k3.audit.ablate import make_variant, params_of, run_grid, variant_config, variant_train_config
from k3.audit.runs import run_one
from k3.audit.grids import ALL_VARIANTS, FACTORIAL, FACTORS, PAIRS, get_grid
from k3.audit.mqar import MQARTask, MQARTrainConfig, generate, mqar_config, train_mqar
from k3.cli.main import main
from k3.config import get_preset
from k3.data.corpus import stdlib_corpus
from k3.train.trainer import TrainConfig


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these models are tiny, and two processes with two spinning threads each on a 2-core
    machine run 20x slower than with one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """~60 stdlib files as a data directory: the same split rule, much less to read and tokenise per run."""
    d = tmp_path_factory.mktemp("data")
    for i, doc in enumerate(stdlib_corpus("all")[:60]):
        (d / f"doc{i:03d}.py").write_text(doc.text)
    return str(d)


@pytest.mark.parametrize("preset", ["tiny", "small", "k3"])
def test_variant_transforms(preset):
    base = get_preset(preset)
    full = params_of(base)
    for name in ALL_VARIANTS + PAIRS:
        v = make_variant(name, base)
        cfg = variant_config(base, v)
        assert cfg.num_hidden_layers == base.num_hidden_layers and cfg.hidden_size == base.hidden_size
        parts = name.split("+")
        assert (len(cfg.kda_layers) == 0) == ("no_kda" in parts)
        assert (len(cfg.mla_layers) == 0) == ("no_mla" in parts)
        assert (cfg.attn_res.mode == "none") == ("no_attnres" in parts)
        assert (cfg.moe.latent_size is None) == ("no_latent" in parts)
        assert v.balance == {"bias_sign": "sign", "aux": "aux", "none": "none"}.get(name, "qb")
        assert v.changes_model == (name not in ("full", "bias_sign", "aux", "none"))
    # no_latent: the shared experts stay as they are; the activated parameters of the MoE blocks (and of the
    # whole model) match within a few %, counted on the meta device, while the total grows (plain experts are d / l
    # times wider)
    nl_cfg = variant_config(base, make_variant("no_latent", base))
    assert nl_cfg.moe.shared_width == base.moe.shared_width
    nl = params_of(nl_cfg)
    assert nl["params_moe_activated"] == pytest.approx(full["params_moe_activated"], rel=0.03)
    assert nl["params_activated"] == pytest.approx(full["params_activated"], rel=0.03)
    assert nl["params_total"] > full["params_total"]
    moe_layers = base.num_hidden_layers - base.first_k_dense_replace
    shared = 3 * base.hidden_size * base.moe.shared_width
    assert (ablate.routed_activated(base) + shared) * moe_layers == pytest.approx(full["params_moe_activated"])
    d, k = base.hidden_size, base.moe.num_experts_per_token
    assert abs(ablate.routed_activated(nl_cfg) - ablate.routed_activated(base)) <= 3 * d * k / 2


def test_balancing_strength_variants():
    """gamma_* scales the sign-bias step, alpha_* the auxiliary-loss weight: TrainConfig fields of the variant;
    each refuses a method it does not apply to."""
    base = get_preset("tiny")
    assert make_variant("bias_sign+gamma_x10", base).train == {"balance_gamma": pytest.approx(1e-2)}
    assert make_variant("aux+alpha_div10", base).train == {"balance_alpha": pytest.approx(1e-3)}
    assert not make_variant("aux+alpha_x10", base).changes_model
    for bad in ("aux+gamma_x10", "alpha_x10", "bias_sign+alpha_x10"):
        with pytest.raises(ValueError, match="scales"):
            make_variant(bad, base)
    with pytest.raises(ValueError, match="again"):
        make_variant("bias_sign+gamma_x10+gamma_div10", base)
    cfg = TrainConfig(balance="sign", balance_gamma=1e-2)
    cfg.validate()
    # a run's config (ablation grids and scaling sweeps alike) takes the variant's strength over the shared fields
    v = make_variant("bias_sign+gamma_x10", base)
    run = variant_train_config(
        "tiny", {"hidden_size": 64}, {"steps": 5, "balance_gamma": 1e-3}, v, "b", 0, "r", "t", None, "cpu"
    )
    assert run.balance == "sign" and run.balance_gamma == pytest.approx(1e-2) and run.steps == 5
    assert run.overrides == {"hidden_size": 64, "name": "b"}
    with pytest.raises(ValueError, match="balance-alpha"):
        TrainConfig(balance_alpha=-1.0).validate()


def test_variant_errors():
    base = get_preset("tiny")
    for bad, msg in [
        ("no_kda+no_mla", "conflicts"),
        ("aux+none", "two balancing"),
        ("full+aux", "does not compose"),
        ("no_kda+no_kda", "repeats"),
        ("nope", "unknown variant"),
    ]:
        with pytest.raises(ValueError, match=msg):
            make_variant(bad, base)
    with pytest.raises(ValueError, match="plain"):
        make_variant("no_latent", base.replace(**{"moe.latent_size": None}))
    with pytest.raises(ValueError, match="unknown grid"):
        get_grid("huge")


def test_mqar_generator_targets_are_the_associated_values():
    task = MQARTask(num_keys=32, num_values=16, num_pairs=10, num_queries=6)
    x, y = generate(task, 64, torch.Generator().manual_seed(3))
    x2, y2 = generate(task, 64, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2) and torch.equal(y, y2)  # seeded
    assert x.shape == y.shape == (64, task.seq_len) and task.seq_len == 2 * (10 + 6)
    n = task.num_pairs
    for row, tgt in zip(x.tolist(), y.tolist()):
        keys, values = row[0 : 2 * n : 2], row[1 : 2 * n : 2]
        assert all(1 <= k <= task.num_keys for k in keys) and len(set(keys)) == n  # distinct keys
        assert all(task.num_keys < v < task.vocab_size for v in values)
        binding = dict(zip(keys, values))
        queried = []
        for pos, t in enumerate(tgt):
            if t == -100:
                continue
            assert pos >= 2 * n and (pos - 2 * n) % 2 == 0
            q = row[pos]
            assert q in binding and t == binding[q]  # the target is the value bound to the queried key
            assert row[pos + 1] == t  # teacher-forced value after the query
            queried.append(q)
        assert len(queried) == task.queries == len(set(queried))
    with pytest.raises(ValueError):
        MQARTask(num_keys=4, num_pairs=5)


def test_mqar_tiny_training_beats_chance():
    task = MQARTask(num_keys=8, num_values=8, num_pairs=4)
    cfg = mqar_config(get_preset("tiny"), task)
    assert [cfg.mixer(i) for i in range(2)] == ["kda", "mla"] and cfg.first_k_dense_replace == 2
    r = train_mqar(cfg, task, MQARTrainConfig(steps=120, batch_size=32, eval_size=128))
    assert r["chance"] == 0.125
    assert r["accuracy"] > 0.45, r  # well above chance (~0.9 after 150 steps in development)


def test_micro_grid_end_to_end_and_resumable(tmp_path, small_data):
    out = tmp_path / "ablate"
    grid = get_grid("micro")
    first = run_grid(grid, out, data=small_data, device="cpu")
    assert not any(s["skipped"] for s in first["runs"])
    assert len(first["runs"]) == len(grid.variants) * len(grid.seeds)
    for name in (
        "report.md",
        "results.json",
        "val_loss.png",
        "router_frontier.png",
        "loss_curves.png",
        "mqar.png",
        "tokenizer.json",
    ):
        assert (out / name).is_file(), name
    report = (out / "report.md").read_text()
    for v in grid.variants:
        assert f"| `{v}` |" in report
    assert "MQAR" in report and "| `no_mla` | kda/kda |" in report
    rows = {r["variant"]: r for r in first["variants"]}
    assert rows["full"]["val_loss_std"] is not None and rows["full"]["params_activated"] > 0
    # the router frontier from the trained routers: the runs that change only balancing, from their loads
    frontier = first["router_frontier"]
    assert sorted((r["variant"], r["seed"]) for r in frontier) == [
        ("bias_sign", 0),
        ("bias_sign", 1),
        ("full", 0),
        ("full", 1),
    ]
    for r in frontier:
        assert 0 <= r["padding_8"] <= r["padding_128"] < 1 and r["imbalance_ep8"] >= 1 and r["maxvio"] is not None
    assert "### Router frontier from the trained routers" in report
    # one tokenizer for every run
    cfgs = [
        json.loads((out / "runs" / f"{v}-s{s}" / "train_config.json").read_text())
        for v in grid.variants
        for s in grid.seeds
    ]
    assert {c["tokenizer"] for c in cfgs} == {str(out / "tokenizer.json")}
    assert json.loads((out / "runs" / "bias_sign-s1" / "train_config.json").read_text())["balance"] == "sign"

    t0 = time.perf_counter()
    assert main(["ablate", "--grid", "micro", "--out", str(out), "--data", small_data, "--device", "cpu"]) == 0
    assert time.perf_counter() - t0 < 15  # no training: tokenizer, accounting, report
    again = json.loads((out / "results.json").read_text())
    assert all(s["skipped"] for s in again["runs"])
    assert [s["val_loss"] for s in again["runs"]] == [s["val_loss"] for s in first["runs"]]

    # a run with a checkpoint short of its end is resumed (here: extended by one step), not restarted
    run_dir = out / "runs" / "full-s0"
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    cfg = TrainConfig(**{**json.loads((run_dir / "train_config.json").read_text()), "steps": 4, "eval_every": 4})
    resumed = run_one(cfg, {"variant": "full", "seed": 0}, plots=False)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]
    assert lines[:3] == before  # the first three steps are kept, not retrained
    assert not resumed["skipped"] and resumed["steps_done"] == 4 and resumed["checkpoint_step"] == 4

    # a finished run whose checkpoints were deleted (only summary + metrics kept) is still skipped
    import shutil

    shutil.rmtree(out / "runs" / "no_kda-s1" / "checkpoints")
    kept = json.loads((out / "runs" / "no_kda-s1" / "summary.json").read_text())
    cfg = TrainConfig(**json.loads((out / "runs" / "no_kda-s1" / "train_config.json").read_text()))
    again = run_one(cfg, {"variant": "no_kda", "seed": 1}, plots=False)
    assert again["skipped"] and again["val_loss"] == kept["val_loss"]


def test_grid_settings_are_consistent():
    for name in ("micro", "smoke", "default", "factorial", "balance896"):
        g = get_grid(name)
        base = g.base_config()
        for v in g.variants:
            variant_config(base, make_variant(v, base))
        assert len(g.seeds) >= 2
        TrainConfig(**g.train).validate()
    smoke = get_grid("smoke")
    assert {"full", "no_kda", "no_mla", "no_attnres", "no_latent", "bias_sign", "aux", "none"} <= set(smoke.variants)
    assert any("+" in v for v in smoke.variants)
    default = get_grid("default")
    assert set(PAIRS) <= set(default.variants) and len(default.seeds) >= 2
    fac = get_grid("factorial")
    assert len(FACTORIAL) == 16 and set(FACTORIAL) <= set(fac.variants)
    assert len(fac.seeds) >= 3 and len(fac.lrs) >= 3 and fac.match == "flops"
    b = get_grid("balance896").base_config()
    assert (b.moe.num_experts, b.moe.num_experts_per_token) == (896, 16)


def test_no_kda_in_two_forms():
    """no_kda leaves NoPE MLA everywhere (no position signal); no_kda_rope rotates MLA's rope slice."""
    base = get_preset("small")
    nope = variant_config(base, make_variant("no_kda", base))
    rope = variant_config(base, make_variant("no_kda_rope", base))
    assert not nope.kda_layers and not rope.kda_layers
    assert nope.mla.rope_theta is None and rope.mla.rope_theta == 10000.0
    with pytest.raises(ValueError, match="conflicts"):
        make_variant("no_kda+no_kda_rope", base)
    flat = base.replace(**{"mla.qk_rope_head_dim": 0})
    with pytest.raises(ValueError, match="no slice"):
        make_variant("no_kda_rope", flat)


def test_flops_matched_steps():
    """match="flops": a variant with more FLOPs per token trains proportionally fewer steps (attention counted)."""
    grid = dataclasses.replace(get_grid("factorial"), train={**get_grid("factorial").train, "steps": 1000})
    base = grid.base_config()
    vs = [make_variant(v, base) for v in ("full", "no_latent", "no_kda")]
    counted = {v.name: params_of(variant_config(base, v), 512) for v in vs}
    full = params_of(base, 512)["flops_per_token"]
    assert counted["full"]["flops_per_token"] == full
    steps = ablate.variant_steps(grid, full, counted)
    assert steps["full"] == 1000
    for v in vs[1:]:
        ratio = full / params_of(variant_config(base, v), 512)["flops_per_token"]
        assert steps[v.name] == round(1000 * ratio) and steps[v.name] != 1000
    assert ablate.variant_steps(dataclasses.replace(grid, match="tokens"), full, counted) == dict.fromkeys(steps, 1000)
    with pytest.raises(ValueError, match="match"):
        dataclasses.replace(grid, match="time")


def test_factorial_evidence_from_summaries():
    """ci_evidence on 16 variants x 3 seeds: differences to full with intervals, and the factorial effects."""
    from k3.audit.ablate_report import ci_evidence

    summaries = []
    for v in FACTORIAL:
        removed = set() if v == "full" else set(v.split("+"))
        for seed in (0, 1, 2):
            loss = 3.0 + 0.1 * ("no_kda" in removed) + 0.01 * seed
            summaries.append({"variant": v, "seed": seed, "val_loss": loss, "status": "done"})
    ev = ci_evidence(summaries, [], FACTORS)
    assert ev["difference_vs_full"]["no_kda"]["mean"] == pytest.approx(0.1)
    assert ev["difference_vs_full"]["no_attnres"]["mean"] == pytest.approx(0.0)
    assert ev["factorial"]["no_kda"]["mean"] == pytest.approx(0.1)
    assert ev["factorial"]["no_kda x bias_sign"]["mean"] == pytest.approx(0.0, abs=1e-12)
    partial = ci_evidence(summaries[3:], [], FACTORS)  # full's runs missing
    assert "error" in partial["factorial"] and partial["difference_vs_full"] == {}


def test_lr_sweep_end_to_end(tmp_path, small_data):
    """lrs: each variant at each rate with the first seed, the best rate chosen per variant, the other seeds at it;
    the report has the learning-rate table and the intervals; a second call trains nothing."""
    grid = dataclasses.replace(get_grid("micro"), variants=("full", "bias_sign"), seeds=(0, 1), lrs=(1e-3, 3e-3))
    grid.mqar = None
    r = run_grid(grid, tmp_path, data=small_data, device="cpu")
    assert len(r["lr_sweep"]) == 4 and {s["lr"] for s in r["lr_sweep"]} == {1e-3, 3e-3}
    chosen = ablate.best_lrs(r["lr_sweep"])
    assert sorted((s["variant"], s["seed"]) for s in r["runs"]) == [
        ("bias_sign", 0),
        ("bias_sign", 1),
        ("full", 0),
        ("full", 1),
    ]
    assert all(s["lr"] == chosen[s["variant"]] for s in r["runs"])
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert f"full-lr{chosen['full']:g}-s1" in names and len(names) == 6
    assert r["evidence"]["difference_vs_full"]["bias_sign"]["n"] == 2
    md = (tmp_path / "report.md").read_text()
    assert "## Learning rates" in md and "## Differences to `full` (95% paired t-intervals over seeds)" in md
    again = run_grid(grid, tmp_path, data=small_data, device="cpu")
    assert all(s.get("skipped") for s in again["runs"])


def test_jobs_run_side_by_side_and_report_only(tmp_path, small_data):
    """--jobs 2 (a spawned pool after a first run alone) gives the runs that one process gives; --report-only trains
    nothing and lists what is missing."""
    import dataclasses

    grid = dataclasses.replace(get_grid("micro"), variants=("full", "bias_sign"), seeds=(0, 1))
    serial = run_grid(grid, tmp_path / "serial", data=small_data, device="cpu")
    pooled = run_grid(grid, tmp_path / "pooled", data=small_data, device="cpu", jobs=2)
    assert [(s["variant"], s["seed"]) for s in pooled["runs"]] == [(s["variant"], s["seed"]) for s in serial["runs"]]
    for a, b in zip(pooled["runs"], serial["runs"]):
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-4 * abs(b["val_loss"]), (a, b)
        assert a["hardware"].startswith("CPU")
    assert [r["accuracy"] for r in pooled["mqar"]] == [r["accuracy"] for r in serial["mqar"]]

    (tmp_path / "pooled" / "runs" / "bias_sign-s1" / "summary.json").unlink()
    (tmp_path / "pooled" / "mqar" / "no_mla-p2-s0.json").unlink()
    again = run_grid(grid, tmp_path / "pooled", data=small_data, device="cpu", report_only=True)
    assert sorted(again["missing"]) == ["bias_sign-s1", "mqar/no_mla-p2-s0"]
    assert len(again["runs"]) == 3 and not (tmp_path / "pooled" / "runs" / "bias_sign-s1" / "summary.json").exists()
    report = (tmp_path / "pooled" / "report.md").read_text()
    assert "Not finished yet (2" in report and "`bias_sign-s1`" in report
    shutil.move(tmp_path / "pooled", tmp_path / "moved")  # finished runs are read where they are now
    moved = run_grid(grid, tmp_path / "moved", data=small_data, device="cpu", report_only=True)
    assert len(moved["runs"]) == 3 and all(s["run_dir"].startswith(str(tmp_path / "moved")) for s in moved["runs"])
    with pytest.raises(ValueError, match="jobs"):
        run_grid(grid, tmp_path / "bad", data=small_data, device="cpu", jobs=0)


def test_a_failing_job_is_reported_and_the_others_finish():
    import math

    done = {}
    with pytest.raises(RuntimeError, match=r"1 of 3 jobs failed .*job 2: ValueError"):
        runs.run_jobs(math.sqrt, [4.0, -1.0, 9.0], workers=2, done=lambda i, r: done.update({i: r}))
    assert done == {0: 2.0, 2: 3.0}
    with pytest.raises(RuntimeError, match=r"1 of 3 jobs failed .*run minus-one: ValueError"):
        runs.run_jobs(math.sqrt, [4.0, -1.0, 9.0], workers=2, labels=["run four", "run minus-one", "run nine"])
    assert runs.run_jobs(math.sqrt, [4.0, 9.0, 16.0], workers=2, warm_first=False) == [2.0, 3.0, 4.0]


def test_lr_table_names_variants_best_at_the_edge():
    """A variant whose best rate is the smallest or largest swept is named: its optimum may lie outside the grid."""
    from k3.audit.ablate_report import _evidence_lines

    losses = {"full": (3.5, 3.2, 3.4), "no_kda": (3.9, 3.8, 3.7), "aux": (3.3, 3.4, float("nan"))}
    sweep = [
        {"variant": v, "lr": lr, "seed": 0, "val_loss": x, "status": "done"}
        for v, xs in losses.items()
        for lr, x in zip((1e-3, 3e-3, 1e-2), xs)
    ]
    md = "\n".join(_evidence_lines({"lr_sweep": sweep}))
    note = next(line for line in md.splitlines() if line.startswith("Best at the edge"))
    assert "`no_kda` (0.01)" in note and "`aux` (0.001)" in note and "`full`" not in note
