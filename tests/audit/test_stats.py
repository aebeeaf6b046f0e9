"""k3.audit.stats: t quantiles and intervals against scipy, the factorial's pooled least-squares model against an
independent numpy fit, and the bootstrap only with enough units."""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from k3.audit.stats import (
    MIN_BOOTSTRAP_UNITS,
    bootstrap_ci,
    factorial_effects,
    paired_difference,
    t_cdf,
    t_interval,
    t_quantile,
)

scipy_stats = pytest.importorskip("scipy.stats")

FACTORS = ("a", "b", "c", "d")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "audit"


@pytest.mark.parametrize("df", [1, 2, 3, 4.5, 7, 30, 35, 200])
def test_t_quantile_and_cdf_match_scipy(df):
    for p in (0.5, 0.6, 0.9, 0.95, 0.975, 0.995, 0.9995, 0.025, 0.001):
        assert t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-10, abs=1e-12)
    for t in (-8.0, -2.0, -0.3, 0.0, 0.7, 2.5, 40.0):
        assert t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), rel=1e-10, abs=1e-14)
    with pytest.raises(ValueError):
        t_quantile(1.0, df)


def test_t_interval_matches_scipy_and_says_its_method():
    xs = [1.31, 1.02, 1.18, 0.95]
    ci = t_interval(xs, level=0.95)
    lo, hi = scipy_stats.t.interval(0.95, len(xs) - 1, loc=np.mean(xs), scale=scipy_stats.sem(xs))
    assert (ci["lo"], ci["hi"]) == (pytest.approx(lo, rel=1e-10), pytest.approx(hi, rel=1e-10))
    assert ci["df"] == 3 and ci["n"] == 4 and ci["method"] == "t-interval, 3 df" and ci["level"] == "95%"
    assert t_interval([3.0])["lo"] is None and t_interval([float("nan")])["n"] == 0


def test_paired_difference_is_a_t_interval_over_the_shared_seeds():
    """Three seeds whose differences are -0.051, -0.002, -0.009 (a percentile bootstrap gives about their
    min-max, [-0.051, -0.002]): the t-interval on 2 df is four times wider and contains 0."""
    a = {0: 3.252, 1: 3.219, 2: 3.228, 3: float("nan")}
    b = {0: 3.201, 1: 3.217, 2: 3.219, 3: 9.0, 4: 7.0}
    d = paired_difference(a, b)
    diffs = [-0.051, -0.002, -0.009]
    lo, hi = scipy_stats.t.interval(0.95, 2, loc=np.mean(diffs), scale=scipy_stats.sem(diffs))
    assert d["seeds"] == [0, 1, 2] and d["mean"] == pytest.approx(np.mean(diffs))
    assert (d["lo"], d["hi"]) == (pytest.approx(lo), pytest.approx(hi)) and d["lo"] < 0 < d["hi"]
    assert d["method"] == "paired t-interval over seeds, 2 df" and d["df"] == 2


def test_bootstrap_needs_enough_units_and_says_which_ran():
    rng = np.random.default_rng(0)
    few = list(rng.normal(1.0, 0.1, MIN_BOOTSTRAP_UNITS - 1))
    fell_back = bootstrap_ci(few)
    assert fell_back["method"].startswith("t-interval, 18 df") and "fewer than 20 units" in fell_back["method"]
    assert fell_back["lo"] == pytest.approx(t_interval(few)["lo"])
    with pytest.raises(ValueError, match=">= 20 units, got 19"):
        bootstrap_ci(few, fallback=False)
    many = bootstrap_ci(list(rng.normal(1.0, 0.1, 200)))
    assert many["method"] == "percentile bootstrap, 200 units, 10000 resamples" and many["level"] == "95%"
    assert many["lo"] < 1.0 < many["hi"] and many["lo"] < many["mean"] < many["hi"]


def _cells(y_of, seeds):
    return {
        frozenset(c): {s: y_of(frozenset(c), s) for s in seeds}
        for r in range(len(FACTORS) + 1)
        for c in itertools.combinations(FACTORS, r)
    }


def test_factorial_effects_recover_known_effects():
    """y(S) = 3 + the removed factors' effects + 0.2 when a and b are both removed + a per-seed offset: main(a) =
    0.1 + 0.2 / 2, main(b) = -0.05 + 0.1, main(c) = 0.3, main(d) = 0, a x b = 0.2 / 2, the rest 0; the seed blocks
    absorb the offsets, so the residual is 0 and the intervals have zero width."""
    effect = {"a": 0.1, "b": -0.05, "c": 0.3, "d": 0.0}
    offsets = {0: 0.0, 1: 0.07, 2: -0.02}
    cells = _cells(
        lambda s, seed: 3 + sum(effect[f] for f in s) + (0.2 if {"a", "b"} <= s else 0) + offsets[seed], offsets
    )
    fx = factorial_effects(cells, FACTORS)
    want = {"a": 0.2, "b": 0.05, "c": 0.3, "d": 0.0, "a x b": 0.1}
    assert len(fx) == 4 + 6
    for name, e in fx.items():
        assert e["mean"] == pytest.approx(want.get(name, 0.0), abs=1e-9), name
        assert e["hi"] - e["lo"] == pytest.approx(0.0, abs=1e-6) and e["df"] == 48 - 1 - 10 - 2 and e["n"] == 48
    del cells[frozenset({"a", "c"})]
    with pytest.raises(ValueError, match="cells missing"):
        factorial_effects(cells, FACTORS)


