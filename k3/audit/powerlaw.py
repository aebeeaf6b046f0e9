"""Power laws L(C) for the scaling audit (:mod:`k3.audit.scaling`): the fit, the compute multiplier between two
fits, and their intervals.

Fit, per architecture, of the final validation loss L of runs of >= 2 sizes against their training compute C:

    L(C) = a * C^-b                (least squares on log L = log a - b log C)
    L(C) = E + a * C^-b            (``irreducible``: E on a grid in [0, min L), then Levenberg-Marquardt on
                                    sum (log L - log(E + a C^-b))^2 over (log a, b, E))

C is normalised by its geometric mean inside the fits (so a stays well conditioned) and reported in FLOPs.
Compute multiplier of A over a baseline B at loss L: m(L) = C_B(L) / C_A(L) (> 1: A reaches L with less compute).

Intervals (90%). With >= 20 runs in every architecture involved (k3.audit.stats.MIN_BOOTSTRAP_UNITS):
percentiles 5 / 95 of a seeded bootstrap that resamples runs with replacement within each architecture and
refits. With fewer, a bootstrap over so few units is too narrow to call 90%, so the intervals are Wald intervals
from the fit's linearised covariance, s^2 (J^T J)^-1 over (log a, b[, E]) with s^2 = rss / (n - p), and a t
quantile on n - p df: b (and E) +/- t se, the band exp(log L(C) -/+ t se), and for the multiplier the delta
method on log m(L) = log C_B(L) - log C_A(L), the two fits independent, on Welch-Satterthwaite df. An E fitted
at its bound 0 is held fixed there (p = 2). Each result says which ran (``method``) and its ``level``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from k3.audit.stats import MIN_BOOTSTRAP_UNITS, level_label, t_bounds


# ---------------------------------------------------------------------------------------------------- fits
@dataclass
class PowerLawFit:
    """L(C) = e + a_n * (C / c0)^-b; ``a`` = a_n * c0^b is the coefficient for C in FLOPs."""

    a_n: float
    b: float
    c0: float
    e: float = 0.0
    irreducible: bool = False
    n: int = 0
    rss: float = 0.0  # residual sum of squares of log L

    @property
    def a(self) -> float:
        return self.a_n * self.c0**self.b

    def loss(self, c) -> np.ndarray:
        return self.e + self.a_n * (np.asarray(c, dtype=float) / self.c0) ** -self.b

    def compute(self, loss) -> np.ndarray:
        """The compute at which the fit reaches ``loss`` (nan where it never does)."""
        loss = np.asarray(loss, dtype=float)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = (loss - self.e) / self.a_n
            out = self.c0 * ratio ** (-1.0 / self.b)
        return np.where((ratio > 0) & (self.b != 0), out, np.nan)

    def to_dict(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "e": self.e,
            "c0": self.c0,
            "a_normalised": self.a_n,
            "irreducible": self.irreducible,
            "n": self.n,
            "rss_log": self.rss,
        }


def _check_points(c, loss, need: int) -> tuple[np.ndarray, np.ndarray]:
    c, loss = np.asarray(c, dtype=float).ravel(), np.asarray(loss, dtype=float).ravel()
    if c.shape != loss.shape:
        raise ValueError(f"compute and loss must have the same length, got {c.size} and {loss.size}")
    if not (np.isfinite(c).all() and np.isfinite(loss).all() and (c > 0).all() and (loss > 0).all()):
        raise ValueError("compute and loss must be positive finite numbers")
    if np.unique(c).size < need:
        raise ValueError(f"a power-law fit needs >= {need} distinct compute values, got {np.unique(c).size}")
    return c, loss


def _line_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares y = alpha - b x for each row of y [G, n] (x [n]); returns alpha [G], b [G]."""
    xm = x.mean()
    dx = x - xm
    slope = (y - y.mean(axis=-1, keepdims=True)) @ dx / (dx @ dx)
    return y.mean(axis=-1) - slope * xm, -slope


