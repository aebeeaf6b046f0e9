"""k3 scaling: power-law fits, compute multipliers with bootstrap intervals, and the micro sweep end to end."""

import json
import shutil

import numpy as np
import pytest
import torch

from k3.audit.ablate import make_variant, params_of, variant_config
from k3.audit.scaling import (
    analyse,
    bootstrap_fit,
    bootstrap_multiplier,
    compute_multiplier,
    fit_power_law,
    load_run,
    write_outputs,
)
from k3.audit.sweeps import SWEEPS, check_sweep, get_sweep, run_sweep, size_overrides
from k3.cli.main import main
from k3.config import get_preset
from k3.data.corpus import stdlib_corpus


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def synthetic(a, b, c, noise, seed, e=0.0):
    rng = np.random.default_rng(seed)
    return e + a * c**-b * np.exp(rng.normal(0.0, noise, c.size))


def test_fit_recovers_a_and_b():
    c = np.geomspace(1e14, 1e19, 8).repeat(2)
    f = fit_power_law(c, synthetic(45.0, 0.09, c, 0.005, 0))
    assert f.b == pytest.approx(0.09, rel=0.05) and f.a == pytest.approx(45.0, rel=0.25)
    exact = fit_power_law(c, synthetic(45.0, 0.09, c, 0.0, 0))
    assert exact.b == pytest.approx(0.09, rel=1e-9) and exact.a == pytest.approx(45.0, rel=1e-6)
    assert exact.loss(1e16) == pytest.approx(45.0 * 1e16**-0.09) and exact.compute(exact.loss(3e17)) == pytest.approx(
        3e17
    )
    # with an irreducible term: E + a C^-b
    f3 = fit_power_law(c, synthetic(300.0, 0.15, c, 0.002, 1, e=1.5), irreducible=True)
    assert f3.e == pytest.approx(1.5, abs=0.05) and f3.b == pytest.approx(0.15, rel=0.1)
    assert f3.loss(c).min() > f3.e and np.isnan(f3.compute(f3.e - 0.1))


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="distinct"):
        fit_power_law([1e15, 1e15], [3.0, 3.1])
    with pytest.raises(ValueError, match="distinct"):
        fit_power_law([1e15, 1e16], [3.0, 2.9], irreducible=True)
    with pytest.raises(ValueError, match="positive"):
        fit_power_law([1e15, -1.0], [3.0, 2.9])


def _two_families(k: float, sizes: int, seeds: int):
    """Family A reaches every loss with k times less compute than B: L_A(C) = L_B(k C)."""
    c = np.geomspace(1e15, 1e19, sizes).repeat(seeds)
    loss_b = synthetic(40.0, 0.08, c, 0.003, 2)
    loss_a = synthetic(40.0, 0.08, k * c, 0.003, 3)
    runs = [
        {"label": "k3", "compute": ci, "loss": li, "run_dir": f"a{i}", "tokens": 1}
        for i, (ci, li) in enumerate(zip(c, loss_a))
    ]
    runs += [
        {"label": "baseline", "compute": ci, "loss": li, "run_dir": f"b{i}", "tokens": 1}
        for i, (ci, li) in enumerate(zip(c, loss_b))
    ]
    return c, loss_a, loss_b, runs


def test_compute_multiplier_and_bootstrap_interval():
    """With >= 20 runs an arm the intervals are the seeded bootstrap's, and say so."""
    k = 3.0
    c, loss_a, loss_b, runs = _two_families(k, 7, 3)
    fa, fb = fit_power_law(c, loss_a), fit_power_law(c, loss_b)
    assert float(compute_multiplier(fa, fb, 2.0)) == pytest.approx(k, rel=0.1)
    r = analyse(runs, n_boot=400, seed=0)
    m = r["multipliers"]["k3"]
    assert r["baseline"] == "baseline" and m["overlap"]
    assert m["multiplier"] == pytest.approx(k, rel=0.1)
    lo, hi = m["interval"]
    assert lo < k < hi and hi / lo < 1.5
    assert m["interval_detail"]["method"].startswith("percentile bootstrap") and m["interval_detail"]["level"] == "90%"
    fit = r["fits"]["k3"]["interval"]
    assert fit["b"][0] < 0.08 < fit["b"][1] and fit["method"].startswith("percentile bootstrap")
    # seeded: the same intervals again
    again = bootstrap_multiplier(c, loss_a, c, loss_b, m["at_loss"], n_boot=400, seed=0)
    assert (again["low"], again["high"]) == (lo, hi)
    # the irreducible form finds the same multiplier on pure power laws
    r3 = analyse(runs, n_boot=50, irreducible=True)
    assert r3["multipliers"]["k3"]["multiplier"] == pytest.approx(k, rel=0.15)


