"""From history rows to an answer: at which hours is this channel slow, and by how much?

Rows are folded into the hours of the local day (`tokenload.dayclock`, with the
same `--period` as watch and the simulator). For each hour of the day the
median TTFT (and TPOT) is compared with the median of all other hours by a
bootstrap of the ratio of medians: an hour is *high* when the whole 95%
interval lies above 1 and the ratio is at least 1 + MIN_EFFECT (so a tiny but
"significant" shift on a big history is no peak), *low* likewise below. Peak
and off-peak windows are the contiguous runs (around midnight too) of high and
low hours; when too few hours hold enough requests, the answer says so instead.

The two windows are then compared like `compare` compares runs (Mann-Whitney
test and effect size, from the analysis package), with the TTFT-vs-input and
formula fits per window, and turned into advice with numbers. Where `watch
--server-metrics` kept the server's gauges with each sample, their means per
hour and per window say whether the server itself was busier at peak.

Beside the latency, the capacity: searched stress runs (`watch --stress
search@03:00,14:00`) each found the highest load meeting the SLO; each is
placed in the hour of the day it ran, and every window lists the capacities
found in it with their boundary intervals ("capacity 24 users off-peak, 6 at
peak").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tokenload.analysis.stats import BOOTSTRAP_MAX_N, BOOTSTRAP_RESAMPLES, bootstrap_ci
from tokenload.dayclock import DAY_S, utc_offset_s
from tokenload.errors import LOAD_KINDS
from tokenload.history.store import Capacity

HOURS = 24
MIN_PER_HOUR = 5  # requests an hour needs before it can be called peak or off-peak
MIN_HOURS = 12  # hours with enough requests before any window is named
MIN_EFFECT = 0.20  # a window must differ from the rest by at least 20% in the median: smaller shifts are no peak
METRICS: tuple[tuple[str, str], ...] = (("ttft", "ttft_s"), ("tpot", "tpot_s"))


def fold(frame: pd.DataFrame, period_s: float = DAY_S) -> pd.DataFrame:
    """`frame` plus `hour` (0-23 of the folded local day), `weekday` (0 = Monday) and `day` (day number)."""
    t = frame["started_at"].astype(float).to_numpy()
    offsets = np.array([utc_offset_s(x) for x in t]) if len(t) else np.zeros(0)
    local = t + offsets
    out = frame.copy()
    out["hour_f"] = local % period_s / period_s * HOURS
    out["hour"] = np.floor(out["hour_f"]).astype(int) % HOURS
    out["day"] = np.floor(local / period_s).astype(int)
    out["weekday"] = (out["day"] + 3) % 7  # 1970-01-01 was a Thursday
    out["ok"] = out["status"] == "ok"
    out["load_error"] = out["error_kind"].isin(sorted(LOAD_KINDS))
    out["load_level"] = out["active_users"].fillna(1).clip(lower=1).astype(int)
    return out


def _boot_medians(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if len(values) > BOOTSTRAP_MAX_N:  # subsampled: the interval only widens
        values = rng.choice(values, BOOTSTRAP_MAX_N, replace=False)
    return np.median(rng.choice(values, (BOOTSTRAP_RESAMPLES, len(values)), replace=True), axis=1)


def ratio_ci(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """median(a) / median(b) with a 95% bootstrap interval."""
    ratios = _boot_medians(a, rng) / _boot_medians(b, rng)
    return float(np.median(a) / np.median(b)), float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def hour_table(folded: pd.DataFrame, column: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Per hour of the day: requests, errors, median of `column`, its ratio to the other hours, level."""
    ok = folded[folded["ok"] & folded[column].notna()]
    rows = []
    for hour in range(HOURS):
        here = folded[folded["hour"] == hour]
        values = ok.loc[ok["hour"] == hour, column].to_numpy(dtype=float)
        rest = ok.loc[ok["hour"] != hour, column].to_numpy(dtype=float)
        row: dict[str, Any] = {"hour": hour, "requests": len(here), "ok": len(values),
                               "errors": int((~here["ok"]).sum()), "load_errors": int(here["load_error"].sum()),
                               "p50_s": float(np.median(values)) if len(values) else None,
                               "ratio": None, "ci95": None, "level": None}
        if len(values) >= MIN_PER_HOUR and len(rest) >= MIN_PER_HOUR:
            ratio, lo, hi = ratio_ci(values, rest, rng)
            level = "same"
            if lo > 1 and ratio >= 1 + MIN_EFFECT:
                level = "high"
            elif hi < 1 and ratio <= 1 - MIN_EFFECT:
                level = "low"
            row.update(ratio=ratio, ci95=[lo, hi], level=level)
        rows.append(row)
    return rows


