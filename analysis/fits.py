"""Least-squares fits: latency against token counts.

Two models for TTFT vs input tokens, because prefill is claimed to grow
sub-linearly and the tool must test that rather than assume it: a straight
line, and `a + b * n**k` fitted by variable projection (for a fixed k the
model is linear in a and b, so only k needs a 1-D search; no scipy needed).
The power model wins only when it is clearly better (AIC) *and* clearly not a
line (|k - 1| large enough to matter), so noise never reads as a finding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from tokenload.contracts.summary import LinearFitSummary, TtftFit

# Two-sided 95% normal quantile; fits here have hundreds of points or more.
Z95 = 1.959963984540054
MIN_FIT_POINTS = 10
# The power model must beat the line by this much AIC (log-likelihood units x2)...
AIC_MARGIN = 10.0
# ...and bend by at least this much, or the data are called linear.
MIN_EXPONENT_GAP = 0.05
EXPONENT_RANGE = (0.05, 3.0)
# A length that varies less than this (p95 - p5, relative to the median) cannot support a slope:
# a "fixed" 256-token prompt the server counts as 256-280 would fit noise.
MIN_RELATIVE_SPREAD = 0.5
# The shortest prompts, which check the fitted intercept: lengths up to this factor of the minimum...
SHORTEST_FACTOR = 1.5
# ...or, if fewer than this many have such lengths, this many of the shortest.
SHORTEST_MIN = 5
# More requests in flight than this on average: a TTFT that does not grow with input is most likely queueing.
QUEUE_CONCURRENCY = 1.5


def spread_note(x: np.ndarray, what: str, sweep: str) -> str | None:
    """Why `x` cannot carry a fit (too few points, or barely varying), or None when it can."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < MIN_FIT_POINTS:
        return f"too few successful requests ({len(x)}, need {MIN_FIT_POINTS}) to fit"
    p5, p50, p95 = np.percentile(x, [5, 50, 95])
    if p95 - p5 < MIN_RELATIVE_SPREAD * max(p50, 1.0):
        return (f"{what} barely varies ({p5:.0f}-{p95:.0f} tokens, 5th-95th percentile): no fit, a slope would "
                f"describe noise; sweep {what} (the packaged {sweep} scenario does)")
    return None


def intercept_check(x: np.ndarray, y: np.ndarray, intercept: float,
                    predict: Callable[[float], float]) -> str | None:
    """Does the shortest-input data contradict the fitted intercept? A sentence saying how, or None.

    The intercept claims what an empty prompt costs; the shortest prompts measured
    bound it from above (their median TTFT) and physics from below (zero).
    """
    short = x <= SHORTEST_FACTOR * float(x.min())
    if short.sum() < SHORTEST_MIN:
        short = np.zeros(len(x), dtype=bool)
        short[np.argsort(x)[:SHORTEST_MIN]] = True
    observed = float(np.median(y[short]))
    at = float(np.median(x[short]))
    if intercept < 0 and predict(at) < 0.5 * observed:
        return (f"the intercept {intercept:.3g} s is impossible (a negative time) and the line undershoots the "
                f"shortest prompts (median TTFT {observed:.3g} s at about {at:.0f} tokens): do not read the "
                "intercept as the cost of an empty prompt")
    if intercept > observed:
        return (f"the intercept {intercept:.3g} s exceeds the median TTFT of the shortest prompts ({observed:.3g} s "
                f"at about {at:.0f} tokens): the fit does not describe short prompts (concurrent requests or "
                "queueing may have inflated it); fit at 1 user")
    return None


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope * x, with 95% confidence intervals."""

    slope: float
    intercept: float
    r2: float
    n: int
    slope_ci: tuple[float, float]
    intercept_ci: tuple[float, float]
    sse: float


@dataclass(frozen=True)
class PowerFit:
    """y = a + b * x**k."""

    a: float
    b: float
    k: float
    r2: float
    n: int
    sse: float

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.a + self.b * np.power(x, self.k)


def linear_fit(x: np.ndarray, y: np.ndarray) -> LinearFit | None:
    """Ordinary least squares; None when x does not vary or there are too few points."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(x)
    if n < MIN_FIT_POINTS:
        return None
    xm, ym = x.mean(), y.mean()
    dx = x - xm
    sxx = float(dx @ dx)
    if sxx <= 1e-12 * max(1.0, xm * xm) * n:
        return None
    slope = float(dx @ (y - ym)) / sxx
    intercept = float(ym - slope * xm)
    resid = y - (intercept + slope * x)
    sse = float(resid @ resid)
    dy = y - ym
    sst = float(dy @ dy)
    sigma2 = sse / max(n - 2, 1)
    se_slope = math.sqrt(sigma2 / sxx)
    se_intercept = math.sqrt(sigma2 * (1.0 / n + xm * xm / sxx))
    return LinearFit(
        slope=slope,
        intercept=intercept,
        r2=1.0 - sse / sst if sst > 0 else 1.0,
        n=n,
        slope_ci=(slope - Z95 * se_slope, slope + Z95 * se_slope),
        intercept_ci=(intercept - Z95 * se_intercept, intercept + Z95 * se_intercept),
        sse=sse,
    )


