"""The audit's interval estimates, in one place: t-intervals over seeds, a pooled-variance model of a 2^k
factorial grid, and a percentile bootstrap only where there are enough units to resample.

Why not bootstrap everything. A percentile bootstrap of a mean over n units can never reach beyond the units' own
range, so with few units it is far too narrow: over 3 seeds its "95%" interval is about their min-max, which
covers the true mean about 75% of the time (50% with 2 seeds). So:

- a mean over few units (seeds): Student t with n - 1 degrees of freedom, mean +/- t * sd / sqrt(n)
  (:func:`t_interval`; :func:`paired_difference` for b - a taken seed by seed, since a seed fixes a grid's
  initialisation, data order and data subset for every variant);
- a full 2^k factorial grid: one least-squares model of every run, y = intercept + main effects + two-factor
  interactions (+/-1 coding) + a block per seed, whose residual variance is pooled over all the grid's runs
  (:func:`factorial_effects`): each effect then has a standard error on the residual degrees of freedom
  (for 16 cells x 3 seeds: 48 - 1 - 4 - 6 - 2 = 35), not on n - 1 = 2;
- the percentile bootstrap (:func:`bootstrap_ci`) only with >= :data:`MIN_BOOTSTRAP_UNITS` units; below that it
  falls back to the t-interval (or raises), and the result says which ran.

Every result carries ``method`` (what was computed, with its degrees of freedom) and ``level`` ("95%") for the
tables and figures to print. The t quantile is computed here (the regularised incomplete beta function by its
continued fraction, inverted by bisection) so the package needs no scipy.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

MIN_BOOTSTRAP_UNITS = 20  # below this a percentile bootstrap is too narrow to call by its level


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def level_label(level: float) -> str:
    """0.95 -> "95%" (what the tables print)."""
    return f"{100 * level:g}%"


# ---------------------------------------------------------------------------------------------------- Student t
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), converging for x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"t distribution: df={df} must be positive")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t quantile: p={p} must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def t_bounds(estimate: float, se: float, df: float, level: float = 0.95) -> tuple[float, float]:
    """estimate -/+ t_{(1 + level) / 2, df} * se."""
    half = t_quantile(0.5 + level / 2.0, df) * se
    return estimate - half, estimate + half


# ---------------------------------------------------------------------------------------------------- means
def t_interval(values: list[float], level: float = 0.95) -> dict:
    """Mean of the finite ``values`` with its t-interval on n - 1 df: {mean, lo, hi, se, sd, n, df, method, level}.
    One value has no interval (lo = hi = None)."""
    xs = np.asarray([v for v in values if _finite(v)], dtype=np.float64)
    out = {"mean": None, "lo": None, "hi": None, "se": None, "sd": None, "n": int(xs.size), "df": max(xs.size - 1, 0)}
    out |= {"method": f"t-interval, {out['df']} df", "level": level_label(level)}
    if xs.size == 0:
        return out
    out["mean"] = float(xs.mean())
    if xs.size == 1:
        out["method"] = "one value: no interval"
        return out
    sd = float(xs.std(ddof=1))
    se = sd / math.sqrt(xs.size)
    lo, hi = t_bounds(out["mean"], se, xs.size - 1, level)
    return out | {"lo": lo, "hi": hi, "se": se, "sd": sd}


def bootstrap_ci(
    values: list[float],
    n_boot: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
    min_units: int = MIN_BOOTSTRAP_UNITS,
    fallback: bool = True,
) -> dict:
    """Mean of ``values`` with a percentile bootstrap interval (``n_boot`` resamples of the units), when there are
    at least ``min_units`` finite units; with fewer, :func:`t_interval` (``fallback``) or ValueError. The result's
    ``method`` says which ran."""
    xs = [v for v in values if _finite(v)]
    if len(xs) < min_units:
        if not fallback:
            raise ValueError(f"percentile bootstrap needs >= {min_units} units, got {len(xs)}")
        ci = t_interval(xs, level)
        if len(xs) > 1:
            ci["method"] += f" (fewer than {min_units} units for a bootstrap)"
        return ci
    a = np.asarray(xs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = a[rng.integers(0, a.size, size=(n_boot, a.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {
        "mean": float(a.mean()),
        "lo": float(lo),
        "hi": float(hi),
        "n": int(a.size),
        "df": None,
        "method": f"percentile bootstrap, {a.size} units, {n_boot} resamples",
        "level": level_label(level),
    }


def paired_difference(a: dict, b: dict, level: float = 0.95) -> dict:
    """b - a over the seeds both have (``a``, ``b``: seed -> value), with its t-interval (n - 1 df)."""
    seeds = sorted(s for s in a.keys() & b.keys() if _finite(a[s]) and _finite(b[s]))
    ci = t_interval([b[s] - a[s] for s in seeds], level)
    if ci["lo"] is not None:
        ci["method"] = f"paired t-interval over seeds, {ci['df']} df"
    return ci | {"seeds": seeds}


# ---------------------------------------------------------------------------------------------------- 2^k grid
def ols(x: np.ndarray, y: np.ndarray) -> dict:
    """Least squares y ~ x: coefficients, their covariance (residual variance pooled over every row), the
    residual standard deviation and degrees of freedom (rows - rank of x)."""
    coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    df = int(y.size - rank)
    if rank < x.shape[1]:
        raise ValueError(f"design matrix has rank {rank} < {x.shape[1]} columns: effects not identifiable")
    if df < 1:
        raise ValueError(f"no residual degrees of freedom ({y.size} rows, {rank} parameters)")
    resid = y - x @ coef
    s2 = float(resid @ resid) / df
    return {"coef": coef, "cov": s2 * np.linalg.inv(x.T @ x), "sd": math.sqrt(s2), "df": df}


def factorial_effects(
    cells: dict[frozenset, dict], factors: tuple[str, ...], level: float = 0.95, block_seeds: bool = True
) -> dict[str, dict]:
    """Main effects and two-factor interactions of a full 2^k design, from one pooled-variance linear model.

    ``cells``: the set of factors a variant removes -> {seed: value}; all 2^k sets need a run. Every finite run is
    a row of y = b0 + sum_f b_f x_f + sum_{f<g} b_fg x_f x_g (+ a dummy per seed but the first, with
    ``block_seeds``: a seed's data order is shared by every cell), x_f = +1 where f is removed, -1 where not;
    three-way and higher interactions are left in the residual. An effect is reported on the scale of a
    difference of means, 2 b: main(f) = mean of the cells removing f - mean of those keeping it;
    inter(f, g) = mean of the cells with both or neither removed - mean of those with exactly one (half of
    "removing both" minus "the sum of removing each"). Returns ``{"f": e, "f x g": e}`` with e = {mean (the
    estimate), se, lo, hi, df (residual), residual_sd, n (runs), seeds, method, level}."""
    subsets = [frozenset(c) for r in range(len(factors) + 1) for c in itertools.combinations(factors, r)]
    missing = [sorted(s) for s in subsets if not any(_finite(v) for v in cells.get(s, {}).values())]
    if missing:
        raise ValueError(f"factorial_effects: cells missing for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    rows = [(c, s, v) for c in subsets for s, v in sorted(cells[c].items()) if _finite(v)]
    terms = [(f,) for f in factors] + list(itertools.combinations(factors, 2))
    cols = [np.ones(len(rows))]
    cols += [np.array([math.prod(1.0 if f in c else -1.0 for f in t) for c, _, _ in rows]) for t in terms]
    seeds = sorted({s for _, s, _ in rows})
    if block_seeds:
        cols += [np.array([1.0 if s == b else 0.0 for _, s, _ in rows]) for b in seeds[1:]]
    fit = ols(np.stack(cols, axis=1), np.array([v for _, _, v in rows]))
    method = (
        f"OLS over {len(rows)} runs (main effects + two-factor interactions"
        + (f" + {len(seeds)} seed blocks" if block_seeds and len(seeds) > 1 else "")
        + f"), pooled residual SD {fit['sd']:.4f}, t on {fit['df']} df"
    )
    out = {}
    for i, t in enumerate(terms, start=1):
        est, se = 2.0 * float(fit["coef"][i]), 2.0 * math.sqrt(float(fit["cov"][i, i]))
        lo, hi = t_bounds(est, se, fit["df"], level)
        out[" x ".join(t)] = {
            "mean": est,
            "se": se,
            "lo": lo,
            "hi": hi,
            "df": fit["df"],
            "residual_sd": fit["sd"],
            "n": len(rows),
            "seeds": seeds,
            "method": method,
            "level": level_label(level),
        }
    return out
