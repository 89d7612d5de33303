"""Compare runs (off-peak vs peak, model A vs model B), matched by load level.

The first run is the baseline. Two runs that spent different shares of their
requests at each load cannot be compared pooled (the mix, not the channel,
would decide), so steps are paired by load level (users, or offered req/s)
and every shared level is compared on its own: p50/p95 deltas of TTFT, TPOT
and e2e with 95% bootstrap intervals, a two-sided Mann-Whitney U test per
level and metric, Holm-corrected over all of them, and the throughput of the
two windows. With thousands of requests even tiny shifts are "significant",
so each test also carries an effect size, P(a request of this run is slower
than one of the baseline), where 0.5 means no shift. The headline per metric
counts the levels at which the run was slower or faster.

Asked (`relay=True`: the later runs went through a relay in front of the
baseline's channel), each run also gets what the relay adds per matched level.
A raw difference of TTFT would blame the relay for whatever the server did
differently (longer prompts, a prompt-cache hit in one run), so the TTFT it
adds rests on the best basis both runs have, named in the output: the server's
own time subtracted (its metrics sampled in both runs), else each run's
TTFT-vs-input line at one input length, else the raw difference where both
sent the same input length, else the raw difference said to be unmatched. The
inter-token gaps, TTFB and how often the headers came only with the first token
are compared as measured. Runs through different URLs are no relay comparison
unless asked (a peak run against another host is not "what a relay adds").
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from tokenload.analysis import plots, serverplot
from tokenload.analysis.breakpoint import breakpoint_text
from tokenload.analysis.fits import linear_fit, varies
from tokenload.analysis.levers import off_peak
from tokenload.analysis.models import compare_models
from tokenload.analysis.pipeline import analyze
from tokenload.analysis.records import load_run
from tokenload.analysis.report import figure, h, html_table, page, verdict_html
from tokenload.analysis.search import compare_capacities
from tokenload.analysis.server import Outside, outside_server
from tokenload.analysis.stats import BOOTSTRAP_MAX_N, BOOTSTRAP_RESAMPLES, MIN_CI_SAMPLES, holm, order_statistic_ci
from tokenload.analysis.steps import METRICS, measured_rows
from tokenload.analysis.summary import Analysis
from tokenload.analysis.thresholds import judge_against
from tokenload.analysis.windows import level_text
from tokenload.errors import ConfigError
from tokenload.thresholds import Threshold

ALPHA = 0.01
# |P(slower) - 0.5| below this is reported as negligible however small p is.
MIN_EFFECT = 0.05
COMPARE_PLOTS = (
    ("cdfs.png", plots.plot_cdfs, "TTFT, TPOT and end-to-end latency distributions of each run, overlaid."),
    ("latency_vs_users.png", plots.plot_latency_vs_users, "Latency percentiles per load level, one colour per run (the levels the table pairs)."),
    ("throughput_vs_users.png", plots.plot_throughput_vs_users, "Throughput and error rate per load level, one colour per run."),
    ("ttft_vs_input.png", plots.plot_ttft_vs_input, "TTFT vs input length with each run's fits (low-load steps)."),
    ("e2e_vs_output.png", plots.plot_e2e_vs_output, "Total latency vs output length with each run's fit and formula line."),
)


def mann_whitney(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Two-sided Mann-Whitney U test of b against a (normal approximation, tie-corrected).

    `effect` is U_b / (n_a n_b) = P(b > a) + P(b = a) / 2: 0.5 means no shift.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return {"u": math.nan, "z": math.nan, "p_value": math.nan, "effect": math.nan}
    both = np.concatenate([a, b])
    order = np.argsort(both, kind="mergesort")
    sorted_vals = both[order]
    # Average ranks over ties: each run of equal values gets the mean of its positions.
    starts = np.flatnonzero(np.r_[True, sorted_vals[1:] != sorted_vals[:-1]])
    counts = np.diff(np.r_[starts, len(both)])
    avg_rank = starts + (counts + 1) / 2.0
    ranks = np.empty(len(both))
    ranks[order] = np.repeat(avg_rank, counts)
    u_b = float(ranks[n1:].sum()) - n2 * (n2 + 1) / 2.0
    n = n1 + n2
    tie_term = float((counts.astype(np.float64) ** 3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    sigma = math.sqrt(n1 * n2 / 12.0 * ((n + 1) - tie_term))
    mu = n1 * n2 / 2.0
    if sigma == 0:
        return {"u": u_b, "z": 0.0, "p_value": 1.0, "effect": 0.5}
    z = (u_b - mu - math.copysign(0.5, u_b - mu)) / sigma if u_b != mu else 0.0
    return {"u": u_b, "z": z, "p_value": math.erfc(abs(z) / math.sqrt(2.0)), "effect": u_b / (n1 * n2)}


def _r(x: float | None, digits: int = 4) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def _completed(a: Analysis, step: int) -> pd.DataFrame:
    """The completed successful requests of one step (after warm-up)."""
    rows = measured_rows(a.run.df, a.table)
    return rows[rows["step"].eq(step) & rows["status"].eq("ok") & ~rows["in_flight"]]


def _values(a: Analysis, step: int, metric: str, column: str | None = None) -> np.ndarray:
    """Completed successful latencies of one step (after warm-up): what a per-level test compares.

    `column`: another record column than `<metric>_s` (the overhead's `itl_p50_s`)."""
    rows = _completed(a, step)
    name = column or f"{metric}_s"
    if name not in rows:  # a run directory from before the column existed
        return np.zeros(0)
    return pd.to_numeric(rows[name], errors="coerce").dropna().to_numpy(dtype=float)


def _delta_ci(a: np.ndarray, b: np.ndarray, q: float, seed: int) -> list[float | None] | None:
    """95% bootstrap interval of quantile(b) - quantile(a), each run resampled on its own.

    Past BOOTSTRAP_MAX_N requests a side contributes its order-statistic interval instead
    (combined in quadrature), so a million-request comparison stays fast.
    """
    if a.size < MIN_CI_SAMPLES or b.size < MIN_CI_SAMPLES:
        return None
    if max(a.size, b.size) > BOOTSTRAP_MAX_N:
        (a_lo, a_hi), (b_lo, b_hi) = order_statistic_ci(a, q), order_statistic_ci(b, q)
        delta = float(np.quantile(b, q) - np.quantile(a, q))
        half = float(np.hypot((a_hi - a_lo) / 2, (b_hi - b_lo) / 2))
        return [_r(delta - half, 6), _r(delta + half, 6)]
    rng = np.random.default_rng(seed)
    qa = np.quantile(a[rng.integers(0, a.size, (BOOTSTRAP_RESAMPLES, a.size))], q, axis=1)
    qb = np.quantile(b[rng.integers(0, b.size, (BOOTSTRAP_RESAMPLES, b.size))], q, axis=1)
    lo, hi = np.quantile(qb - qa, [0.025, 0.975])
    return [_r(float(lo), 6), _r(float(hi), 6)]


def _metric_delta(a: np.ndarray, b: np.ndarray, seed: int) -> dict[str, Any]:
    test = mann_whitney(a, b)
    out: dict[str, Any] = {"n_baseline": int(a.size), "n": int(b.size)}
    for p in (50, 95):
        base = float(np.percentile(a, p)) if a.size else math.nan
        other = float(np.percentile(b, p)) if b.size else math.nan
        out[f"baseline_p{p}_s"], out[f"p{p}_s"] = _r(base, 6), _r(other, 6)
        out[f"delta_p{p}_s"] = _r(other - base, 6)
        out[f"delta_p{p}_ci95"] = _delta_ci(a, b, p / 100, seed + p)
    both = out["baseline_p50_s"] and out["p50_s"] is not None  # a level may have no finished request in a run
    out["ratio_p50"] = _r(out["p50_s"] / out["baseline_p50_s"]) if both else None
    out["p_value"] = _r(test["p_value"], 3)
    out["effect_p_slower"] = _r(test["effect"])
    return out


def _level_key(row: Any) -> tuple[str, float]:
    return str(row["load_unit"]), float(row["load_level"])


def matched_levels(base: Analysis, other: Analysis) -> list[tuple[int, int, tuple[str, float]]]:
    """(baseline step, other step, (unit, level)) for every load level both runs measured.

    A level measured in several steps (a search's probe revisited, a ramp's step back down) is compared by its
    step with the most successful requests: the last one may be a probe of five requests."""
    def steps_by_level(a: Analysis) -> dict[tuple[str, float], int]:
        best: dict[tuple[str, float], tuple[int, int]] = {}
        for step, row in a.table.iterrows():
            key, ok = _level_key(row), int(row["ok"])
            if key not in best or ok > best[key][1]:
                best[key] = (int(cast(int, step)), ok)
        return {key: step for key, (step, _) in best.items()}
    mine, theirs = steps_by_level(base), steps_by_level(other)
    return [(mine[k], theirs[k], k) for k in sorted(set(mine) & set(theirs))]


def _levels(label: str, base: Analysis, other: Analysis, alpha: float) -> list[dict[str, Any]]:
    """Per matched load level: latency deltas with CIs and Holm-corrected tests, and throughput."""
    rows: list[dict[str, Any]] = []
    for i, (s_base, s_other, (unit, level)) in enumerate(matched_levels(base, other)):
        row: dict[str, Any] = {"label": label, "load_level": level, "load_unit": unit, "load": level_text(level, unit),
                               "step_baseline": s_base, "step": s_other}
        for j, metric in enumerate(METRICS):
            row[metric] = _metric_delta(_values(base, s_base, metric), _values(other, s_other, metric),
                                        seed=1000 * i + 10 * j)
        tb, to = base.table.loc[s_base], other.table.loc[s_other]
        row["throughput"] = {"baseline_output_tok_s": _r(tb["output_tok_s"]), "output_tok_s": _r(to["output_tok_s"]),
                             "delta_output_tok_s": _r(to["output_tok_s"] - tb["output_tok_s"]),
                             "ratio": _r(to["output_tok_s"] / tb["output_tok_s"]) if tb["output_tok_s"] else None,
                             "baseline_total_tok_s": _r(tb["total_tok_s"]), "total_tok_s": _r(to["total_tok_s"])}
        row["server"] = serverplot.side_by_side(base.summary, s_base, other.summary, s_other)
        rows.append(row)
    tests = [(row, metric) for row in rows for metric in METRICS]
    adjusted = holm([row[m]["p_value"] if row[m]["p_value"] is not None else math.nan for row, m in tests])
    for (row, metric), p_adj in zip(tests, adjusted):
        d = row[metric]
        d["p_holm"] = _r(p_adj, 3)
        d["significant"] = bool(p_adj < alpha) and abs((d["effect_p_slower"] or 0.5) - 0.5) >= MIN_EFFECT
        if not d["n"] or not d["n_baseline"]:  # a run had no finished request at this level: nothing to compare
            d["verdict"] = "no finished request"
        else:
            d["verdict"] = ("slower" if d["effect_p_slower"] > 0.5 else "faster") if d["significant"] else "same"
    return rows


def _summary_delta(label: str, metric: str, levels: list[dict[str, Any]]) -> dict[str, Any]:
    """One run x metric over its matched levels: where it was slower, faster, the same."""
    if not levels:
        return {"label": label, "metric": metric, "matched_levels": 0, "significant": False,
                "verdict": "no shared load level", "ratio_p50": None, "slower_at": [], "faster_at": [],
                "p_holm_min": None}
    slower = [x["load"] for x in levels if x[metric]["verdict"] == "slower"]
    faster = [x["load"] for x in levels if x[metric]["verdict"] == "faster"]
    ratios = [x[metric]["ratio_p50"] for x in levels if x[metric]["ratio_p50"] is not None]
    p_min = min((x[metric]["p_holm"] for x in levels if x[metric]["p_holm"] is not None), default=None)
    if slower and faster:
        verdict = "mixed"
    elif slower:
        verdict = "slower"
    elif faster:
        verdict = "faster"
    else:
        verdict = "no meaningful difference"
    return {"label": label, "metric": metric, "matched_levels": len(levels), "significant": bool(slower or faster),
            "verdict": verdict, "ratio_p50": _r(float(np.median(ratios))) if ratios else None,
            "ratio_p50_range": [min(ratios), max(ratios)] if ratios else None,
            "slower_at": slower, "faster_at": faster, "p_holm_min": p_min}


# What a relay in front of the baseline's channel adds, per matched level: when the response headers came, the
# first token (raw; the TTFT it adds is `_ttft_added`'s), and each request's median gap between tokens.
OVERHEAD = (("ttfb", "ttfb_s"), ("ttft", "ttft_s"), ("itl", "itl_p50_s"))
OVERHEAD_LEVELS_SAID = 3  # the headline names the lowest few matched levels (the overhead is cleanest unloaded)
# Median input lengths this close (relative) count as the same input length.
SAME_INPUT = 0.05
BASES = {
    "server": "the server's own time subtracted",
    "input": "each run's TTFT-vs-input line at one input length",
    "same_input": "raw p50 difference at the same input length",
    "raw": "raw p50 difference, not matched",
}


def _outside(a: Analysis, step: int) -> Outside | None:
    """What one step's first tokens spent outside the server, by its own metrics (`server.outside_server`)."""
    window = a.table.loc[step]
    return outside_server(a.run, float(window["start"]), float(window["end"]))


def _server_basis(base: Analysis, s_base: int, other: Analysis, s_other: int, seed: int) -> dict[str, Any] | None:
    """The time each run's first tokens spent outside the server: the relay's share is the difference."""
    b, o = _outside(base, s_base), _outside(other, s_other)
    if b is None or o is None:
        return None
    ci = None
    if min(len(b.requests), len(o.requests)) >= MIN_CI_SAMPLES:  # resampled by block: what the server counted
        rng = np.random.default_rng(seed)
        draws = [(x.seconds[i].sum(axis=1) / x.requests[i].sum(axis=1))
                 for x in (b, o) for i in [rng.integers(0, len(x.requests), (BOOTSTRAP_RESAMPLES, len(x.requests)))]]
        lo, hi = np.quantile(draws[1] - draws[0], [0.025, 0.975])
        ci = [_r(float(lo), 6), _r(float(hi), 6)]
    return {"basis": "server", "delta_s": _r(o.mean_s - b.mean_s, 6), "ci95": ci,
            "requests": [int(b.requests.sum()), int(o.requests.sum())],
            "detail": f"{b.source}: {o.mean_s:.3g} s a request outside the server against the baseline's "
                      f"{b.mean_s:.3g} s, over {int(o.requests.sum())} and {int(b.requests.sum())} requests"}


def _line_at(x: np.ndarray, y: np.ndarray, at: float, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap predictions at `at` of the least-squares line of y on x (one per resample)."""
    idx = rng.integers(0, x.size, (BOOTSTRAP_RESAMPLES, x.size))
    xs, ys = x[idx], y[idx]
    dx = xs - xs.mean(axis=1, keepdims=True)
    slope = (dx * (ys - ys.mean(axis=1, keepdims=True))).sum(axis=1) / np.maximum((dx * dx).sum(axis=1), 1e-12)
    return ys.mean(axis=1) + slope * (at - xs.mean(axis=1))


def _input_basis(b: pd.DataFrame, o: pd.DataFrame, seed: int) -> dict[str, Any] | None:
    """Each run's TTFT-vs-input line at one input length inside both runs' ranges: what is left is not prefill."""
    (xb, yb), (xo, yo) = ((rows["input_tokens"].to_numpy(dtype=float, na_value=np.nan),
                           rows["ttft_s"].to_numpy(dtype=float, na_value=np.nan)) for rows in (b, o))
    kb, ko = np.isfinite(xb) & np.isfinite(yb), np.isfinite(xo) & np.isfinite(yo)
    (xb, yb), (xo, yo) = (xb[kb], yb[kb]), (xo[ko], yo[ko])
    if not (varies(xb) and varies(xo)):
        return None
    lo, hi = max(xb.min(), xo.min()), min(xb.max(), xo.max())
    fb, fo = linear_fit(xb, yb), linear_fit(xo, yo)
    if fb is None or fo is None or lo >= hi:
        return None
    at = float(np.clip(np.median(np.concatenate([xb, xo])), lo, hi))
    delta = (fo.intercept + fo.slope * at) - (fb.intercept + fb.slope * at)
    rng = np.random.default_rng(seed)
    lo_ci, hi_ci = np.quantile(_line_at(xo, yo, at, rng) - _line_at(xb, yb, at, rng), [0.025, 0.975])
    return {"basis": "input", "delta_s": _r(float(delta), 6), "ci95": [_r(float(lo_ci), 6), _r(float(hi_ci), 6)],
            "at_input_tokens": round(at),
            "detail": f"at {at:.0f} input tokens: {fo.intercept + fo.slope * at:.3g} s against the baseline's "
                      f"{fb.intercept + fb.slope * at:.3g} s"}


def _ttft_added(base: Analysis, s_base: int, other: Analysis, s_other: int, raw: dict[str, Any],
                seed: int) -> dict[str, Any]:
    """The TTFT a relay adds at one matched level, on the best basis both runs have (the module docstring)."""
    b, o = _completed(base, s_base), _completed(other, s_other)
    found = _server_basis(base, s_base, other, s_other, seed) or _input_basis(b, o, seed + 1)
    if found is None:
        nb, no = (float(rows["input_tokens"].median()) if rows["input_tokens"].notna().any() else math.nan
                  for rows in (b, o))
        same = abs(nb - no) <= SAME_INPUT * max(nb, no)  # False for NaN: an unknown length is not the same
        found = {"basis": "same_input" if same else "raw", "delta_s": raw["delta_p50_s"],
                 "ci95": raw["delta_p50_ci95"],
                 "detail": (f"both runs sent about {nb:.0f} input tokens" if same else
                            f"input lengths differ (median {nb:.0f} against {no:.0f} tokens) with no line to match "
                            "them and no server metrics in both runs: this includes the server's own difference")}
    return {**found, "basis_text": BASES[found["basis"]]}


def _overhead(label: str, base: Analysis, other: Analysis) -> dict[str, Any]:
    """What a relay (`other`) adds over its channel reached directly (`base`) at each matched load level: the
    TTFT (`_ttft_added`), p50/p95 deltas of TTFB, TTFT and the ITL distribution (each request's median gap) as
    measured, with 95% bootstrap intervals, and how often each run's headers came only with the first token
    (a relay that buffers the response start)."""
    rows = []
    for i, (s_base, s_other, (unit, level)) in enumerate(matched_levels(base, other)):
        row: dict[str, Any] = {"load_level": level, "load_unit": unit, "load": level_text(level, unit)}
        for j, (name, column) in enumerate(OVERHEAD):
            row[name] = _metric_delta(_values(base, s_base, name, column), _values(other, s_other, name, column),
                                      seed=7000 + 1000 * i + 10 * j)
        row["ttft_added"] = _ttft_added(base, s_base, other, s_other, row["ttft"], seed=9000 + 1000 * i)
        rows.append(row)
    held = {side: {k: (a.summary.get("fidelity") or {}).get(k) for k in ("headers_held", "headers_judged")}
            for side, a in (("baseline", base), ("run", other))}
    channels = [(a.summary["run"].get("channel") or {}) for a in (base, other)]
    return {"label": label, "levels": rows, "headers_held": held,
            "other_url": channels[0].get("url") != channels[1].get("url"),
            "headline": _overhead_lines(label, rows, held)}


def _overhead_lines(label: str, rows: list[dict[str, Any]], held: dict[str, dict[str, Any]]) -> list[str]:
    """'relay adds at 1 user: TTFT +0.091 s [+0.07, +0.11] (the server's own time subtracted: ...); raw ...'."""
    def said(d: dict[str, Any], p: int) -> str:
        return _ci_text(d[f"delta_p{p}_s"], d[f"delta_p{p}_ci95"]).replace("n/a", "not measured") + " s"

    def added(d: dict[str, Any]) -> str:
        return _ci_text(d["delta_s"], d["ci95"]).replace("n/a", "not measured") + " s"

    lines = [f"{label} adds at {row['load']}: TTFT {added(row['ttft_added'])} ({row['ttft_added']['basis_text']}: "
             f"{row['ttft_added']['detail']}); as measured: TTFT {said(row['ttft'], 50)}, TTFB {said(row['ttfb'], 50)}, "
             f"inter-token gap (each request's median) p50 {said(row['itl'], 50)}, p95 {said(row['itl'], 95)} "
             "(deltas with 95% bootstrap intervals)"
             for row in rows[:OVERHEAD_LEVELS_SAID]]
    run, base = held["run"], held["baseline"]
    if run["headers_judged"] and base["headers_judged"] is not None:
        lines.append(f"{label}: response headers came only with the first token in {run['headers_held']} of "
                     f"{run['headers_judged']} answers ({base['headers_held']} of {base['headers_judged']} in the "
                     "baseline): TTFB there says nothing about the network, only TTFT does")
    return lines


def _throughput_line(label: str, levels: list[dict[str, Any]]) -> str | None:
    """'peak output throughput: 0.54x the baseline's (median over 5 levels; 0.5-0.6x)'."""
    ratios = [x["throughput"]["ratio"] for x in levels if x["throughput"]["ratio"] is not None]
    if not ratios:
        return None
    return (f"{label} output throughput: {np.median(ratios):.2f}x the baseline's (median over {len(ratios)} matched "
            f"level(s); {min(ratios):.2f}-{max(ratios):.2f}x; one window per level, no test)")


def _headline(d: dict[str, Any]) -> str:
    """'peak TPOT: slower at 5 of 5 matched levels (1-16 users), p50 x1.8 (median)'."""
    name = f"{d['label']} {d['metric'].upper()}"
    if not d["matched_levels"]:
        return f"{name}: no load level in common with the baseline, not compared (pooling steps of different loads misleads)"
    n = d["matched_levels"]
    ratio = f"; p50 ratio {d['ratio_p50']:.2f} (median over levels)" if d["ratio_p50"] is not None else ""
    if d["verdict"] == "no meaningful difference":
        return f"{name}: no meaningful difference at any of {n} matched level(s){ratio}"
    parts = []
    if d["slower_at"]:
        parts.append(f"slower at {len(d['slower_at'])} of {n} matched levels ({', '.join(d['slower_at'])})")
    if d["faster_at"]:
        parts.append(f"faster at {len(d['faster_at'])} of {n} ({', '.join(d['faster_at'])})")
    return f"{name}: {'; '.join(parts)}{ratio}"


def _run_card(label: str, a: Analysis) -> dict[str, Any]:
    s = a.summary
    ttft, e2e = s["fits"]["ttft_vs_input"], s["fits"]["e2e_vs_output"]
    return {
        "label": label, "run_dir": s["run"]["run_dir"], "started_at": s["run"]["started_at"],
        "models": s["run"]["models"], "requests": s["run"]["requests"], "ok": s["run"]["ok"],
        "errors": s["run"]["errors"], "slo_attainment": s["slo"]["attainment"], "latency": s["latency"],
        "ttft_fit": {k: ttft.get(k) for k in ("model", "slope_s_per_token", "intercept_s", "exponent", "r2", "n")},
        "e2e_fit": {k: e2e.get(k) for k in ("slope_s_per_token", "intercept_s", "r2", "n")},
        "breakpoint": s["breakpoint"], "breakpoint_note": s["breakpoint_note"],
        "bound": s["diagnosis"]["bound"], "max_active_users": max((x["active_users"] for x in s["steps"]), default=None),
        "load_levels": [x["load_level"] for x in s["steps"]], "load_unit": s["run"]["load_unit"],
        **({"server_cause": cause["text"] if (cause := s["server_metrics"].get("cause")) else None}
           if s["server_metrics"].get("terms") else {}),
    }


def _labels(analyses: Sequence[Analysis], labels: Sequence[str] | None) -> list[str]:
    if labels:
        if len(labels) != len(analyses):
            raise ConfigError(f"--labels has {len(labels)} label(s) for {len(analyses)} run(s): give one per run")
        return list(labels)
    out = [a.run.label for a in analyses]
    if len(set(out)) < len(out):  # same start minute: the directory names tell them apart
        out = [f"{lab} ({a.run.run_dir.name})" for lab, a in zip(out, analyses)]
    return out


def split_models(run_dirs: Sequence[str | Path], models: Sequence[str] | None) -> list[str]:
    """The models of one run to compare with each other (`--models`, else all of a single run's), or [] for runs."""
    if len(run_dirs) > 1:
        if models:
            raise ConfigError("--models compares the models of one run: give one RUN_DIR")
        return []
    run = load_run(Path(run_dirs[0]))
    found = sorted(str(m) for m in run.df["model"].dropna().unique())
    listed = ((run.manifest.get("scenario") or {}).get("channel") or {}).get("models") or []
    present = [m for m in listed if m in found] + [m for m in found if m not in listed]  # the channel's own first
    chosen = list(models or present)
    missing = [m for m in chosen if m not in present]
    if missing:
        raise ConfigError(f"{run_dirs[0]} has no request to {missing[0]}: its models are {', '.join(present)}")
    if len(chosen) < 2:
        raise ConfigError("compare needs at least two run directories, or one run of two or more models")
    return chosen


def compare_runs(run_dirs: Sequence[str | Path], labels: Sequence[str] | None = None,
                 out_dir: str | Path | None = None, *, slo_overrides: Mapping[str, Any] | None = None,
                 alpha: float = ALPHA, console: Console | None = None, relay: bool = False,
                 thresholds: Sequence[Threshold] = (), models: Sequence[str] | None = None) -> dict[str, Any]:
    """Compare runs (the first is the baseline); write comparison.json/.html and plots to out_dir.

    One run alone compares its models (`models`, else all of them; the first is the
    baseline), each one's requests as a run of its own. Every run is judged by one SLO:
    the baseline's own (its scenario's `[slo]`) with `slo_overrides` applied. out_dir
    defaults to `compare-<time>` next to the first run. `relay`: the later runs went
    through a relay in front of the baseline's channel; `overhead` then says what it adds.
    `thresholds` are judged on every other run against the baseline (`comparison["thresholds"]`).
    """
    split = split_models(run_dirs, models)
    first = analyze(run_dirs[0], console=console, write=False, slo_overrides=slo_overrides,
                    model=split[0] if split else None)
    slo = first.slo
    analyses = [first, *(analyze(run_dirs[0], slo, console=console, write=False, model=m) for m in split[1:])] if split \
        else [first, *(analyze(d, slo, console=console, write=False) for d in run_dirs[1:])]
    names = _labels(analyses, labels or split or None)
    out = Path(out_dir) if out_dir else Path(run_dirs[0]).resolve().parent / time.strftime("compare-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    base = analyses[0]
    levels = {n: _levels(n, base, a, alpha) for n, a in zip(names[1:], analyses[1:])}
    deltas = [_summary_delta(n, m, levels[n]) for n in names[1:] for m in METRICS]
    comparison: dict[str, Any] = {
        "baseline": names[0], "alpha": alpha, "min_effect": MIN_EFFECT, "slo": slo.to_dict(),
        "test": ("per matched load level: two-sided Mann-Whitney U (normal approximation, tie-corrected), "
                 "Holm-corrected over every level and metric; 95% bootstrap intervals of the p50/p95 deltas"),
        "runs": [_run_card(n, a) for n, a in zip(names, analyses)],
        "headline": [_headline(d) for d in deltas] + [line for n in names[1:] if (line := _throughput_line(n, levels[n]))],
        "levels": [row for n in names[1:] for row in levels[n]],
        "deltas": deltas,
        "overhead": [_overhead(n, base, a) for n, a in zip(names[1:], analyses[1:])] if relay else [],
    }
    comparison["headline"] += [line for o in comparison["overhead"] for line in o["headline"]]
    comparison["models"] = [m for n, a in zip(names[1:], analyses[1:]) if (m := compare_models(base, a, n))]
    comparison["headline"] = [m["headline"] for m in comparison["models"]] + comparison["headline"]
    comparison["levers"] = [row for n, a in zip(names[1:], analyses[1:]) if not comparison["models"]
                            and (row := off_peak(names[0], base, n, a, matched_levels(base, a)))]
    comparison["headline"] += [row["headline"] for row in comparison["levers"]]
    comparison["thresholds"] = [r for n, a in zip(names[1:], analyses[1:])
                                for r in judge_against(base.summary, a, thresholds, levels[n], n)]
    capacities = compare_capacities([(n, a.summary.get("search")) for n, a in zip(names, analyses)])
    if capacities is not None:
        comparison["capacity"] = capacities
        comparison["headline"] = capacities["headline"] + comparison["headline"]
    views = list(zip(names, analyses))
    figures, drawn = [], []
    if capacities is not None:
        figures.append(figure(plots.plot_capacity([(n, s) for n, a in views if (s := a.summary["search"]) is not None],
                                                  out / "plots" / "capacity.png"),
                              "Each run's breakpoint search: SLO attainment and goodput per probe (numbered in the "
                              "order they ran); shaded: where each run's boundary lies."))
        drawn.append("capacity.png")
    if all(len(a.ok) for a in analyses):
        for name, draw, caption in COMPARE_PLOTS:
            figures.append(figure(draw(views, out / "plots" / name), caption))
            drawn.append(name)
    comparison["plots"] = [f"plots/{name}" for name in drawn]
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2, default=str) + "\n", encoding="utf-8")
    _write_html(comparison, views, figures, out / "comparison.html")
    comparison["out_dir"] = str(out)
    return comparison


LEVEL_HEADERS = ("run", "load", "metric", "n base / n", "base p50 s", "p50 s", "Δ p50 s (95% CI)", "base p95 s",
                 "p95 s", "Δ p95 s (95% CI)", "p (Holm)", "P(slower)", "verdict")


def _ci_text(value: float | None, ci: list[float] | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.3g}" + (f" [{ci[0]:+.3g}, {ci[1]:+.3g}]" if ci else " (too few for a CI)")


def _level_rows(comparison: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for x in comparison["levels"]:
        for metric in METRICS:
            d = x[metric]
            rows.append([x["label"], x["load"], metric.upper(), f"{d['n_baseline']} / {d['n']}", d["baseline_p50_s"],
                         d["p50_s"], _ci_text(d["delta_p50_s"], d["delta_p50_ci95"]), d["baseline_p95_s"], d["p95_s"],
                         _ci_text(d["delta_p95_s"], d["delta_p95_ci95"]), d["p_holm"], d["effect_p_slower"],
                         d["verdict"]])
        t = x["throughput"]
        rows.append([x["label"], x["load"], "output tok/s", "", t["baseline_output_tok_s"], t["output_tok_s"],
                     _ci_text(t["delta_output_tok_s"], None).replace(" (too few for a CI)", " (one window: no CI)"),
                     "", "", "", "", "", ""])
    return rows


def _write_html(comparison: dict[str, Any], views: list[tuple[str, Analysis]], figures: list[str], path: Path) -> None:
    runs = [[r["label"], ", ".join(r["models"]), r["requests"], r["errors"], r["slo_attainment"],
             ", ".join(f"{v:g}" for v in r["load_levels"]) + f" {r['load_unit'] or ''}",
             r["ttft_fit"]["slope_s_per_token"], r["ttft_fit"]["intercept_s"], r["e2e_fit"]["slope_s_per_token"],
             (f"{breakpoint_text(r['breakpoint'])} ({r['breakpoint']['reason']})" if r["breakpoint"] else "none"),
             r["bound"] or "not determined"] for r in comparison["runs"]]
    headline = "<ul class='advice'>" + "".join(f"<li>{h(line)}</li>" for line in comparison["headline"]) + "</ul>"
    sections = [
        (f"Against {comparison['baseline']}, matched by load level", headline),
        (f"Per load level ({comparison['test'].removeprefix('per matched load level: ')}; α = {comparison['alpha']:g})",
         html_table(LEVEL_HEADERS, _level_rows(comparison), left=4)),
        ("Runs", html_table(["run", "models", "requests", "errors", "SLO met", "load levels", "TTFT s/token",
                             "TTFT intercept s", "e2e s/token", "breakpoint", "bound"], runs, left=2)),
    ]
    if figures:
        sections.append(("Charts", "".join(figures)))
    if (server := serverplot.compare_section(comparison)) is not None:
        sections.append(server)
    sections += [(f"Verdict: {label}", verdict_html(a.summary)) for label, a in views]
    title = "tokenload comparison: " + " vs ".join(label for label, _ in views)
    path.write_text(page(title, sections), encoding="utf-8")


def comparison_table(comparison: dict[str, Any]) -> Table:
    """Rich table: one headline per run and metric, from the matched load levels (the HTML has every level)."""
    table = Table(title=f"tokenload compare (baseline {comparison['baseline']}, matched by load level)",
                  title_justify="left")
    for head in ("run", "metric", "levels", "p50 ratio", "verdict", "where"):
        table.add_column(head, justify="right" if head in ("levels", "p50 ratio") else "left",
                         overflow="fold")
    for d in comparison["deltas"]:
        where = "; ".join(part for part in (
            f"slower at {', '.join(d['slower_at'])}" if d["slower_at"] else "",
            f"faster at {', '.join(d['faster_at'])}" if d["faster_at"] else "") if part)
        style = {"slower": "red", "faster": "green", "mixed": "yellow"}.get(d["verdict"], "")
        ratio = "n/a" if d["ratio_p50"] is None else f"{d['ratio_p50']:.3g}"
        table.add_row(d["label"], d["metric"].upper(), str(d["matched_levels"]), ratio, d["verdict"], where or "-",
                      style=style)
    return table
