"""Design sweeps of k3 scaling: runs at several learning rates or tokens per parameter, each arm's best rate per
size, and the compute multiplier at each choice (k3.audit.sweeps, k3.audit.scaling_design)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from k3.audit.scaling_design import analyse_design, is_design, write_design_outputs
from k3.audit.sweeps import check_sweep, get_sweep, plan_sweep
from k3.cli.main import main
from k3.data.corpus import stdlib_corpus


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_a_sweep_plans_each_run_at_each_rate_and_ratio(tmp_path):
    """lrs and ratios multiply the runs: each (arm, size, seed) at every rate and ratio, its directory and meta
    naming both, its steps those of its ratio (nothing is trained)."""
    from k3.audit.runs import ensure_tokenizer

    data = tmp_path / "data"
    data.mkdir()
    for i, doc in enumerate(stdlib_corpus("all")[:40]):
        (data / f"doc{i:03d}.py").write_text(doc.text)
    micro = get_sweep("micro")
    sweep = dataclasses.replace(
        micro,
        sizes=micro.sizes[:2],
        lrs=(1e-3, 3e-2),
        ratios=(4e-3, 8e-3),
        min_steps=1,
    )
    tok = ensure_tokenizer(tmp_path, str(data), 300, 50_000)
    work = plan_sweep(sweep, tmp_path, str(data), tok, "cpu")
    assert len(work) == 2 * 2 * 2 * 2
    names = [Path(cfg.out).name for cfg, _, _ in work[:8]]
    assert names == [
        f"{arm}-w16-l2-tpp{r:g}-lr{lr:g}-s0" for r in (4e-3, 8e-3) for arm in ("k3", "baseline") for lr in (1e-3, 3e-2)
    ]
    per_step = micro.train["batch_size"] * micro.train["seq_len"]
    for cfg, meta, _ in work:
        assert cfg.lr == meta["lr"] and f"-lr{cfg.lr:g}-" in cfg.out and f"-tpp{meta['tokens_per_param']:g}-" in cfg.out
    k3_runs = [(cfg, meta) for cfg, meta, _ in work if meta["label"] == "k3"]
    for cfg, meta in k3_runs:  # steps from k3's activated parameters at the run's ratio
        assert cfg.steps == math.ceil(meta["tokens_per_param"] * meta["params_activated"] / per_step)
    assert {cfg.steps for cfg, meta in k3_runs if meta["width"] == 16} == {1, 2}
    plain = plan_sweep(micro, tmp_path, str(data), tok, "cpu")  # without lrs or ratios: the names as before
    assert [Path(cfg.out).name for cfg, _, _ in plain[:2]] == ["k3-w16-l2-s0", "baseline-w16-l2-s0"]
    assert {cfg.lr for cfg, _, _ in plain} == {3e-3}


@pytest.mark.parametrize(
    "field, value", [("lrs", (1e-2,)), ("lrs", (1e-2, 1e-2)), ("lrs", (0.0, 1e-2)), ("ratios", (5.0, float("inf")))]
)
def test_bad_rates_or_ratios_are_refused_in_one_line(field, value, capsys):
    sweep = dataclasses.replace(get_sweep("micro"), **{field: value})
    with pytest.raises(ValueError, match=f"{field}=.* must be >= 2 distinct positive numbers"):
        check_sweep(sweep)


def _design_runs(k: float = 2.0) -> list[dict]:
    """K3 reaches every loss with k times less compute than the baseline at each arm's best rate (1e-2 for k3,
    3e-2 for the baseline, whose loss at the shared 1e-2 is 0.05 higher); the other rates cost more."""
    runs = []
    for arm, best, scale in (("k3", 1e-2, k), ("baseline", 3e-2, 1.0)):
        for width, c in ((32, 1e12 * (0.8 if arm == "k3" else 1.0)), (64, 1e13 * (0.8 if arm == "k3" else 1.0))):
            for lr in (3e-3, 1e-2, 3e-2):
                extra = 0.0 if lr == best else 0.05 if lr == 1e-2 else 0.2
                runs.append(
                    {
                        "run_dir": f"runs/{arm}-w{width}-l4-lr{lr:g}-s0",
                        "label": arm,
                        "compute": c,
                        "loss": 40.0 * (scale * c) ** -0.1 + extra,
                        "tokens": 1000,
                        "width": width,
                        "layers": 4,
                        "lr": lr,
                        "seed": 0,
                        "step": 99,
                        "tokens_per_param": 5.0,
                    }
                )
    return runs


def test_best_rates_and_the_multiplier_at_each_choice():
    """Each cell's best rate (the edge flagged); tuned arms give the true multiplier at the middle and at each size,
    read where neither fit extrapolates; the shared rate, which handicaps the baseline, a larger one."""
    runs = _design_runs(k=2.0)
    assert is_design(runs) and not is_design([r for r in runs if r["lr"] == 1e-2])
    r = analyse_design(runs, shared_lr=1e-2)
    best = {(c["label"], c["width"]): (c["best_lr"], c["best_at_edge"]) for c in r["cells"]}
    assert best == {("k3", 32): (1e-2, False), ("k3", 64): (1e-2, False), ("baseline", 32): (3e-2, True)} | {
        ("baseline", 64): (3e-2, True)
    }
    by_kind = {ch["kind"]: ch for ch in r["choices"]}
    tuned = by_kind["best"]["result"]["multipliers"]["k3"]
    assert tuned["multiplier"] == pytest.approx(2.0, rel=1e-6)
    assert tuned["interval"] == [None, None] and "no interval" in tuned["interval_detail"]["method"]
    sizes = by_kind["best"]["by_size"]["k3"]
    assert [s["width"] for s in sizes] == [32, 64] and [s["loss_of"] for s in sizes] == ["k3", "baseline"]
    assert all(s["multiplier"] == pytest.approx(2.0, rel=1e-6) for s in sizes)
    shared = by_kind["shared"]["result"]["multipliers"]["k3"]["multiplier"]
    assert shared > 2.5  # 0.05 nats of an untuned baseline is worth more than the architecture here


def test_cell_losses_over_seeds_get_a_t_interval():
    runs = _design_runs()
    twin = [dict(r, seed=1, loss=r["loss"] + 0.02) for r in runs if r["label"] == "k3" and r["width"] == 32]
    cell = next(c for c in analyse_design(runs + twin, 1e-2)["cells"] if c["label"] == "k3" and c["width"] == 32)
    v = cell["lrs"][1e-2]
    assert v["losses"] == [pytest.approx(v["mean"] - 0.01), pytest.approx(v["mean"] + 0.01)]
    assert v["interval"][0] < v["mean"] < v["interval"][1] and "1 df" in v["interval_method"]
    assert "95%" in v["interval_method"]
    other = next(c for c in analyse_design(runs, 1e-2)["cells"] if c["label"] == "k3")
    assert other["lrs"][1e-2]["interval"] is None and other["lrs"][1e-2]["interval_method"] == "one seed: no interval"


def test_design_report_from_results_and_its_one_line_errors(tmp_path, capsys):
    out = tmp_path / "design"
    write_design_outputs(analyse_design(_design_runs(), 1e-2), out)
    text = (out / "design.md").read_text()
    assert "| `baseline` | 32 | 4 | 5 | 100 | 2.7238 | 2.5738 | **2.5238** | 0.03 (edge) |" in text
    assert "| 2.000 | — | no interval: a fit without residual df or below its E | w32: 2.000 at 2.408 (`k3`)" in text
    assert "each arm and size at its best lr" in text and "w32: 2.000 at" in text
    (out / "design.md").unlink()
    assert main(["scaling", "--from-results", "--out", str(out)]) == 0  # the recorded shared rate
    assert (out / "design.md").read_text() == text
    runs_only = tmp_path / "bare"
    runs_only.mkdir()
    (runs_only / "design.json").write_text(json.dumps({"runs": _design_runs(), "shared_lr": -1.0}))
    assert main(["scaling", "--from-results", "--out", str(runs_only)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--shared-lr=-1.0 must be a positive learning rate" in err[0]
    no_width = [dict(r, width=None) for r in _design_runs()]
    with pytest.raises(ValueError, match="runs without width, layers or lr"):
        analyse_design(no_width, 1e-2)


def test_each_ratio_gets_its_own_multiplier(tmp_path):
    """Runs at two tokens-per-parameter ratios and one rate: one choice per ratio, each fitted on its own runs,
    and no best-rate choice (there is nothing to pick)."""
    five = [r for r in _design_runs(k=2.0) if r["lr"] == 1e-2 and r["label"] == "k3"]
    five += [dict(r, loss=r["loss"] - 0.05) for r in _design_runs() if r["lr"] == 1e-2 and r["label"] == "baseline"]
    twenty = [
        dict(r, run_dir=r["run_dir"] + "-tpp20", tokens_per_param=20.0, compute=4 * r["compute"], loss=r["loss"])
        for r in _design_runs(k=1.5)
        if r["lr"] == (1e-2 if r["label"] == "k3" else 3e-2)
    ]
    for r in twenty:
        r["lr"] = 1e-2
    assert is_design(five + twenty)
    r = analyse_design(five + twenty, shared_lr=1e-2)
    assert [(ch["tokens_per_param"], ch["kind"]) for ch in r["choices"]] == [(5.0, "shared"), (20.0, "shared")]
    m = {ch["tokens_per_param"]: ch["result"]["multipliers"]["k3"]["multiplier"] for ch in r["choices"]}
    assert m[5.0] == pytest.approx(2.0, rel=1e-6) and m[20.0] == pytest.approx(1.5, rel=1e-6)
    write_design_outputs(r, tmp_path)
    assert "| 20 | every run at lr 0.01 | `k3` |" in (tmp_path / "design.md").read_text()
    bare = tmp_path / "bare"  # runs alone, at one rate: that rate is the shared one
    bare.mkdir()
    (bare / "design.json").write_text(json.dumps({"runs": five + twenty}))
    assert main(["scaling", "--from-results", "--out", str(bare)]) == 0
    assert json.loads((bare / "design.json").read_text())["shared_lr"] == 1e-2
    lone = analyse_design([dict(x, lr=3e-2) if x["label"] == "baseline" else x for x in five], shared_lr=1e-2)
    assert lone["choices"] == [] and lone["skipped"] == [
        "5 tokens/param, every run at lr 0.01: no `baseline` runs, no multiplier"
    ]