def test_few_runs_get_t_intervals_not_a_bootstrap(tmp_path):
    """Below 20 runs an arm the bootstrap refuses, and the intervals are t on the fit's covariance: for L = a C^-b
    the interval of b is the least-squares slope's t-interval on log L (n - 2 df, as scipy's linregress gives),
    and the multiplier's covers the truth."""
    scipy_stats = pytest.importorskip("scipy.stats")
    k = 3.0
    c, loss_a, loss_b, runs = _two_families(k, 6, 3)
    with pytest.raises(ValueError, match=">= 20 runs per architecture, got 18"):
        bootstrap_multiplier(c, loss_a, c, loss_b, 2.0)
    with pytest.raises(ValueError, match=">= 20 runs"):
        bootstrap_fit(c, loss_a)
    r = analyse(runs, n_boot=400)
    fit = r["fits"]["k3"]["interval"]
    lr = scipy_stats.linregress(np.log(c), np.log(loss_a))
    half = scipy_stats.t.ppf(0.95, c.size - 2) * lr.stderr
    assert fit["b"] == [pytest.approx(-lr.slope - half, rel=1e-6), pytest.approx(-lr.slope + half, rel=1e-6)]
    assert fit["method"] == "t on the fit's linearised covariance, 16 df" and fit["level"] == "90%"
    m = r["multipliers"]["k3"]
    lo, hi = m["interval"]
    assert lo < k < hi and m["interval_detail"]["method"].startswith("delta method")
    assert 16 <= m["interval_detail"]["df"] <= 32
    write_outputs(r, tmp_path)
    text = (tmp_path / "scaling.md").read_text()
    assert "| architecture | runs | sizes | a | b (90% interval) | E (90% interval) | rss(log L) | interval |" in text
    assert "90% t on the fit's linearised covariance, 16 df |" in text and "90% delta method" in text


def test_no_multiplier_without_overlapping_losses(tmp_path):
    """Arms whose loss ranges do not meet get no multiplier (it would be an extrapolation); the report says so."""
    c = np.geomspace(1e15, 1e17, 4)
    runs = [
        {"label": "k3", "compute": ci, "loss": 2.0 - 0.1 * i, "run_dir": f"a{i}", "tokens": 1} for i, ci in enumerate(c)
    ]
    runs += [
        {"label": "baseline", "compute": ci, "loss": 4.0 - 0.1 * i, "run_dir": f"b{i}", "tokens": 1}
        for i, ci in enumerate(c)
    ]
    r = analyse(runs, n_boot=20)
    m = r["multipliers"]["k3"]
    assert not m["overlap"] and m["multiplier"] is None and m["interval"] == [None, None]
    write_outputs(r, tmp_path)
    assert "none: the losses do not overlap" in (tmp_path / "scaling.md").read_text()


def test_k2_like_baseline_and_the_gpu5_sweep():
    """The baseline is K2-like (RoPE MLA everywhere, SwiGLU, plain MoE, plain residual, sign bias); gpu5 has 5 sizes,
    3 seeds at its two smallest, code + prose data."""
    from k3.audit.sweeps import BASELINE

    base = get_preset("small")
    v = make_variant(BASELINE, base)
    cfg = variant_config(base, v)
    assert not cfg.kda_layers and cfg.mla.rope_theta is not None and cfg.hidden_act == "silu"
    assert cfg.moe.latent_size is None and cfg.attn_res.mode == "none" and v.balance == "sign"
    g = get_sweep("gpu5")
    assert len(g.sizes) >= 5 and len(g.seeds + g.extra_seeds) >= 3 and g.extra_seed_sizes >= 1
    assert g.tokens_per_param and g.data.startswith("stdlib+pydoc-topics+packages:")


def test_sweep_definitions():
    for name, sweep in SWEEPS.items():
        design = sweep.lrs or sweep.ratios  # a design sweep compares choices at >= 2 sizes; a scaling one fits >= 4
        assert len(sweep.sizes) >= (2 if design else 4) and len(sweep.archs) >= 2 and "baseline" in sweep.archs
        check_sweep(sweep)
        assert not sweep.lrs or sweep.train["lr"] in sweep.lrs  # the shared rate is one of those tried
        for width, layers in sweep.sizes:
            base = get_preset(sweep.preset).replace(**size_overrides(width, layers, sweep.head_dim))
            for variant in sweep.archs.values():
                variant_config(base, make_variant(variant, base))
    small = get_preset("small")
    sized = get_preset("small").replace(**size_overrides(256, 9, 64))
    assert params_of(sized)["params_activated"] == pytest.approx(params_of(small)["params_activated"], rel=0.05)