def runs(levels: Sequence[str | None], wanted: str) -> list[list[int]]:
    """Maximal runs of consecutive hours at level `wanted`, joined across midnight."""
    found: list[list[int]] = []
    current: list[int] = []
    for hour, level in enumerate(levels):
        if level == wanted:
            current.append(hour)
        elif current:
            found.append(current)
            current = []
    if current:
        found.append(current)
    if len(found) > 1 and found[0][0] == 0 and found[-1][-1] == len(levels) - 1:
        found[0] = found.pop() + found[0]
    return found


def bridged(table: Sequence[dict[str, Any]], wanted: str) -> list[str | None]:
    """Levels, with a lone hour between two `wanted` hours counted as `wanted` unless it argues against.

    An hour with too few requests, or one that leans the same way without
    reaching significance, should not split a window in two: only an hour whose
    median is clearly unlike its neighbours' does.
    """
    levels = [r["level"] for r in table]
    out = list(levels)
    for hour, row in enumerate(table):
        before, after = levels[hour - 1], levels[(hour + 1) % HOURS]
        leans = row["ratio"] is not None and (row["ratio"] >= 1 + MIN_EFFECT if wanted == "high"
                                              else row["ratio"] <= 1 - MIN_EFFECT)
        if before == wanted and after == wanted and (row["level"] is None or leans):
            out[hour] = wanted
    return out


def hours_label(hours: Sequence[int]) -> str:
    """[13, 14, 15, 16] -> '13:00-17:00'."""
    return f"{hours[0]:02d}:00-{(hours[-1] + 1) % HOURS:02d}:00"


@dataclass(frozen=True)
class Window:
    kind: str  # peak | off-peak
    hours: list[int]

    @property
    def label(self) -> str:
        return hours_label(self.hours)


def find_windows(table: Sequence[dict[str, Any]]) -> tuple[Window | None, Window | None, str | None]:
    """The peak and off-peak windows of one metric's hour table, or why there are none."""
    enough = sum(1 for r in table if r["ok"] >= MIN_PER_HOUR)
    if enough < MIN_HOURS:
        return None, None, (f"too few data to tell: only {enough} of 24 hours have {MIN_PER_HOUR}+ successful "
                            f"requests (need {MIN_HOURS}); keep watching")
    def strongest(wanted: str, sign: float) -> Window | None:
        candidates = runs(bridged(table, wanted), wanted)
        if not candidates:
            return None
        best = max(candidates, key=lambda hs: sign * sum(math.log(table[h]["ratio"] or 1.0) for h in hs))
        return Window("peak" if wanted == "high" else "off-peak", best)

    peak, off = strongest("high", 1.0), strongest("low", -1.0)
    note = None
    if peak is None and off is None:
        note = f"no hour differs from the rest by {MIN_EFFECT:.0%} or more with 95% confidence: the channel looks flat"
    return peak, off, note


def _window_rows(folded: pd.DataFrame, window: Window | None) -> pd.DataFrame:
    return folded.iloc[0:0] if window is None else folded[folded["hour"].isin(window.hours)]


