"""Confidence intervals for ablation grids: paired bootstrap over seeds, and the effects of a 2^k factorial design.

A seed fixes the initialisation, the data order and the data subset for every variant of a grid, so runs with the
same seed are paired: the difference between two variants is taken seed by seed, and the seeds are resampled
with replacement (``n_boot`` times) to get a percentile interval for its mean. With n seeds the interval can only
be as wide as the n per-seed differences allow: with 3 seeds it is a rough interval, and the report says n.

Factorial effects (a 2^k design over factors f_1..f_k, each on or off): with y(S) the value of the variant that
removes the set S of factors, the main effect of f and the interaction of f and g are the contrasts

    main(f)      = mean over S containing f of y(S) - mean over S without f of y(S)
    inter(f, g)  = (mean y(S) with both or neither - mean y(S) with exactly one of f, g)

(the first is what removing f does on average over the other factors' settings; the second is how much removing
both differs from the sum of removing each, halved as in the usual +/-1 coding). Each is computed per seed and
bootstrapped over the seeds that every cell has.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def bootstrap_ci(values: list[float], n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict:
    """Mean of ``values`` with a percentile bootstrap interval: {mean, lo, hi, n}. One value gives lo = hi = None."""
    xs = np.asarray([v for v in values if _finite(v)], dtype=np.float64)
    if xs.size == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    mean = float(xs.mean())
    if xs.size == 1:
        return {"mean": mean, "lo": None, "hi": None, "n": 1}
    rng = np.random.default_rng(seed)
    means = xs[rng.integers(0, xs.size, size=(n_boot, xs.size))].mean(axis=1)
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return {"mean": mean, "lo": float(lo), "hi": float(hi), "n": int(xs.size)}


def paired_difference(a: dict, b: dict, **kw) -> dict:
    """b - a over the seeds both have (``a``, ``b``: seed -> value), with :func:`bootstrap_ci`'s interval."""
    seeds = sorted(s for s in a.keys() & b.keys() if _finite(a[s]) and _finite(b[s]))
    return bootstrap_ci([b[s] - a[s] for s in seeds], **kw) | {"seeds": seeds}


def factorial_effects(cells: dict[frozenset, dict], factors: tuple[str, ...], **kw) -> dict[str, dict]:
    """Main effects and two-factor interactions of a full 2^k design.

    ``cells``: the set of factors a variant removes -> {seed: value}; all 2^k sets must be there. Returns
    ``{"f": ci, "f x g": ci}`` (:func:`bootstrap_ci` of the per-seed contrasts, over the seeds every cell has)."""
    subsets = [frozenset(c) for r in range(len(factors) + 1) for c in itertools.combinations(factors, r)]
    missing = [sorted(s) for s in subsets if s not in cells]
    if missing:
        raise ValueError(f"factorial_effects: cells missing for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    seeds = sorted(set.intersection(*(set(s for s, v in cells[c].items() if _finite(v)) for c in subsets)))
    half = len(subsets) / 2

    def contrast(sign) -> list[float]:
        return [sum(sign(c) * cells[c][s] for c in subsets) / half for s in seeds]

    out = {f: contrast(lambda c, f=f: 1 if f in c else -1) for f in factors}
    for f, g in itertools.combinations(factors, 2):
        out[f"{f} x {g}"] = contrast(lambda c, f=f, g=g: 1 if (f in c) == (g in c) else -1)
    return {name: bootstrap_ci(v, **kw) | {"seeds": seeds} for name, v in out.items()}