def test_micro_sweep_end_to_end(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i, doc in enumerate(stdlib_corpus("all")[:60]):
        (data / f"doc{i:03d}.py").write_text(doc.text)
    out = tmp_path / "sweep"
    assert (
        main(
            [
                "scaling",
                "--sweep",
                "micro",
                "--out",
                str(out),
                "--data",
                str(data),
                "--device",
                "cpu",
                "--bootstrap",
                "50",
            ]
        )
        == 0
    )
    for name in ("scaling.md", "scaling.json", "scaling.png"):
        assert (out / name).is_file()
    result = json.loads((out / "scaling.json").read_text())
    sweep = get_sweep("micro")
    assert set(result["fits"]) == set(sweep.archs)
    assert all(f["sizes"] == len(sweep.sizes) for f in result["fits"].values())
    assert "k3" in result["multipliers"] and "Compute multiplier" in (out / "scaling.md").read_text()
    computes = sorted(r["compute"] for r in result["runs"] if r["label"] == "k3")
    assert computes == sorted(set(computes))  # one compute per size

    # fitting existing runs: C recomputed from train_config.json when no summary.json says it
    run = out / "runs" / "k3-w32-l2-s0"
    copy = tmp_path / "bare" / run.name
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    (copy / "summary.json").unlink()
    with_summary, bare = load_run(run), load_run(copy)
    assert bare["compute"] == pytest.approx(with_summary["compute"], rel=1e-9)
    assert bare["label"] == "k3"  # from overrides.name
    assert load_run(run, group_by="variant")["label"] == "full"
    assert (
        main(
            [
                "scaling",
                "--runs",
                str(out / "runs"),
                "--out",
                str(tmp_path / "fit"),
                "--group-by",
                "seed",
                "--bootstrap",
                "20",
            ]
        )
        == 0
    )  # one group: a fit, no multiplier
    assert list(json.loads((tmp_path / "fit" / "scaling.json").read_text())["fits"]) == ["0"]


def test_a_sweep_that_would_repeat_its_data_is_refused(tmp_path):
    """Before any training: a run needing more tokens than the training data holds is named in one error."""
    data = tmp_path / "data"
    data.mkdir()
    for i, doc in enumerate(stdlib_corpus("all")[:20]):
        (data / f"doc{i:03d}.py").write_text(doc.text)
    sweep = get_sweep("micro")
    sweep.train = {**sweep.train, "steps": 100_000}
    with pytest.raises(ValueError, match="repeat their training data.*w48 l2"):
        run_sweep(sweep, tmp_path / "out", data=str(data), device="cpu")
    assert not (tmp_path / "out" / "runs").exists()


def test_groups_too_small_are_reported_not_fitted():
    runs = [{"label": "k3", "compute": c, "loss": 5 * c**-0.05, "run_dir": "x", "tokens": 1} for c in (1e15, 1e16)]
    runs.append({"label": "baseline", "compute": 1e15, "loss": 3.0, "run_dir": "y", "tokens": 1})
    r = analyse(runs, n_boot=10)
    assert "baseline" in r["skipped"] and "k3" in r["fits"] and r["multipliers"] == {}


@pytest.mark.parametrize("sizes, how", [(7, "bootstrap"), (5, "t")])
def test_interval_band_brackets_the_fit(sizes, how):
    """The figure's 90% band of the fitted loss (a bootstrap with 21 runs, t on the fit's covariance with 15): a
    grid reaching past the runs, lo <= hi everywhere, and the fit of all runs inside the band where the runs are."""
    from k3.audit.scaling import fit_interval, fit_power_law

    rng = np.random.default_rng(3)
    c = np.repeat(np.geomspace(1e15, 1e17, sizes), 3)
    loss = 2.0 + 30.0 * c**-0.08 * np.exp(rng.normal(0, 0.01, c.size))
    fit = fit_power_law(c, loss)
    iv = fit_interval(c, loss, fit, irreducible=False, n_boot=200, seed=0)
    assert (how == "bootstrap") == iv["method"].startswith("percentile bootstrap")
    grid, lo, hi = (np.array(iv["band"][k]) for k in ("compute", "lo", "hi"))
    assert grid[0] < c.min() and grid[-1] > c.max() and np.all(lo <= hi)
    inside = (grid >= c.min()) & (grid <= c.max())
    line = fit.loss(grid)
    assert np.all((lo[inside] <= line[inside] + 1e-9) & (line[inside] <= hi[inside] + 1e-9))


def test_proportional_sweep_reads_what_each_run_needs_from_pinned_packages(tmp_path):
    """A sweep with tokens per parameter tokenises only the rows each run trains on (max_tokens), and a packages
    corpus is recorded with the installed versions pinned."""
    import dataclasses
    import importlib.metadata as metadata

    micro = get_sweep("micro")
    sweep = dataclasses.replace(
        micro, sizes=micro.sizes[:2], tokens_per_param=1e-9, min_steps=2, train={**micro.train, "max_tokens": None}
    )
    summaries = run_sweep(sweep, tmp_path, data="pydoc-topics+packages:tqdm", device="cpu")
    assert len(summaries) == 4
    pinned = f"pydoc-topics+packages:tqdm=={metadata.version('tqdm').split('+')[0]}"
    assert json.loads((tmp_path / "sweep.json").read_text())["data"] == pinned
    for run in (tmp_path / "runs").iterdir():
        cfg = json.loads((run / "train_config.json").read_text())
        assert cfg["data"] == pinned and cfg["steps"] == 2
        assert cfg["max_tokens"] == 2 * cfg["batch_size"] * cfg["seq_len"] + cfg["seq_len"] + 1