def window_stats(rows: pd.DataFrame, rng: np.random.Generator) -> dict[str, Any]:
    """Medians with bootstrap intervals, error rate, formula error and TTFT-vs-input fit of a window's rows."""
    from tokenload.analysis.fits import ttft_vs_input
    from tokenload.measure import formula

    ok = rows[rows["ok"]]
    out: dict[str, Any] = {"requests": len(rows), "ok": len(ok),
                           "load_error_rate": float(rows["load_error"].mean()) if len(rows) else None}
    for name, column in (*METRICS, ("e2e", "e2e_s")):
        values = ok[column].dropna().to_numpy(dtype=float)
        out[f"{name}_p50_s"] = float(np.median(values)) if len(values) else None
        out[f"{name}_p90_s"] = float(np.percentile(values, 90)) if len(values) else None
        ci = bootstrap_ci(values, np.ones(len(values), dtype=bool), 0.5, seed=int(rng.integers(2**31)))
        out[f"{name}_p50_ci95"] = list(ci) if ci else None
    found = (formula(r.ttft_s, r.tpot_s, int(r.output_tokens), r.e2e_s)
             for r in ok.itertuples() if pd.notna(r.tpot_s) and pd.notna(r.ttft_s) and pd.notna(r.e2e_s))
    checks = [c for c in found if c is not None]
    out["formula_mape_simple"] = float(np.mean([abs(c["error_simple_pct"]) for c in checks])) if checks else None
    out["formula_mape_exact"] = float(np.mean([abs(c["error_exact_pct"]) for c in checks])) if checks else None
    fit_rows = ok.dropna(subset=["ttft_s", "input_tokens"])
    out["ttft_vs_input"] = ttft_vs_input(fit_rows["input_tokens"].to_numpy(dtype=float),
                                         fit_rows["ttft_s"].to_numpy(dtype=float))
    return out


def compare_windows(off: pd.DataFrame, peak: pd.DataFrame) -> dict[str, Any]:
    """Peak against off-peak per metric at one load level: medians, ratio and `compare`'s Mann-Whitney test."""
    from tokenload.analysis.compare import mann_whitney

    out: dict[str, Any] = {}
    for name, column in (*METRICS, ("e2e", "e2e_s")):
        a = off.loc[off["ok"], column].dropna().to_numpy(dtype=float)
        b = peak.loc[peak["ok"], column].dropna().to_numpy(dtype=float)
        if len(a) < MIN_PER_HOUR or len(b) < MIN_PER_HOUR:
            out[name] = None
            continue
        test = mann_whitney(a, b)
        out[name] = {"off_peak_p50_s": float(np.median(a)), "peak_p50_s": float(np.median(b)),
                     "ratio": float(np.median(b) / np.median(a)), "p_value": test["p_value"],
                     "effect": test["effect"], "n_off_peak": len(a), "n_peak": len(b)}
    return out


def matched_comparison(folded: pd.DataFrame, off: Window, peak: Window) -> dict[int, Any]:
    """`compare_windows` at each load level (concurrent users) both windows saw, probes (1 user) first.

    Matching by load level keeps a stress run at 16 users from passing for a
    slow hour: only like is compared with like.
    """
    off_rows, peak_rows = _window_rows(folded, off), _window_rows(folded, peak)
    levels = sorted(set(off_rows["load_level"]) & set(peak_rows["load_level"]))
    return {int(level): compare_windows(off_rows[off_rows["load_level"] == level],
                                        peak_rows[peak_rows["load_level"] == level]) for level in levels}