def fit_power_law(c, loss, irreducible: bool = False, grid: int = 96, iters: int = 60) -> PowerLawFit:
    """Fit L = a C^-b (or E + a C^-b) in log space; see the module docstring."""
    c, loss = _check_points(c, loss, 3 if irreducible else 2)
    c0 = float(np.exp(np.log(c).mean()))
    x, y = np.log(c / c0), np.log(loss)
    if not irreducible:
        alpha, b = _line_fit(x, y[None])
        alpha, b = float(alpha[0]), float(b[0])
        rss = float(((y - (alpha - b * x)) ** 2).sum())
        return PowerLawFit(math.exp(alpha), b, c0, 0.0, False, c.size, rss)
    lmin = float(loss.min())
    e_grid = lmin * (1.0 - np.geomspace(1.0, 1e-4, grid))  # dense towards min L, where the optimum often is
    alpha, b = _line_fit(x, np.log(loss[None] - e_grid[:, None]))
    pred = np.log(e_grid[:, None] + np.exp(alpha[:, None] - b[:, None] * x[None]))
    rss = ((y[None] - pred) ** 2).sum(axis=1)
    j = int(np.nanargmin(rss))
    theta = np.array([alpha[j], b[j], e_grid[j]])
    best = float(rss[j])
    lam = 1e-3
    e_max = lmin * (1 - 1e-9)
    for _ in range(iters):  # Levenberg-Marquardt on (log a, b, E)
        p = np.exp(theta[0] - theta[1] * x)
        s = theta[2] + p
        r = y - np.log(s)
        jac = np.stack([p / s, -x * p / s, 1.0 / s], axis=1)
        h = jac.T @ jac
        g = jac.T @ r
        improved = False
        for _ in range(10):
            step = np.linalg.solve(h + lam * np.diag(np.diag(h) + 1e-12), g)
            cand = theta + step
            cand[2] = min(max(cand[2], 0.0), e_max)
            pc = np.exp(cand[0] - cand[1] * x)
            rc = float(((y - np.log(cand[2] + pc)) ** 2).sum())
            if np.isfinite(rc) and rc < best:
                theta, best, lam, improved = cand, rc, lam * 0.3, True
                break
            lam *= 10
        if not improved or best < 1e-30:
            break
    return PowerLawFit(math.exp(theta[0]), float(theta[1]), c0, float(theta[2]), True, c.size, best)


def compute_multiplier(candidate: PowerLawFit, baseline: PowerLawFit, loss) -> np.ndarray:
    """C_baseline(L) / C_candidate(L): how many times less compute the candidate needs to reach L."""
    return baseline.compute(loss) / candidate.compute(loss)


def loss_overlap(loss_a, loss_b) -> tuple[float, float, bool]:
    """(low, high, overlapping): the loss range both families reach; without overlap, the gap between them."""
    lo = max(float(np.min(loss_a)), float(np.min(loss_b)))
    hi = min(float(np.max(loss_a)), float(np.max(loss_b)))
    return (lo, hi, True) if lo <= hi else (hi, lo, False)


def _enough(units: int, min_units: int) -> None:
    if units < min_units:
        raise ValueError(f"percentile bootstrap needs >= {min_units} runs per architecture, got {units}")


def bootstrap_multiplier(
    c_a,
    loss_a,
    c_b,
    loss_b,
    at_loss: float,
    irreducible: bool = False,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.90,
    min_units: int = MIN_BOOTSTRAP_UNITS,
    band_losses=None,
) -> dict:
    """Seeded bootstrap of m(at_loss) = C_b / C_a, resampling runs within each family; percentile interval, and
    with ``band_losses`` the pointwise percentile band of m over those losses (``band``: {loss, lo, hi}, what
    the figure draws along the curve). ValueError with fewer than ``min_units`` runs in a family
    (:func:`delta_multiplier` is the interval there)."""
    c_a, loss_a = np.asarray(c_a, float), np.asarray(loss_a, float)
    c_b, loss_b = np.asarray(c_b, float), np.asarray(loss_b, float)
    _enough(min(c_a.size, c_b.size), min_units)
    need = 3 if irreducible else 2
    rng = np.random.default_rng(seed)
    losses = None if band_losses is None else np.asarray(band_losses, float)
    values, fits_a, fits_b, curves, failed = [], [], [], [], 0
    for _ in range(n_boot):
        ia = rng.integers(0, c_a.size, c_a.size)
        ib = rng.integers(0, c_b.size, c_b.size)
        if np.unique(c_a[ia]).size < need or np.unique(c_b[ib]).size < need:
            failed += 1
            continue
        fa = fit_power_law(c_a[ia], loss_a[ia], irreducible)
        fb = fit_power_law(c_b[ib], loss_b[ib], irreducible)
        m = float(compute_multiplier(fa, fb, at_loss))
        if not np.isfinite(m):
            failed += 1
            continue
        values.append(m)
        if losses is not None:
            curves.append(compute_multiplier(fa, fb, losses))
        fits_a.append((fa.a, fa.b))
        fits_b.append((fb.a, fb.b))
    q = (100 * (1 - level) / 2, 100 * (1 + level) / 2)
    out = {"n_boot": n_boot, "n_valid": len(values), "n_failed": failed, "seed": seed, "level": level_label(level)}
    out["method"] = f"percentile bootstrap over runs, {n_boot} resamples (seed {seed})"
    if values:
        lo, hi = np.percentile(values, q)
        out.update(low=float(lo), high=float(hi), median=float(np.median(values)))
        for name, fits in (("candidate_b", fits_a), ("baseline_b", fits_b)):
            lo, hi = np.percentile([f[1] for f in fits], q)
            out[name] = [float(lo), float(hi)]
        if losses is not None:
            lo, hi = np.nanpercentile(np.array(curves, float), q, axis=0)
            out["band"] = {"loss": losses.tolist(), "lo": lo.tolist(), "hi": hi.tolist()}
    return out