def test_factorial_effects_match_an_independent_least_squares_fit():
    """Noisy data: each effect is 2 x the lstsq coefficient of its +/-1 column (intercept, 4 mains, 6 products, 2
    seed dummies), its SE 2 x sqrt(s^2 (X'X)^-1), its interval the scipy t quantile on 48 - 13 df."""
    rng = np.random.default_rng(7)
    seeds = (0, 1, 2)
    cells = _cells(lambda s, seed: 3 + 0.3 * ("a" in s) - 0.04 * ("c" in s) + rng.normal(0, 0.02), seeds)
    fx = factorial_effects(cells, FACTORS)
    rows = [(c, s, v) for c, by in cells.items() for s, v in by.items()]
    terms = [(f,) for f in FACTORS] + list(itertools.combinations(FACTORS, 2))
    x = np.array(
        [
            [1.0] + [math.prod(1.0 if f in c else -1.0 for f in t) for t in terms] + [float(s == 1), float(s == 2)]
            for c, s, _ in rows
        ]
    )
    y = np.array([v for _, _, v in rows])
    coef, rss, *_ = np.linalg.lstsq(x, y, rcond=None)
    df = len(y) - x.shape[1]
    cov = rss[0] / df * np.linalg.inv(x.T @ x)
    q = scipy_stats.t.ppf(0.975, df)
    for i, t in enumerate(terms, start=1):
        e = fx[" x ".join(t)]
        se = 2 * math.sqrt(cov[i, i])
        assert e["mean"] == pytest.approx(2 * coef[i], abs=1e-12) and e["se"] == pytest.approx(se, rel=1e-9)
        assert (e["lo"], e["hi"]) == (pytest.approx(2 * coef[i] - q * se), pytest.approx(2 * coef[i] + q * se))
        assert e["df"] == 35 and e["level"] == "95%" and "pooled residual SD" in e["method"]
    assert fx["a"]["lo"] > 0.25 and fx["b"]["lo"] < 0 < fx["b"]["hi"]


def test_committed_factorial_report_states_method_level_and_df():
    """The factorial grid's statistics, recomputed from its committed results, are the committed report's
    sections, whose interval tables state their method, level and df; the balancer's main effect is the pooled
    model's."""
    from k3.audit.ablate_report import _evidence_lines, ci_evidence
    from k3.audit.grids import FACTORS as GRID_FACTORS

    results = json.loads((DOCS / "factorial" / "results.json").read_text())
    ev = ci_evidence(results["runs"], results["lr_sweep"], GRID_FACTORS)
    lines = _evidence_lines(ev)
    committed = (DOCS / "factorial" / "report.md").read_text()
    assert "\n".join(lines) in committed
    assert "## Differences to `full` (95% paired t-intervals over seeds)" in lines
    assert "| variant | Δ val loss | 95% interval (paired t) | n | df |" in lines
    assert "| effect | estimate | SE | 95% interval (t, 35 df) |" in lines
    assert "| bias_sign | -0.001 | 0.0037 | [-0.008, +0.007] |" in lines
    assert ev["difference_vs_full"]["bias_sign"]["method"] == "paired t-interval over seeds, 2 df"
    assert ev["factorial"]["no_kda x no_attnres"]["hi"] < 0


def test_a_report_rerenders_from_its_results_alone(tmp_path, capsys):
    """``k3 ablate --from-results`` rewrites a committed report from results.json and grid.json (no run
    directories): the same report.md; without the files, one clear error."""
    from k3.cli.main import main

    for name in ("results.json", "grid.json"):
        (tmp_path / name).write_text((DOCS / "balance896_cpu" / name).read_text())
    assert main(["ablate", "--out", str(tmp_path), "--from-results"]) == 0
    assert (tmp_path / "report.md").read_text() == (DOCS / "balance896_cpu" / "report.md").read_text()
    assert not (tmp_path / "loss_curves.png").exists()  # needs the runs' metrics: not drawn empty
    assert main(["ablate", "--out", str(tmp_path / "none"), "--from-results"]) == 2
    assert "no results.json to re-render from" in capsys.readouterr().err
