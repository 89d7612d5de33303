"""A run too long to load (more than `records.ANALYSIS_ROWS` records): its step table and totals, exact, from
requests.parquet `records.CHUNK_ROWS` records at a time, through the functions the whole-frame analysis calls
(`steps.step_sums`, `steps.RunCounts`, `steps.observation_stats`): counts, errors, censoring, tokens, window
rates, SLO attainment, latency percentiles with their intervals. What needs the records themselves comes from a
seeded uniform sample (`records.SAMPLE_ROWS`, `FROM_SAMPLE`), and the summary says so (`run.sampled`). Memory:
a chunk, and one metric's latencies of every step (11 bytes a record) while its percentiles are taken.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pandas as pd
import pyarrow as pa

from tokenload.analysis.records import Run, Sample, chunks, normalised
from tokenload.analysis.steps import (
    METRICS,
    Observations,
    RunCounts,
    StepOptions,
    finish_steps,
    measured_rows,
    observation_stats,
    observations,
    shape_steps,
    step_sums,
    warmed_up,
)
from tokenload.analysis.windows import windows_of
from tokenload.contracts.summary import Sampled
from tokenload.slo import Slo

# What the summary takes from the sample of a run too long to load (everything else in it is exact).
FROM_SAMPLE: tuple[str, ...] = (
    "steps[]: formula_mape, ttft_slope_s_per_token, input_tokens_p50, output_tokens_p50, itl_p50_s, itl_p99_s, "
    "connect_p50_s, connect_p95_s, send_lag_p99_s", "fits", "formula", "e2e_drivers", "latency (whole run)",
    "diagnosis (its medians)", "caching", "fidelity", "outage", "search", "the charts",
    "thresholds[] on percentiles (judged on the sample's records, its wider interval)", "models",
    "model_size_law", "model_ratios", "prefill_law", "attribution", "levers",
)
CONFIDENCE = 0.99


@dataclass(frozen=True)
class Exact:
    """A long run's step table and totals, counted over every record."""

    table: pd.DataFrame
    counts: RunCounts


def rank_error(n: int, confidence: float = CONFIDENCE) -> float:
    """How far in rank (a share) any percentile of a uniform sample of n records may lie from the run's, at
    `confidence` for all percentiles at once (Dvoretzky-Kiefer-Wolfowitz: sqrt(ln(2 / (1 - c)) / 2n))."""
    return math.sqrt(math.log(2 / (1 - confidence)) / (2 * n)) if n else 1.0


def sampled(sample: Sample) -> Sampled:
    """summary.json's `run.sampled`: how the run was read, and what comes from its sample, with the bound."""
    error = rank_error(sample.kept)
    return {"records": sample.rows, "sample": sample.kept, "seed": sample.seed, "from_sample": list(FROM_SAMPLE),
            "rank_error": round(error, 6), "confidence": CONFIDENCE,
            "note": (f"{sample.rows:,} records: too many to hold, so each step's counts, rates, SLO attainment and "
                     f"latency percentiles were counted over every record, a chunk at a time; fits, the formula "
                     f"test, medians, caching, outages and the charts come from a uniform sample of {sample.kept:,} "
                     f"(any percentile of it within {100 * error:.2f} points of the run's, {CONFIDENCE:.0%} sure)")}


def _chunks(run: Run, sample: Sample) -> Iterator[tuple[pd.DataFrame, pd.DataFrame]]:
    for raw in chunks(sample.parquet, sample.columns):
        measured, aside = normalised(raw, run.cut, sample.last_sent)
        if sample.model is not None:  # as `pipeline.analyze` does: that model's measured records, every one set apart
            measured = measured[measured["model"].astype(str) == sample.model].reset_index(drop=True)
        yield measured, aside


def _joined(parts: list[Observations]) -> Observations:
    """One step's observations from its chunks', in their order; each field's parts let go once joined (a long
    step is held about once, not twice)."""
    fields: dict[str, np.ndarray] = {}
    for name in ("times", "events", "step_down", "inexact"):
        fields[name] = np.concatenate([getattr(p, name) for p in parts])
        parts = [dataclasses.replace(p, **{name: fields[name][:0]}) for p in parts]
    return Observations(**fields)


def step_table(run: Run, slo: Slo, options: StepOptions) -> Exact:
    """The step table and totals of a sampled run (`Run.sample`), over all of its records."""
    sample = run.sample
    assert sample is not None
    cut = run.cut
    seen: list[pd.DataFrame] = []
    for df, _ in _chunks(run, sample):
        grouped = df.groupby("step", sort=True)
        seen.append(pd.DataFrame({"first_start": grouped["started_at"].min(),
                                  "users_seen": grouped["active_users"].max()}))
    firsts = pd.concat(seen).groupby(level=0).agg({"first_start": "min", "users_seen": "max"})
    table = warmed_up(windows_of(firsts, run.manifest, cut), options)
    sums: pd.DataFrame | None = None
    counts = RunCounts()
    for df, aside in _chunks(run, sample):
        part = step_sums(df, table, slo, cut, options, aside)
        sums = part if sums is None else sums.add(part, fill_value=0)
        counts = counts.add(RunCounts.of(df, slo, cut))
    assert sums is not None
    stats: dict[int, dict[str, Any]] = {int(step): {"bounds": [], "ci": {}} for step in table.index}
    for metric in METRICS:  # one metric's latencies at a time: 11 bytes a record
        parts: dict[int, list[Observations]] = {}
        for df, _ in _chunks(run, sample):
            for step, rows in measured_rows(df, table).groupby("step", sort=True):
                parts.setdefault(cast(int, step), []).append(observations(rows, metric, cut))
        for step in sorted(parts):
            got = observation_stats({metric: _joined(parts.pop(step))}, options.percentiles, seed=step)
            stats[step] = {**stats[step], **{k: v for k, v in got.items() if k not in ("bounds", "ci")},
                           "bounds": stats[step]["bounds"] + got["bounds"], "ci": {**stats[step]["ci"], **got["ci"]}}
    stats = {step: v for step, v in stats.items() if len(v) > 2}
    exact = finish_steps(table, sums, stats, firsts["users_seen"], options)
    pa.default_memory_pool().release_unused()  # the chunks' decoded batches
    return Exact(shape_steps(exact, measured_rows(run.df, exact)), counts)