def bootstrap_fit(
    c,
    loss,
    irreducible: bool = False,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.90,
    min_units: int = MIN_BOOTSTRAP_UNITS,
) -> dict:
    """Percentile intervals of b (and E) from a seeded bootstrap over runs, and the band of the fitted loss:
    ``band`` = {compute, lo, hi} on a grid from C_min / 1.5 to C_max * 1.5 (what the figure draws). ValueError
    with fewer than ``min_units`` runs (:func:`delta_fit` is the interval there)."""
    c, loss = np.asarray(c, float), np.asarray(loss, float)
    _enough(c.size, min_units)
    need = 3 if irreducible else 2
    rng = np.random.default_rng(seed)
    grid = np.geomspace(c.min() / 1.5, c.max() * 1.5, 40)
    bs, es, curves = [], [], []
    for _ in range(n_boot):
        i = rng.integers(0, c.size, c.size)
        if np.unique(c[i]).size < need:
            continue
        f = fit_power_law(c[i], loss[i], irreducible)
        bs.append(f.b)
        es.append(f.e)
        curves.append(f.loss(grid))
    q = (100 * (1 - level) / 2, 100 * (1 + level) / 2)
    method = f"percentile bootstrap over runs, {n_boot} resamples (seed {seed})"
    if not bs:
        return {"n_valid": 0, "method": method, "level": level_label(level)}
    lo, hi = np.percentile(np.array(curves), q, axis=0)
    out = {
        "n_valid": len(bs),
        "method": method,
        "level": level_label(level),
        "b": [float(v) for v in np.percentile(bs, q)],
        "band": {"compute": grid.tolist(), "lo": lo.tolist(), "hi": hi.tolist()},
    }
    if irreducible:
        out["e"] = [float(v) for v in np.percentile(es, q)]
    return out


def _free_e(fit: PowerLawFit) -> bool:
    """E is a free parameter of the covariance: an irreducible fit whose E is not at its bound 0 (there the
    fit is a pure power law on the boundary, and E is held fixed)."""
    return fit.irreducible and fit.e > 0


def _log_loss_grad(fit: PowerLawFit, c: np.ndarray) -> np.ndarray:
    """d log L(c) / d (log a_n, b[, E]) at each c: [len(c), p]."""
    x = np.log(np.asarray(c, float) / fit.c0)
    p = fit.a_n * np.exp(-fit.b * x)
    s = fit.e + p
    return np.stack([p / s, -x * p / s] + ([1.0 / s] if _free_e(fit) else []), axis=1)


def fit_covariance(c, loss, fit: PowerLawFit) -> tuple[np.ndarray | None, int]:
    """(linearised covariance of (log a_n, b[, E]), residual df n - p) of ``fit`` to the points (c, loss):
    s^2 (J^T J)^-1 with J the Jacobian of log L at the fit and s^2 = rss / (n - p); None where n <= p or J^T J
    is singular."""
    jac = _log_loss_grad(fit, c)
    df = jac.shape[0] - jac.shape[1]
    if df < 1:
        return None, df
    try:
        cov = fit.rss / df * np.linalg.inv(jac.T @ jac)
    except np.linalg.LinAlgError:
        return None, df
    return (cov if np.isfinite(cov).all() else None), df


