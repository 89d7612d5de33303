"""Raw server samples -> numbers per time window, in tokenload's vocabulary.

Gauges are averaged over the scrapes inside the window (several series of one
term, e.g. one per model, are added or averaged per scrape as `TERMS` says).
Counters and histograms are cumulative, so a window's share is the difference
between the last scrape at or before its start and the last scrape at or before
its end (a counter that went down was reset: its new value is the delta).
Histogram percentiles come from those bucket deltas, interpolated inside a
bucket the way Prometheus's `histogram_quantile` does: they are only as fine as
the server's buckets, and a percentile in the `+Inf` bucket is reported as the
largest finite bound (a lower bound).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from tokenload.servermetrics.vocabulary import TERMS, lookup


def load(path: Path) -> pd.DataFrame | None:
    """server_metrics.parquet as a frame (time, source, name, labels, value); None when the file is absent."""
    if not path.is_file():
        return None
    import pyarrow.parquet as pq

    df = pq.read_table(path).to_pandas()
    for column in ("source", "name"):
        df[column] = df[column].astype(str)
    return df


def mapped(raw: pd.DataFrame) -> pd.DataFrame:
    """The samples the vocabulary knows, with `term`, `part` ("value", "bucket", "count", "sum"), `series`
    (source and labels without `le`: one time series) and `le` (a bucket's upper bound, NaN otherwise)."""
    names = raw["name"].unique()
    known = {n: hit for n in names if (hit := lookup(n)) is not None}
    df = raw[raw["name"].isin(list(known))].copy()
    if df.empty:
        return df.assign(term=[], part=[], series=[], le=[])
    df["term"] = df["name"].map(lambda n: known[n][0])
    df["part"] = df["name"].map(lambda n: known[n][1])
    parsed = {text: json.loads(text) for text in df["labels"].unique()}
    le = {text: float(labels["le"]) if "le" in labels else math.nan for text, labels in parsed.items()}
    rest = {text: json.dumps({k: v for k, v in labels.items() if k != "le"}, sort_keys=True)
            for text, labels in parsed.items()}
    df["le"] = df["labels"].map(le)
    df["series"] = df["source"] + " " + df["labels"].map(rest)
    return df.sort_values("time", kind="stable").reset_index(drop=True)


def terms(df: pd.DataFrame) -> list[str]:
    """The vocabulary terms present, in `TERMS` order."""
    present = set(df["term"].unique()) if len(df) else set()
    return [t for t in TERMS if t in present]


def gauge_timeline(df: pd.DataFrame, term: str) -> pd.Series:
    """One value per scrape (per source: summed across sources only through `window_gauge`), indexed by time."""
    rows = df[df["term"] == term]
    how = TERMS[term].how
    per_scrape = rows.groupby(["source", "time"])["value"].agg(how)
    return per_scrape.groupby(level="time").agg(how).sort_index()


def window_gauge(df: pd.DataFrame, term: str, start: float, end: float) -> tuple[float, float, int] | None:
    """(mean, max, scrapes) of a gauge over [start, end); None without a scrape inside."""
    rows = df[(df["term"] == term) & (df["time"] >= start) & (df["time"] < end)]
    if rows.empty:
        return None
    how = TERMS[term].how
    per_scrape = rows.groupby(["source", "time"])["value"].agg(how)
    by_source = per_scrape.groupby(level="source")
    mean = by_source.mean().agg(how)
    peak = by_source.max().agg(how)
    return float(mean), float(peak), int(by_source.size().max())


def _deltas(rows: pd.DataFrame, start: float, end: float, keys: list[str]) -> pd.Series:
    """Per key: the increase between the last value at or before `start` and the last at or before `end`."""
    before = rows[rows["time"] <= start].groupby(keys)["value"].last()
    after = rows[rows["time"] <= end].groupby(keys)["value"].last()
    base = before.reindex(after.index).fillna(0.0)
    delta = after - base
    return delta.where(delta >= 0, after)  # went down: the counter was reset, it counted `after` since


def window_rate(df: pd.DataFrame, term: str, start: float, end: float) -> float | None:
    """A counter's increase per second over [start, end); None without scrapes on both sides."""
    rows = df[df["term"] == term]
    if rows.empty or not (rows["time"] <= start).any() or end <= start:
        return None
    return float(_deltas(rows, start, end, ["series"]).sum()) / (end - start)


def cumulative(df: pd.DataFrame, term: str, part: str = "value") -> pd.Series:
    """A counter's (or a histogram part's) running total at each scrape, added over its series (each series
    at its last value at or before the scrape): the finest view of when the server counted what."""
    rows = df[(df["term"] == term) & (df["part"] == part)]
    if rows.empty:
        return pd.Series(dtype=float)
    wide = rows.pivot_table(index="time", columns="series", values="value", aggfunc="last").sort_index()
    return wide.ffill().fillna(0.0).sum(axis=1)


class Quantile(NamedTuple):
    """A percentile from histogram buckets: the estimate, how many observations, and the bucket it lies in."""

    value: float
    n: int
    lower: float
    upper: float


def window_quantile(df: pd.DataFrame, term: str, start: float, end: float, q: float) -> Quantile | None:
    """The q-quantile of a histogram's observations made in [start, end); None when none were."""
    rows = df[(df["term"] == term) & (df["part"] == "bucket")]
    if rows.empty:
        return None
    per_bound = _deltas(rows, start, end, ["series", "le"]).groupby(level="le").sum().sort_index()
    if per_bound.empty:
        return None
    return quantile(per_bound.index.to_numpy(dtype=float), per_bound.to_numpy(dtype=float), q)


def quantile(bounds: np.ndarray, cumulative: np.ndarray, q: float) -> Quantile | None:
    """Prometheus's `histogram_quantile` on cumulative bucket counts with upper `bounds` (the last may be +Inf)."""
    total = float(cumulative[-1])
    if total <= 0:
        return None
    rank = q * total
    i = int(np.searchsorted(cumulative, rank, side="left"))
    i = min(i, len(bounds) - 1)
    lower = 0.0 if i == 0 else float(bounds[i - 1])
    if math.isinf(bounds[i]):
        return Quantile(lower if i else math.nan, int(total), lower, math.inf)
    below = 0.0 if i == 0 else float(cumulative[i - 1])
    inside = float(cumulative[i]) - below
    share = (rank - below) / inside if inside > 0 else 1.0
    return Quantile(lower + (float(bounds[i]) - lower) * share, int(total), lower, float(bounds[i]))
