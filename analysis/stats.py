"""Percentiles that know what they could not see, and how sure they are.

A request still open when the run stopped has an unknown latency, but not an
unknown *nothing*: a request that waited t seconds for its first token has a
TTFT above t. Dropping it biases the high percentiles low exactly at the load
levels that matter, so percentiles here are Kaplan-Meier estimates with such
requests right-censored. When censoring reaches a percentile, the estimate is
only a lower bound, and the caller is told so (`bound=True`).

Confidence intervals come from a seeded percentile bootstrap, so the same
records always give the same intervals (and the same verdicts). Above
`BOOTSTRAP_MAX_N` uncensored observations the bootstrap's large-sample limit,
the distribution-free order-statistic interval, is used instead: the same
interval at a fraction of the cost on million-request runs; censored data above
`KM_BOOTSTRAP_MAX_N` get Kaplan-Meier's own large-sample interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenload.quantiles import KaplanMeier

# Bootstrap resamples per interval; enough for a stable 95% interval of a percentile.
BOOTSTRAP_RESAMPLES = 400
# Below this many observations no interval is given (it would be as wide as the data).
MIN_CI_SAMPLES = 5
# Cap on resample-matrix cells built at once (memory stays bounded on huge steps).
_CHUNK_CELLS = 4_000_000
# Above this many uncensored observations the order-statistic interval replaces the bootstrap;
# censored data above it get fewer resamples (Kaplan-Meier runs once per resample).
BOOTSTRAP_MAX_N = 5_000
# Above this many observations with censoring, the interval is Kaplan-Meier's large-sample one (`km_interval`):
# each resample's curve would take seconds (no step of a run up to `records.ANALYSIS_ROWS` reaches it).
KM_BOOTSTRAP_MAX_N = 1_000_000
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Quantile:
    """One percentile: its value, and whether censoring makes it only a lower bound."""

    value: float
    bound: bool = False


def _finite(times: np.ndarray, events: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The observations with a finite time (the arrays themselves when all are: no copy of a long step)."""
    t = np.asarray(times, dtype=np.float64)
    e = np.asarray(events, dtype=bool)
    keep = np.isfinite(t)
    return (t, e) if keep.all() else (t[keep], e[keep])


def km_quantiles(times: np.ndarray, events: np.ndarray, qs: Sequence[float]) -> list[Quantile]:
    """Quantiles (0..1) of `times` where `events` is False for right-censored observations.

    Without censoring this is numpy's linear-interpolated percentile, so uncensored
    steps read exactly as before. With censoring it is the Kaplan-Meier quantile: the
    first event time at which the estimated CDF reaches q; where it never does, the
    largest time seen is returned as a lower bound.
    """
    t, e = _finite(times, events)
    if t.size == 0 or not e.any():
        return [Quantile(float(t.max()) if t.size else np.nan, bound=bool(t.size)) for _ in qs]
    if e.all():
        return [Quantile(float(v)) for v in np.percentile(t, [100 * q for q in qs])]
    curve = KaplanMeier(t, e)
    out = []
    for q in qs:
        hit = curve.first(q - 1e-12)
        out.append(Quantile(hit) if hit is not None else Quantile(curve.largest, bound=True))
    return out


def km_interval(times: np.ndarray, events: np.ndarray, q: float) -> tuple[float, float] | None:
    """95% interval of the Kaplan-Meier q-quantile from one curve (Brookmeyer and Crowley's, with Greenwood's
    variance at the estimate): the times where the CDF reaches q -/+ z se. The bootstrap's large-sample limit,
    for steps too large to resample; past the last event the upper end is the largest time seen."""
    t, e = _finite(times, events)
    if int(e.sum()) < MIN_CI_SAMPLES:
        return None
    curve = KaplanMeier(t, e)
    found = curve.at(q - 1e-12)
    if found is None:
        return None
    survival, greenwood = found
    half = Z95 * survival * np.sqrt(greenwood)
    lo = curve.first(q - half) if q - half > 0 else float(curve.events[0])
    hi = curve.first(q + half)
    return float(lo if lo is not None else curve.largest), float(hi if hi is not None else curve.largest)


def bootstrap_ci(times: np.ndarray, events: np.ndarray, q: float, seed: int,
                 resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float] | None:
    """Percentile-bootstrap 95% interval of the q-quantile; None when too few observations.

    Uncensored data take a vectorised path (resample matrix, chunked); censored data
    re-run Kaplan-Meier per resample.
    """
    t, e = _finite(times, events)
    if int(e.sum()) < MIN_CI_SAMPLES:
        return None
    rng = np.random.default_rng(seed)
    n = t.size
    if e.all() and n > BOOTSTRAP_MAX_N:
        return order_statistic_ci(t, q)
    if n > KM_BOOTSTRAP_MAX_N:
        return km_interval(t, e, q)
    if n > BOOTSTRAP_MAX_N:
        resamples = min(resamples, 100)
    if e.all():
        rows = max(1, _CHUNK_CELLS // n)
        stats: list[np.ndarray] = []
        left = resamples
        while left > 0:
            take = min(rows, left)
            sample = t[rng.integers(0, n, (take, n))]
            stats.append(np.quantile(sample, q, axis=1))
            left -= take
        values = np.concatenate(stats)
    else:
        values = np.empty(resamples)
        for i in range(resamples):
            idx = rng.integers(0, n, n)
            values[i] = km_quantiles(t[idx], e[idx], [q])[0].value
    lo, hi = np.quantile(values, [0.025, 0.975])
    return float(lo), float(hi)


def order_statistic_ci(values: np.ndarray, q: float) -> tuple[float, float]:
    """Distribution-free 95% interval of the q-quantile: the order statistics at n q -/+ z sqrt(n q (1 - q))."""
    n = values.size
    half = Z95 * np.sqrt(n * q * (1.0 - q))
    lo = int(np.clip(np.floor(n * q - half), 0, n - 1))
    hi = int(np.clip(np.ceil(n * q + half), 0, n - 1))
    part = np.partition(values, (lo, hi))
    return float(part[lo]), float(part[hi])


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (NaN stays NaN): family-wise error control."""
    p = np.asarray(p_values, dtype=np.float64)
    valid = np.flatnonzero(np.isfinite(p))
    adjusted = np.full(p.shape, np.nan)
    if valid.size == 0:
        return adjusted.tolist()
    order = valid[np.argsort(p[valid], kind="mergesort")]
    m = valid.size
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()