def advice(result: dict[str, Any]) -> list[str]:
    """What to do about it, with the numbers."""
    ttft = result["metrics"]["ttft"]
    peak, off = ttft["peak"], ttft["off_peak"]
    lines: list[str] = []
    if ttft.get("note"):
        lines.append(ttft["note"])
    cmp = (result.get("comparison") or {}).get("ttft")
    if peak and off and cmp:
        lines.append(f"at {off['label']} TTFT p50 is {cmp['off_peak_p50_s']:.2g} s vs {cmp['peak_p50_s']:.2g} s "
                     f"at {peak['label']} ({cmp['ratio']:.1f}x): schedule batch and bulk work then, and run stress "
                     f"tests at {peak['label']} to see the worst case")
    elif peak:
        lines.append(f"TTFT is highest at {peak['label']} (p50 {peak['stats']['ttft_p50_s']:.2g} s, "
                     f"{peak['ratio']:.1f}x the other hours): avoid it for latency-sensitive work")
    elif off:
        lines.append(f"TTFT is lowest at {off['label']} (p50 {off['stats']['ttft_p50_s']:.2g} s, "
                     f"{off['ratio']:.2f}x the other hours): the best time for batch work")
    tpot = (result.get("comparison") or {}).get("tpot")
    if tpot and tpot["ratio"] >= 1 + MIN_EFFECT:
        lines.append(f"TPOT also rises at peak: {tpot['off_peak_p50_s'] * 1000:.2g} ms vs "
                     f"{tpot['peak_p50_s'] * 1000:.2g} ms per token ({tpot['ratio']:.1f}x): long outputs suffer most")
    worst = max(result["hours"]["ttft"], key=lambda r: r["load_errors"] / r["requests"] if r["requests"] else 0)
    if worst["requests"] and worst["load_errors"]:
        lines.append(f"errors under load peak at {worst['hour']:02d}:00 ({worst['load_errors']} of "
                     f"{worst['requests']} requests: rate limits or overload); retry with backoff at that hour")
    return lines


def heatmap(folded: pd.DataFrame, column: str) -> list[list[float | None]]:
    """7 weekdays x 24 hours: median of `column` over successful requests (error rate for `load_error`)."""
    rows = folded if column == "load_error" else folded[folded["ok"]]
    cells = rows.groupby(["weekday", "hour"])[column].agg("mean" if column == "load_error" else "median")
    return [[None if pd.isna(v := cells.get((day, hour), np.nan)) else float(v) for hour in range(HOURS)]
            for day in range(7)]


def daily_series(folded: pd.DataFrame, period_s: float) -> list[dict[str, Any]]:
    """Per (folded) day: requests, error rate, and the 10th / 50th / 90th percentiles of TTFT and TPOT."""
    import time

    out = []
    for key, rows in folded.groupby("day"):
        day = int(str(key))
        ok = rows[rows["ok"]]
        start = day * period_s - utc_offset_s(day * period_s)
        entry: dict[str, Any] = {
            "day": day, "requests": len(rows), "load_error_rate": float(rows["load_error"].mean()),
            "label": time.strftime("%Y-%m-%d", time.localtime(start + 1)) if period_s == DAY_S
            else time.strftime("%H:%M:%S", time.localtime(start)),
        }
        for name, column in METRICS:
            values = ok[column].dropna().to_numpy(dtype=float)
            for q in (10, 50, 90):
                entry[f"{name}_p{q}_s"] = float(np.percentile(values, q)) if len(values) else None
        out.append(entry)
    return out


SERVER_TERMS = ("running", "waiting", "kv_cache_usage")  # the gauges `watch --server-metrics` keeps per sample


def server_view(folded: pd.DataFrame, peak: Window | None, off: Window | None) -> dict[str, Any] | None:
    """The server's gauges beside the samples (`watch --server-metrics`): their means overall, per hour of the
    day and in the TTFT peak and off-peak windows, one value per sample; None when no sample has any."""
    columns = {term: f"server_{term}" for term in SERVER_TERMS if f"server_{term}" in folded}
    samples = folded.drop_duplicates("sample_id").dropna(subset=list(columns.values()), how="all") if columns else None
    if samples is None or samples.empty:
        return None

    def means(rows: pd.DataFrame) -> dict[str, Any]:
        return {"samples": len(rows), **{f"{term}_mean": float(rows[c].mean()) if rows[c].notna().any() else None
                                         for term, c in columns.items()}}

    return {"overall": means(samples),
            "hours": [{"hour": int(hour), **means(rows)} for hour, rows in samples.groupby("hour")],
            "peak": means(_window_rows(samples, peak)) if peak else None,
            "off_peak": means(_window_rows(samples, off)) if off else None}


