"""Compare runs (off-peak vs peak, model A vs model B): deltas with a significance test.

The first run is the baseline; every other run is compared with it per metric
by a two-sided Mann-Whitney U test (normal approximation with tie correction,
numpy only). With thousands of requests even tiny shifts are "significant", so
each delta also carries an effect size: P(a request of this run is slower than
one of the baseline), where 0.5 means no shift.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tokenload.analysis import plots
from tokenload.analysis.breakpoint import users
from tokenload.analysis.pipeline import analyze
from tokenload.analysis.report import figure, h, html_table, page, verdict_html
from tokenload.analysis.steps import Slo
from tokenload.analysis.summary import Analysis
from tokenload.errors import ConfigError

METRICS: tuple[str, ...] = ("ttft", "tpot", "e2e")
ALPHA = 0.01
# |P(slower) - 0.5| below this is reported as negligible however small p is.
MIN_EFFECT = 0.05
COMPARE_PLOTS = (
    ("cdfs.png", plots.plot_cdfs, "TTFT, TPOT and end-to-end latency distributions of each run, overlaid."),
    ("latency_vs_users.png", plots.plot_latency_vs_users, "Latency percentiles per concurrency step, one colour per run."),
    ("throughput_vs_users.png", plots.plot_throughput_vs_users, "Throughput and error rate per concurrency step, one colour per run."),
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


def _delta(base: Analysis, other: Analysis, metric: str, alpha: float) -> dict[str, Any]:
    a = base.ok[f"{metric}_s"].dropna().to_numpy()
    b = other.ok[f"{metric}_s"].dropna().to_numpy()
    test = mann_whitney(a, b)
    p50a, p95a = (np.percentile(a, [50, 95]) if a.size else (math.nan, math.nan))
    p50b, p95b = (np.percentile(b, [50, 95]) if b.size else (math.nan, math.nan))
    significant = bool(test["p_value"] < alpha) and abs(test["effect"] - 0.5) >= MIN_EFFECT
    if not significant:
        verdict = "no meaningful difference"
    else:
        verdict = "slower" if test["effect"] > 0.5 else "faster"
    return {
        "metric": metric, "baseline_p50_s": _r(p50a, 6), "p50_s": _r(p50b, 6),
        "delta_p50_s": _r(p50b - p50a, 6), "ratio_p50": _r(p50b / p50a) if p50a else None,
        "baseline_p95_s": _r(p95a, 6), "p95_s": _r(p95b, 6),
        "mann_whitney": {"u": test["u"], "z": _r(test["z"]), "p_value": _r(test["p_value"], 3),
                         "effect_p_slower": _r(test["effect"])},
        "n_baseline": int(a.size), "n": int(b.size), "significant": significant, "verdict": verdict,
    }


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


def compare_runs(run_dirs: Sequence[str | Path], labels: Sequence[str] | None = None,
                 out_dir: str | Path | None = None, *, slo_ttft: float = 1.0, slo_e2e: float = 3.0,
                 alpha: float = ALPHA, console: Console | None = None) -> dict[str, Any]:
    """Compare runs (the first is the baseline); write comparison.json/.html and plots to out_dir.

    out_dir defaults to `compare-<time>` next to the first run.
    """
    if len(run_dirs) < 2:
        raise ConfigError("compare needs at least two run directories")
    slo = Slo(slo_ttft, slo_e2e)
    analyses = [analyze(d, slo, console=console, write=False) for d in run_dirs]
    names = _labels(analyses, labels)
    out = Path(out_dir) if out_dir else Path(run_dirs[0]).resolve().parent / time.strftime("compare-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    base = analyses[0]
    comparison: dict[str, Any] = {
        "baseline": names[0], "alpha": alpha, "min_effect": MIN_EFFECT,
        "test": "two-sided Mann-Whitney U, normal approximation with tie correction",
        "runs": [_run_card(n, a) for n, a in zip(names, analyses)],
        "deltas": [{"label": n, **_delta(base, a, m, alpha)} for n, a in zip(names[1:], analyses[1:]) for m in METRICS],
    }
    views = list(zip(names, analyses))
    figures = []
    if all(len(a.ok) for a in analyses):
        for name, draw, caption in COMPARE_PLOTS:
            figures.append(figure(draw(views, out / "plots" / name), caption))
    comparison["plots"] = [f"plots/{name}" for name, _, _ in COMPARE_PLOTS] if figures else []
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2, default=str) + "\n", encoding="utf-8")
    _write_html(comparison, views, figures, out / "comparison.html")
    comparison["out_dir"] = str(out)
    return comparison


DELTA_HEADERS = ("run", "metric", "baseline p50 s", "p50 s", "Δ p50 s", "ratio", "baseline p95 s", "p95 s",
                 "p-value", "P(slower)", "verdict")


def _delta_row(d: dict[str, Any]) -> list[Any]:
    return [d["label"], d["metric"].upper(), d["baseline_p50_s"], d["p50_s"], d["delta_p50_s"], d["ratio_p50"],
            d["baseline_p95_s"], d["p95_s"], d["mann_whitney"]["p_value"], d["mann_whitney"]["effect_p_slower"],
            d["verdict"]]


def _write_html(comparison: dict[str, Any], views: list[tuple[str, Analysis]], figures: list[str], path: Path) -> None:
    runs = [[r["label"], ", ".join(r["models"]), r["requests"], r["errors"], r["slo_attainment"],
             r["ttft_fit"]["slope_s_per_token"], r["ttft_fit"]["intercept_s"], r["e2e_fit"]["slope_s_per_token"],
             (f"{users(r['breakpoint']['active_users'])} ({r['breakpoint']['reason']})" if r["breakpoint"]
              else "none"), r["bound"]] for r in comparison["runs"]]
    sections = [
        (f"Deltas against {comparison['baseline']} ({h(comparison['test'])}, α = {comparison['alpha']:g})",
         html_table(DELTA_HEADERS, (_delta_row(d) for d in comparison["deltas"]), left=2)),
        ("Runs", html_table(["run", "models", "requests", "errors", "SLO met", "TTFT s/token", "TTFT intercept s",
                             "e2e s/token", "breakpoint", "bound"], runs, left=2)),
    ]
    if figures:
        sections.append(("Charts", "".join(figures)))
    sections += [(f"Verdict: {label}", verdict_html(a.summary)) for label, a in views]
    title = "tokenload comparison: " + " vs ".join(label for label, _ in views)
    path.write_text(page(title, sections), encoding="utf-8")


def comparison_table(comparison: dict[str, Any]) -> Table:
    """Rich table of the deltas, sized for an 80-column terminal (the HTML has the p95 columns)."""
    table = Table(title=f"tokenload compare (baseline {comparison['baseline']}, seconds)", title_justify="left")
    for head in ("run", "metric", "base p50", "p50", "Δ p50", "ratio", "p", "P(slower)", "verdict"):
        table.add_column(head, justify="left" if head in ("run", "metric", "verdict") else "right")
    for d in comparison["deltas"]:
        row = _delta_row(d)
        del row[6:8]
        p_value = d["mann_whitney"]["p_value"]
        row[6] = "<0.001" if p_value is not None and p_value < 0.001 else p_value
        row[8] = "same" if not d["significant"] else d["verdict"]
        style = "" if not d["significant"] else ("red" if d["verdict"] == "slower" else "green")
        table.add_row(*("n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v)) for v in row),
                      style=style)
    return table