def delta_fit(c, loss, fit: PowerLawFit, level: float = 0.90) -> dict:
    """t-intervals (n - p df) of b (and E) from :func:`fit_covariance`, and the band of the fitted loss on the grid
    of :func:`bootstrap_fit`: exp(log L(C) -/+ t se), se by the delta method."""
    c = np.asarray(c, float)
    cov, df = fit_covariance(c, loss, fit)
    fixed = " (E at its bound 0, held fixed)" if fit.irreducible and not _free_e(fit) else ""
    out = {"df": df, "level": level_label(level), "method": f"t on the fit's linearised covariance, {df} df{fixed}"}
    if cov is None:
        return out | {"method": f"no interval: {df} residual df or a singular fit"}
    out["b"] = list(t_bounds(fit.b, math.sqrt(cov[1, 1]), df, level))
    if _free_e(fit):
        out["e"] = list(t_bounds(fit.e, math.sqrt(cov[2, 2]), df, level))
    grid = np.geomspace(c.min() / 1.5, c.max() * 1.5, 40)
    g = _log_loss_grad(fit, grid)
    se = np.sqrt(np.einsum("ij,jk,ik->i", g, cov, g))
    lo, hi = t_bounds(np.log(fit.loss(grid)), se, df, level)
    out["band"] = {"compute": grid.tolist(), "lo": np.exp(lo).tolist(), "hi": np.exp(hi).tolist()}
    return out


def delta_multiplier(fit_a: PowerLawFit, data_a, fit_b: PowerLawFit, data_b, at_loss: float, level=0.90) -> dict:
    """t-interval of m(at_loss) = C_b / C_a by the delta method on log m (``data_*``: (compute, loss) of each fit's
    runs; the fits independent), on the Welch-Satterthwaite df of the two variances."""
    out = {"level": level_label(level)}
    parts = []
    for fit, (c, loss) in ((fit_a, data_a), (fit_b, data_b)):
        cov, df = fit_covariance(c, loss, fit)
        if cov is None or at_loss <= fit.e:
            return out | {"method": "no interval: a fit without residual df or below its E"}
        u = math.log(at_loss - fit.e) - math.log(fit.a_n)  # log C(L) = log c0 - u / b
        g = np.array([1.0 / fit.b, u / fit.b**2] + ([1.0 / (fit.b * (at_loss - fit.e))] if _free_e(fit) else []))
        parts.append((float(g @ cov @ g), df))
    var = sum(v for v, _ in parts)
    df = var**2 / sum(v**2 / d for v, d in parts) if var > 0 else min(d for _, d in parts)
    m = float(compute_multiplier(fit_a, fit_b, at_loss))
    lo, hi = t_bounds(math.log(m), math.sqrt(var), df, level)
    method = f"delta method on the fits' linearised covariance, t on {df:.1f} df (Welch-Satterthwaite)"
    return out | {"low": math.exp(lo), "high": math.exp(hi), "df": df, "method": method}


def delta_multiplier_band(fit_a: PowerLawFit, data_a, fit_b: PowerLawFit, data_b, losses, level=0.90) -> dict:
    """Pointwise :func:`delta_multiplier` intervals of m over ``losses``: {loss, lo, hi} (None where a point has
    no interval), the band the figure draws along the multiplier curve."""
    lo, hi = [], []
    for loss in np.asarray(losses, float):
        d = delta_multiplier(fit_a, data_a, fit_b, data_b, float(loss), level)
        lo.append(d.get("low"))
        hi.append(d.get("high"))
    return {"loss": [float(v) for v in np.asarray(losses, float)], "lo": lo, "hi": hi}


def fit_interval(c, loss, fit: PowerLawFit, irreducible: bool, n_boot: int, seed: int) -> dict:
    """The fit's 90% intervals: the bootstrap over runs with >= MIN_BOOTSTRAP_UNITS runs, else :func:`delta_fit`."""
    if len(c) >= MIN_BOOTSTRAP_UNITS:
        return bootstrap_fit(c, loss, irreducible, n_boot, seed)
    return delta_fit(c, loss, fit)