def _power_sse(logx: np.ndarray, y: np.ndarray, k: float) -> tuple[float, float, float]:
    """Best (a, b) and SSE for a fixed exponent k: one linear least squares."""
    z = np.exp(k * logx)
    zm, ym = z.mean(), y.mean()
    dz = z - zm
    szz = float(dz @ dz)
    b = float(dz @ (y - ym)) / szz if szz > 0 else 0.0
    a = float(ym - b * zm)
    resid = y - a - b * z
    return a, b, float(resid @ resid)


def power_fit(x: np.ndarray, y: np.ndarray) -> PowerFit | None:
    """Fit y = a + b * x**k: coarse grid over k, then golden-section refinement."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    keep = x > 0
    x, y = x[keep], y[keep]
    if len(x) < MIN_FIT_POINTS or np.ptp(x) <= 0:
        return None
    logx = np.log(x)
    k = best_exponent(lambda e: _power_sse(logx, y, e)[2])
    a, b, sse = _power_sse(logx, y, k)
    dy = y - y.mean()
    sst = float(dy @ dy)
    return PowerFit(a=a, b=b, k=k, r2=1.0 - sse / sst if sst > 0 else 1.0, n=len(x), sse=sse)


def shared_power_fit(x: np.ndarray, y: np.ndarray, groups: np.ndarray,
                     near: float | None = None) -> tuple[float, dict[int, tuple[float, float]]]:
    """y = a_g + b_g * x**k with one exponent k for every group (a model's own scale and intercept, one law):
    (k, {group: (a, b)}). Callers pass x > 0 and at least MIN_FIT_POINTS rows; `near`: search only within 0.3 of
    it (a resample of a fitted run)."""
    logx = np.log(np.asarray(x, dtype=np.float64))
    y = np.asarray(y, dtype=np.float64)
    parts = [(int(g), groups == g) for g in np.unique(groups)]

    def sse(k: float) -> float:
        return sum(_power_sse(logx[rows], y[rows], k)[2] for _, rows in parts)

    k = best_exponent(sse) if near is None else best_exponent(
        sse, (max(EXPONENT_RANGE[0], near - 0.3), min(EXPONENT_RANGE[1], near + 0.3)), 7)
    return k, {g: _power_sse(logx[rows], y[rows], k)[:2] for g, rows in parts}


def best_exponent(sse: Callable[[float], float], span: tuple[float, float] = EXPONENT_RANGE, points: int = 60) -> float:
    """The exponent in `span` that minimises `sse`: a grid of `points`, then golden-section refinement."""
    grid = np.linspace(*span, points)
    sses = [sse(k) for k in grid]
    i = int(np.argmin(sses))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fc, fd = sse(c), sse(d)
    while hi - lo > 1e-5:
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - ratio * (hi - lo)
            fc = sse(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + ratio * (hi - lo)
            fd = sse(d)
    return (lo + hi) / 2


def _aic(sse: float, n: int, params: int) -> float:
    return n * math.log(max(sse, 1e-300) / n) + 2 * params


def _r(value: float, digits: int = 6) -> float:
    """Round for JSON: summary.json is read by people as much as by scripts."""
    return float(f"{value:.{digits}g}")


def flat_note(fit: LinearFit, concurrency: float | None = None) -> str | None:
    """Why TTFT that does not grow with input length carries no prefill law (None when it grows).

    Prefill can only take longer for a longer prompt: a slope whose 95% interval
    reaches zero or below ("5.61 - 0.00174 n") describes what else set TTFT, most
    often the wait for other requests (queueing), not prefill.
    """
    if fit.slope_ci[0] > 0:
        return None
    why = (f"TTFT does not grow with input length here (slope {fit.slope:.3g} s/token, 95% interval "
           f"[{fit.slope_ci[0]:.3g}, {fit.slope_ci[1]:.3g}], R² {fit.r2:.2f}): something else sets it")
    if concurrency is not None and concurrency > QUEUE_CONCURRENCY:
        why += (f", most likely the wait for the other requests in flight ({concurrency:.0f} at once: queueing "
                "or batching)")
    return f"{why}; no fit: fit TTFT against input length at 1 user (the packaged prompt-sweep scenario does)"


def ttft_vs_input(n_tokens: np.ndarray, ttft: np.ndarray, concurrency: float | None = None) -> TtftFit:
    """The contract's `fits.ttft_vs_input`, plus both candidate models and the sub-linear verdict.

    For the power model `slope_s_per_token` is the local slope d(ttft)/dn at the
    median input length, so it stays comparable with the linear slope. TTFT that
    does not grow with input length gets no fit (`flat_note`; `concurrency`, the
    requests in flight at once, names queueing as the likely cause).
    """
    note = spread_note(n_tokens, "input length", "prompt-sweep")
    lin = linear_fit(n_tokens, ttft) if note is None else None
    if lin is not None and (flat := flat_note(lin, concurrency)) is not None:
        note, lin = flat, None
    pw = power_fit(n_tokens, ttft) if lin is not None else None
    if lin is None:
        return {"model": None, "slope_s_per_token": None, "intercept_s": None, "exponent": None,
                "r2": None, "n": int(len(n_tokens)),
                "note": note or "input length did not vary enough (or too few successful requests) to fit"}
    out: dict[str, Any] = {
        "model": "linear", "slope_s_per_token": _r(lin.slope), "intercept_s": _r(lin.intercept),
        "exponent": 1.0, "r2": _r(lin.r2, 4), "n": lin.n,
        "linear": linear_dict(lin),
        "power": None,
        "criterion": f"power if AIC improves by > {AIC_MARGIN:g} and |k - 1| >= {MIN_EXPONENT_GAP:g}",
    }
    if pw is not None:
        out["power"] = {"a_s": _r(pw.a), "b": _r(pw.b), "exponent": _r(pw.k, 4), "r2": _r(pw.r2, 4), "n": pw.n}
        better = _aic(pw.sse, pw.n, 3) + AIC_MARGIN < _aic(lin.sse, lin.n, 2)
        if better and abs(pw.k - 1.0) >= MIN_EXPONENT_GAP:
            median_n = float(np.median(n_tokens))
            out.update(model="power", intercept_s=_r(pw.a), exponent=_r(pw.k, 4), r2=_r(pw.r2, 4),
                       slope_s_per_token=_r(pw.b * pw.k * median_n ** (pw.k - 1.0)),
                       slope_at_input_tokens=median_n)
    model: Callable[[float], float] = (
        (lambda n: float(pw.predict(np.array([n]))[0])) if out["model"] == "power" and pw is not None
        else (lambda n: lin.intercept + lin.slope * n))
    out["intercept_check"] = intercept_check(np.asarray(n_tokens, dtype=np.float64), np.asarray(ttft, dtype=np.float64),
                                             out["intercept_s"], model)
    k = out["exponent"]
    if out["model"] == "power" and k < 1:
        out["sublinear"] = f"supported: TTFT grows as n^{k:.2f} (< 1) with input length"
    elif out["model"] == "power":
        out["sublinear"] = f"contradicted: TTFT grows as n^{k:.2f} (> 1), faster than linear"
    else:
        out["sublinear"] = "not supported: a straight line fits TTFT vs input length as well as a power law"
    return cast(TtftFit, out)


def linear_dict(fit: LinearFit | None) -> LinearFitSummary | None:
    """The contract's linear-fit keys plus confidence intervals."""
    if fit is None:
        return None
    return {
        "slope_s_per_token": _r(fit.slope), "intercept_s": _r(fit.intercept),
        "r2": _r(fit.r2, 4), "n": fit.n,
        "slope_ci95": [_r(v) for v in fit.slope_ci],
        "intercept_ci95": [_r(v) for v in fit.intercept_ci],
    }


def grouped_linear(keys: np.ndarray, x: np.ndarray, y: np.ndarray) -> dict[int, tuple[float, float]]:
    """Per-group (slope, intercept) in one pass of sums: per-step fits on million-row runs."""
    import pandas as pd

    frame = pd.DataFrame({"k": keys, "x": x, "y": y, "xx": x * x, "xy": x * y})
    sums = frame.groupby("k", sort=True).agg(n=("x", "size"), x=("x", "sum"), y=("y", "sum"),
                                             xx=("xx", "sum"), xy=("xy", "sum"))
    out: dict[int, tuple[float, float]] = {}
    for key, row in sums.iterrows():
        sxx = row.xx - row.x * row.x / row.n
        if row.n < MIN_FIT_POINTS or sxx <= 1e-12 * max(row.xx, 1.0):
            continue
        slope = (row.xy - row.x * row.y / row.n) / sxx
        out[int(key)] = (float(slope), float((row.y - slope * row.x) / row.n))
    return out


def varies(n_tokens: np.ndarray) -> bool:
    """Do these input lengths vary enough to move TTFT (the spread `spread_note` asks of a fit)?"""
    x = np.asarray(n_tokens, dtype=np.float64)
    x = x[np.isfinite(x)]
    if not len(x):
        return False
    p5, p50, p95 = np.percentile(x, [5, 50, 95])
    return bool(p95 - p5 >= MIN_RELATIVE_SPREAD * max(p50, 1.0))


def planned_ttft(steps: np.ndarray, n_tokens: np.ndarray, ttft: np.ndarray,
                 step_median: Mapping[Any, float]) -> tuple[np.ndarray, list[int]]:
    """The TTFT the formula test predicts for each request, and the steps it cannot judge.

    Where a step's input lengths are steady, its median TTFT is what a user
    plans with. Where they vary (a prompt sweep runs many lengths at one load
    level), one median would blame the formula for the prefill law: each request
    is predicted from its own input length on the step's TTFT-vs-input line
    instead. A step whose lengths vary but whose requests are too few to fit
    that line gets NaN and is listed: the formula cannot be judged there.
    """
    steps = np.asarray(steps)
    n = np.asarray(n_tokens, dtype=np.float64)
    y = np.asarray(ttft, dtype=np.float64)
    out = np.full(len(steps), np.nan)
    unjudged: list[int] = []
    for step in np.unique(steps):
        rows = steps == step
        known = rows & np.isfinite(n) & np.isfinite(y)
        if not varies(n[known]):
            out[rows] = step_median.get(int(step), np.nan)
            continue
        fit = linear_fit(n[known], y[known])
        if fit is None:
            unjudged.append(int(step))
        else:
            out[rows] = fit.intercept + fit.slope * n[rows]
    return out, unjudged
