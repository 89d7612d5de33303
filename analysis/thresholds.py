"""Judge thresholds (`tokenload.thresholds`) on an analysed run: summary.json's `thresholds[]`.

Each number comes from the summary, its interval from the records the way the analysis makes its own: a
percentile's 95% bootstrap interval over the same censoring-aware observations (a percentile only known
as a lower bound has no upper end), a share's 95% Wilson interval. A step's numbers are its row's, a
model's percentiles are over that model's requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from tokenload.analysis.stats import Z95, bootstrap_ci, km_quantiles
from tokenload.analysis.steps import measured_rows, observations
from tokenload.analysis.summary import Analysis
from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import ThresholdResult
from tokenload.errors import ConfigError
from tokenload.search.evidence import wilson_interval
from tokenload.thresholds import ALIASES, Threshold, resolve, run_paths, verdict

Interval = tuple[float | None, float | None]
# One number and its interval: what `verdict` judges.
Measured = tuple[float | None, Interval | None]


def judge(analysis: Analysis, thresholds: Sequence[Threshold]) -> list[ThresholdResult]:
    """Every threshold against this run (those against a baseline are compare's)."""
    check_names(analysis, thresholds)
    return [judge_one(analysis, resolve(t)) for t in thresholds if not t.against_baseline]


def check_names(analysis: Analysis, thresholds: Sequence[Threshold]) -> None:
    """A step or model the run does not have is bad input (exit 2), with what it has."""
    s = analysis.summary
    for t in map(resolve, thresholds):
        if t.scope == "steps" and isinstance(t.selector, tuple) and not _steps(analysis, t):
            have = ", ".join(level_text(r["load_level"], r["load_unit"]) for r in s["steps"]) or "none"
            raise ConfigError(f"threshold {t.expr!r}: this run has no step {t.where}; its steps: {have}")
        if t.scope == "model" and t.selector not in s["run"]["models"]:
            raise ConfigError(f"threshold {t.expr!r}: this run sent no requests to model {t.selector!r}; its "
                              f"models: {', '.join(s['run']['models']) or 'none'}")
        if t.name == "capacity" and s.get("search") is None:
            raise ConfigError(f"threshold {t.expr!r}: capacity is a searched run's ([load] kind = \"search\"); "
                              "this run was not a search")


def judge_one(analysis: Analysis, t: Threshold) -> ThresholdResult:
    """One threshold: at every selected step the worst outcome counts (a fail, else an inconclusive)."""
    assert t.bound is not None
    if t.scope == "steps":
        rows = _steps(analysis, t)
        judged = [(row, *_step_number(analysis, row, t)) for row in rows]
        results = [(verdict(t.op, t.bound, value, ci), row, value, ci) for row, value, ci in judged]
        order = {"fail": 0, "inconclusive": 1, "pass": 2}
        if not results:
            return _result(t, "inconclusive", None, None, note="no step was decided")
        outcome, row, value, ci = min(results, key=lambda r: (order[r[0]], _badness(t, r[2])))
        where = (t.where if isinstance(t.selector, tuple)
                 else f"at {level_text(row['load_level'], row['load_unit'])} (the worst of {len(results)} steps)")
        return _result(t, outcome, value, ci, where=where)
    value, ci = _model_number(analysis, t) if t.scope == "model" else _run_number(analysis, t)
    search = analysis.summary.get("search")
    if t.name == "capacity" and value is None and search is not None and search["below_range"]:
        return _result(t, "fail" if t.op in (">", ">=") else "pass", None, None,
                       note=f"capacity below {search['range'][0]:g} {search['unit']}: the lowest level probed failed")
    note = "no value to judge: no finished request, or nothing decided" if value is None else None
    return _result(t, verdict(t.op, t.bound, value, ci), value, ci, note=note)


def _badness(t: Threshold, value: float | None) -> float:
    """Sorts the worst step first among equal outcomes: the highest value against `<`, the lowest against `>`."""
    if value is None:
        return 0.0
    return -value if t.op in ("<", "<=") else value


def _result(t: Threshold, result: str, value: float | None, ci: Interval | None, *, where: str | None = None,
            note: str | None = None) -> ThresholdResult:
    return {"expr": t.expr, "value": _r(value), "ci": None if ci is None else [_r(ci[0]), _r(ci[1])],
            "bound": t.bound, "result": cast(Any, result), "where": where or t.where, "relative": False, "note": note}


def _r(x: float | None) -> float | None:
    return None if x is None or not np.isfinite(x) else float(f"{x:.6g}")


def _steps(analysis: Analysis, t: Threshold) -> list[Mapping[str, Any]]:
    """The step rows a threshold names: one level, or every decided step."""
    rows = cast(list[Mapping[str, Any]], analysis.summary["steps"])
    if not isinstance(t.selector, tuple):
        return [r for r in rows if r.get("decided")]
    kind, level = t.selector
    if kind == "step":
        return [r for r in rows if r["step"] == level]
    unit = "users" if kind == "users" else "req/s"
    return [r for r in rows if r["load_unit"] == unit and abs(float(r["load_level"]) - level) < 1e-9]


def _percentile(rows: Any, analysis: Analysis, metric: str, pct: float, seed: int) -> Measured:
    """A censoring-aware percentile of `rows` and its 95% bootstrap interval (no upper end when it is a bound)."""
    times, events, _ = observations(rows, metric, analysis.run.cut).usable()
    if not times.size:
        return None, None
    q = km_quantiles(times, events, [pct / 100])[0]
    ci = bootstrap_ci(times, events, pct / 100, seed=seed)
    if q.bound:
        return q.value, (min(ci[0], q.value) if ci is not None else q.value, None)
    return q.value, _few(times[events], pct / 100) if ci is None else ci


def _few(values: np.ndarray, q: float) -> Interval:
    """The distribution-free 95% interval of the q-quantile of a handful of observations (too few to bootstrap):
    the order statistics at n q -/+ z sqrt(n q (1 - q)), an end beyond the data unbounded (None). Four first
    tokens of 12.9 s say a p95 is above 1 s; they cannot say it is below 30 s."""
    x = np.sort(values)
    half = Z95 * math.sqrt(x.size * q * (1 - q))
    lo, hi = math.floor(x.size * q - half), math.ceil(x.size * q + half)
    return (float(x[lo]) if lo >= 0 else None), (float(x[hi]) if hi < x.size else None)


def _share(hits: int, n: int) -> Measured:
    ci = wilson_interval(hits, n)
    return (hits / n if n else None), None if ci is None else (round(ci[0], 9), round(ci[1], 9))


def _run_number(analysis: Analysis, t: Threshold) -> Measured:
    s = analysis.summary
    pct = t.percentile
    if pct is not None:
        return _percentile(analysis.run.df, analysis, pct[0], pct[1], seed=int(pct[1] * 10))
    if t.name == "slo_attainment":
        judged, attainment = s["slo"]["judged"], s["slo"]["attainment"]
        return (None, None) if attainment is None else _share(round(attainment * judged), judged)
    if t.name == "error_rate":
        requests = s["run"]["requests"]
        return _share(round(s["diagnosis"]["error_rate"] * requests), requests) if requests else (None, None)
    value: Any = s
    for key in ALIASES.get(t.name) or run_paths()[t.name]:
        value = value.get(key) if isinstance(value, Mapping) else None
    return (float(value) if isinstance(value, (int, float)) else None), None


def _step_number(analysis: Analysis, row: Mapping[str, Any], t: Threshold) -> Measured:
    pct = t.percentile
    if pct is not None:
        rows = measured_rows(analysis.run.df, analysis.table)
        return _percentile(rows[rows["step"].eq(row["step"])], analysis, pct[0], pct[1], seed=int(row["step"]))
    value = row.get(t.step_key)
    if t.name == "slo_attainment" and value is not None:
        ci = row.get("slo_ci")
        return value, (ci[0], ci[1]) if ci else None
    if t.name in ("error_rate", "load_error_rate") and value is not None and row.get("requests"):
        return value, wilson_interval(round(value * row["requests"]), row["requests"])
    return (float(value) if isinstance(value, (int, float)) else None), None


def _model_number(analysis: Analysis, t: Threshold) -> Measured:
    pct = t.percentile
    assert pct is not None
    df = analysis.run.df
    return _percentile(df[df["model"].astype(str).eq(str(t.selector))], analysis, pct[0], pct[1], seed=7)


# ----- against a baseline (tokenload compare) ------------------------------------------------------------------

RELATIVE_PERCENTILES = (50.0, 95.0)  # what compare measures per matched level


def check_relative(thresholds: Sequence[Threshold]) -> None:
    """A relative bound judges a percentile compare measures at each level: p50 or p95 (exit 2 otherwise)."""
    for t in thresholds:
        pct = t.percentile
        if t.relative is not None and (pct is None or pct[1] not in RELATIVE_PERCENTILES or t.scope == "model"):
            raise ConfigError(f"threshold {t.expr!r}: a relative bound judges p50 or p95 of ttft, tpot or e2e at the "
                              "load levels both runs measured (what compare measures), e.g. 'ttft.p95 <= +10%'")


def judge_against(baseline: Mapping[str, Any], candidate: Analysis, thresholds: Sequence[Threshold],
                  levels: Sequence[Mapping[str, Any]] | None, label: str) -> list[ThresholdResult]:
    """`candidate`'s thresholds against `baseline` (a summary): relative ones at every matched load level, from
    compare's per-level rows (`levels`: the delta's bootstrap interval) or, with none (a kept summary.json
    has no records), from both steps' own intervals; `baseline - 1` ones against the baseline's number;
    absolute ones on the candidate alone."""
    out = []
    for t in map(resolve, thresholds):
        if t.relative is not None:
            result = _relative(baseline, candidate, t, levels)
        elif t.offset is not None:
            result = _offset(baseline, candidate, t)
        else:
            check_names(candidate, [t])
            result = judge_one(candidate, t)
        out.append({**result, "where": f"{label}: {result['where']}"})
    return cast(list[ThresholdResult], out)


def _offset(baseline: Mapping[str, Any], candidate: Analysis, t: Threshold) -> ThresholdResult:
    """`capacity >= baseline - 1`: the candidate's number against the baseline's own, moved by the offset."""
    check_names(candidate, [t])
    base_value = _path_value(baseline, t)
    if base_value is None:
        return _result(t, "inconclusive", None, None, note="the baseline has no such number")
    assert t.offset is not None
    judged = judge_one(candidate, Threshold(**{**t.__dict__, "bound": base_value + t.offset, "offset": None}))
    return {**judged, "note": f"the baseline's {base_value:g}{f' {t.offset:+g}' if t.offset else ''}"}


def _path_value(summary: Mapping[str, Any], t: Threshold) -> float | None:
    value: Any = summary
    for key in ALIASES.get(t.name) or run_paths().get(t.name) or ("latency", *t.name.split(".")):
        value = value.get(key) if isinstance(value, Mapping) else None
    return float(value) if isinstance(value, (int, float)) else None


def _relative(baseline: Mapping[str, Any], candidate: Analysis, t: Threshold,
              levels: Sequence[Mapping[str, Any]] | None) -> ThresholdResult:
    """The candidate's percentile over the baseline's, minus 1, at each matched level: the worst decides."""
    assert t.relative is not None and t.percentile is not None
    metric, pct = t.percentile
    rows = levels if levels is not None else _matched_steps(baseline, candidate)
    if isinstance(t.selector, tuple):
        kind, level = t.selector
        unit = "req/s" if kind == "rate" else "users"
        rows = [r for r in rows if r["load_unit"] == unit and abs(float(r["load_level"]) - level) < 1e-9]
    judged = []
    for row in rows:
        d = row[metric]
        base, delta, ci = d[f"baseline_p{pct:g}_s"], d[f"delta_p{pct:g}_s"], d[f"delta_p{pct:g}_ci95"]
        if not base or delta is None:
            continue
        rel_ci = None if not ci else (ci[0] / base, ci[1] / base)
        judged.append((verdict(t.op, t.relative, delta / base, rel_ci), row, delta / base, rel_ci))
    if not judged:
        return _result(t, "inconclusive", None, None, note="no load level both runs measured")
    order = {"fail": 0, "inconclusive": 1, "pass": 2}
    outcome, row, value, ci = min(judged, key=lambda r: (order[r[0]], -r[2]))
    where = level_text(row["load_level"], row["load_unit"])
    return {**_result(t, outcome, value, ci, where=f"at {where} (the worst of {len(judged)} matched levels)"),
            "bound": t.relative, "relative": True,
            "note": (f"relative to the baseline's {row[metric][f'baseline_p{pct:g}_s']:.3g} s; "
                     + ("compare's bootstrap interval of the delta" if levels is not None else
                        "from both steps' intervals (the baseline is a summary.json: no records)"))}


def _matched_steps(baseline: Mapping[str, Any], candidate: Analysis) -> list[dict[str, Any]]:
    """compare's per-level rows, from two summaries' steps: each side's percentile and 95% interval, the delta's
    interval the widest the two allow (candidate low - baseline high, candidate high - baseline low)."""
    mine = {(r["load_unit"], float(r["load_level"])): r for r in baseline.get("steps") or []}
    rows = []
    for theirs in cast(list[Mapping[str, Any]], candidate.summary["steps"]):
        base = mine.get((theirs["load_unit"], float(theirs["load_level"])))
        if base is None:
            continue
        row: dict[str, Any] = {"load_unit": theirs["load_unit"], "load_level": theirs["load_level"]}
        for metric in ("ttft", "tpot", "e2e"):
            entry: dict[str, Any] = {}
            for pct in RELATIVE_PERCENTILES:
                key = f"{metric}_p{pct:g}_s"
                b, c = base.get(key), theirs.get(key)
                b_ci, c_ci = (base.get("ci") or {}).get(key), (theirs.get("ci") or {}).get(key)
                entry[f"baseline_p{pct:g}_s"] = b
                entry[f"delta_p{pct:g}_s"] = None if b is None or c is None else c - b
                entry[f"delta_p{pct:g}_ci95"] = [c_ci[0] - b_ci[1], c_ci[1] - b_ci[0]] if b_ci and c_ci else None
            row[metric] = entry
        rows.append(row)
    return rows
