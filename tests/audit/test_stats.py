"""k3.audit.stats: paired bootstrap intervals and 2^k factorial effects on constructed data with known answers."""

import itertools

import numpy as np
import pytest

from k3.audit.stats import bootstrap_ci, factorial_effects, paired_difference

FACTORS = ("a", "b", "c", "d")


def test_bootstrap_interval_covers_the_mean_and_narrows_with_n():
    rng = np.random.default_rng(0)
    few = bootstrap_ci(list(rng.normal(1.0, 0.1, 5)))
    many = bootstrap_ci(list(rng.normal(1.0, 0.1, 200)))
    for c in (few, many):
        assert c["lo"] < c["mean"] < c["hi"]
    assert many["hi"] - many["lo"] < few["hi"] - few["lo"]
    assert many["lo"] < 1.0 < many["hi"]
    assert bootstrap_ci([2.0, 2.0, 2.0]) == {"mean": 2.0, "lo": 2.0, "hi": 2.0, "n": 3}
    assert bootstrap_ci([3.0])["lo"] is None and bootstrap_ci([float("nan")])["n"] == 0


def test_paired_difference_uses_the_shared_seeds_only():
    a = {0: 1.0, 1: 2.0, 2: 3.0, 3: float("nan")}
    b = {0: 1.5, 1: 2.5, 2: 3.5, 3: 9.0, 4: 7.0}
    d = paired_difference(a, b)
    assert d["seeds"] == [0, 1, 2] and d["mean"] == pytest.approx(0.5) and d["lo"] == pytest.approx(0.5)


def test_factorial_effects_recover_main_effects_and_an_interaction():
    """y(S) = 3 + sum of the removed factors' effects + 0.2 when a and b are both removed + a per-seed offset
    shared by every cell: main(a) = 0.1 + 0.2 / 2, main(b) = -0.05 + 0.1, main(c) = 0.3, main(d) = 0,
    a x b = 0.2 / 2, every other interaction 0; the shared offsets cancel, so the intervals have zero width."""
    effect = {"a": 0.1, "b": -0.05, "c": 0.3, "d": 0.0}
    offsets = {0: 0.0, 1: 0.07, 2: -0.02}
    cells = {}
    for r in range(5):
        for c in itertools.combinations(FACTORS, r):
            s = frozenset(c)
            y = 3 + sum(effect[f] for f in s) + (0.2 if {"a", "b"} <= s else 0.0)
            cells[s] = {seed: y + off for seed, off in offsets.items()}
    fx = factorial_effects(cells, FACTORS)
    want = {"a": 0.2, "b": 0.05, "c": 0.3, "d": 0.0, "a x b": 0.1}
    for name, c in fx.items():
        assert c["mean"] == pytest.approx(want.get(name, 0.0), abs=1e-12), name
        assert c["hi"] - c["lo"] == pytest.approx(0.0, abs=1e-12) and c["n"] == 3
    assert len(fx) == 4 + 6
    del cells[frozenset({"a", "c"})]
    with pytest.raises(ValueError, match="cells missing"):
        factorial_effects(cells, FACTORS)