def hour_of_day(t: float, period_s: float = DAY_S) -> float:
    """The hour (0-24, fractional) of the folded local day at unix time `t`, as `fold` computes it."""
    return (t + utc_offset_s(t)) % period_s / period_s * HOURS


def capacity_by_window(capacities: Sequence[Capacity], windows: dict[str, Window | None],
                       period_s: float = DAY_S) -> dict[str, Any]:
    """Each searched run's capacity at its hour of the day, and per window the ones that ran in it.

    `windows`: "peak" / "off_peak" -> the TTFT window (or None). A window's `capacity` is the median of
    its runs' capacities (None when none passed); `runs` keeps each run's boundary interval.
    """
    runs: list[dict[str, Any]] = [{"hour": int(hour_of_day(c.started_at, period_s)) % HOURS, "started_at": c.started_at,
             "unit": "users" if c.over == "users" else "req/s", "capacity": c.capacity,
             "interval": [c.capacity, c.upper], "below": c.capacity is None and c.upper is not None,
             "range": [c.min_level, c.max_level]} for c in capacities]
    out: dict[str, Any] = {"runs": runs}
    for key, window in windows.items():
        inside = [r for r in runs if window is not None and r["hour"] in window.hours]
        found = [float(r["capacity"]) for r in inside if r["capacity"] is not None]
        out[key] = None if window is None or not inside else {
            "label": window.label, "runs": inside, "capacity": float(np.median(found)) if found else None}
    return out


def analyze_history(frame: pd.DataFrame, period_s: float = DAY_S, seed: int = 0,
                    capacities: Sequence[Capacity] = ()) -> dict[str, Any]:
    """Hour tables, windows, window statistics, comparison, the server's gauges, capacities and advice for one
    channel's rows."""
    rng = np.random.default_rng(seed)
    everything = fold(frame, period_s)
    # The hours are told apart at the probes' load (1 user): stress runs would pass for busy hours.
    folded = everything[everything["load_level"] == 1]
    result: dict[str, Any] = {
        "requests": len(everything), "probe_requests": len(folded), "ok": int(everything["ok"].sum()),
        "period_s": period_s, "samples": int(everything["sample_id"].nunique()),
        "first_at": float(everything["started_at"].min()) if len(everything) else None,
        "last_at": float(everything["started_at"].max()) if len(everything) else None,
        "hours": {}, "metrics": {},
    }
    windows: dict[str, tuple[Window | None, Window | None]] = {}
    for name, column in METRICS:
        table = hour_table(folded, column, rng)
        peak, off, note = find_windows(table)
        windows[name] = (peak, off)
        result["hours"][name] = table
        result["metrics"][name] = {"note": note, **{
            key: None if w is None else {
                "label": w.label, "hours": w.hours,
                "ratio": float(np.exp(np.mean([math.log(table[h]["ratio"]) for h in w.hours if table[h]["ratio"]]))),
                "stats": window_stats(_window_rows(folded, w), rng),
            } for key, w in (("peak", peak), ("off_peak", off))}}
    peak, off = windows["ttft"]
    result["daily"] = daily_series(folded, period_s)
    result["heatmap"] = {name: heatmap(folded, column) for name, column in
                         (("ttft_p50_s", "ttft_s"), ("tpot_p50_s", "tpot_s"), ("load_error_rate", "load_error"))}
    matched: dict[int, Any] = matched_comparison(everything, off, peak) if peak and off else {}
    result["comparison"] = matched.get(1)
    result["comparison_by_load"] = {str(level): c for level, c in matched.items()}
    result["server"] = server_view(folded, peak, off)
    result["capacity"] = capacity_by_window(capacities, {"off_peak": off, "peak": peak}, period_s)
    result["advice"] = advice(result)
    return result
