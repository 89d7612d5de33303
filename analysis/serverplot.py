"""The report's panel of the server's own gauges over the run, with the load steps marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tokenload.analysis.plots import COLORS, _save, plt
from tokenload.analysis.report import h, html_table
from tokenload.analysis.summary import Analysis
from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import StepServer, Summary
from tokenload.rundir import SERVER_METRICS_FILE
from tokenload.servermetrics import series

NAME = "server_gauges.png"
CAPTION = ("The server's own view, scraped from its Prometheus metrics: requests running in its batch and waiting "
           "for a slot, and its KV-cache usage, over the run; dotted lines mark the load steps.")


def plot_server_gauges(analysis: Analysis, path: Path) -> Path | None:
    """Draw the panel; None when the run sampled no server gauge (nothing to draw)."""
    raw = series.load(analysis.run.run_dir / SERVER_METRICS_FILE)
    if raw is None or raw.empty or analysis.run.df.empty:
        return None
    df = series.mapped(raw)
    gauges = [t for t in ("running", "waiting", "kv_cache_usage") if t in series.terms(df)]
    if not gauges:
        return None
    t0 = float(analysis.run.df["started_at"].min())
    kv = "kv_cache_usage" in gauges
    fig, axes = plt.subplots(2 if kv else 1, 1, figsize=(11, 5.5 if kv else 3.5), sharex=True, squeeze=False)
    top = axes[0][0]
    for i, term in enumerate(t for t in gauges if t != "kv_cache_usage"):
        line = series.gauge_timeline(df, term)
        top.step(line.index.to_numpy() - t0, line.to_numpy(), where="post", color=COLORS[i], label=term)
    top.set(ylabel="requests", title="Server gauges (scraped)")
    top.legend(fontsize=8, loc="upper left")
    if kv:
        line = series.gauge_timeline(df, "kv_cache_usage")
        axes[1][0].plot(line.index.to_numpy() - t0, 100 * line.to_numpy(), color=COLORS[2], label="KV cache usage")
        axes[1][0].set(ylabel="KV cache used (%)", ylim=(0, 105))
    bottom = axes[-1][0]
    bottom.set(xlabel="seconds since the first request")
    for _, step in analysis.table.iterrows():
        began = float(step["start"]) - (analysis.options.warmup_s or 0.0) - t0  # the table's start is after warm-up
        for row in axes:
            row[0].axvline(began, color="grey", ls=":", lw=1)
        top.annotate(level_text(step["load_level"], str(step["load_unit"])), (began, 1.0),
                     xycoords=("data", "axes fraction"), fontsize=7, va="top", ha="left", color="grey")
    for row in axes:
        row[0].grid(alpha=0.3)
    if not np.isfinite(top.get_ylim()).all():
        top.set_ylim(0, 1)
    return _save(fig, path)


def report_section(summary: Summary) -> tuple[str, str]:
    """The report's "Server side" section: the cause, and the per-step numbers the server reported."""
    view = summary.get("server_metrics") or {}
    if view.get("sources") and not view.get("terms"):
        return "Server side", (f"<p>Scraped from {h(', '.join(view['sources']))}, but none of its "
                               f"{view.get('raw_names', 0)} metric names is in tokenload's vocabulary (see "
                               "docs/server-metrics.md); they are kept raw in server_metrics.parquet.</p>")
    if not view.get("terms"):
        return "Server side", f"<p>{h(view.get('note') or 'no server metrics were sampled in this run')}</p>"
    found = ", ".join(view.get("servers") or []) or "no known server names"
    head = f"<p>Scraped from {h(', '.join(view.get('sources') or []))} ({h(found)}).</p>"
    cause = view.get("cause")
    if cause:
        head += f"<p><b>{h(cause['text'])}</b></p>"
    columns = ("running_mean", "waiting_mean", "kv_cache_usage_mean", "queue_time_p50_s", "server_ttft_p50_s",
               "client_minus_server_ttft_p50_s")
    shown = [c for c in columns if any(c in (s.get("server") or {}) for s in summary["steps"])]
    rows = [[level_text(s["load_level"], s["load_unit"]), s.get("ttft_p50_s"),
             *((s.get("server") or {}).get(c) for c in shown)] for s in summary["steps"]]
    return "Server side", head + html_table(["load", "client ttft_p50_s", *shown], rows, left=1)


def side_by_side(base: Summary, step_base: int, other: Summary, step: int) -> dict[str, StepServer] | None:
    """`compare`: one matched load level's `steps[].server` of both runs; None when neither run has one."""
    def server(summary: Summary, index: int) -> StepServer:
        return next((s.get("server") or StepServer() for s in summary["steps"] if s["step"] == index), StepServer())

    pair = {"baseline": server(base, step_base), "run": server(other, step)}
    return pair if pair["baseline"] or pair["run"] else None


def compare_section(comparison: dict[str, Any]) -> tuple[str, str] | None:
    """`compare`'s "Server side" table: both runs' server numbers per matched load level, and each run's cause."""
    levels = [x for x in comparison["levels"] if x.get("server")]
    if not levels:
        return None
    columns = ("running_mean", "waiting_mean", "kv_cache_usage_mean", "queue_time_p50_s", "server_ttft_p50_s",
               "client_minus_server_ttft_p50_s")
    shown = [c for c in columns if any(c in x["server"]["baseline"] or c in x["server"]["run"] for x in levels)]
    rows = []
    for x in levels:
        for side, name in (("baseline", comparison["baseline"]), ("run", x["label"])):
            rows.append([name, x["load"], *(x["server"][side].get(c) for c in shown)])
    causes = "".join(f"<li>{h(r['label'])}: {h(r['server_cause'] or 'no server-side cause found')}</li>"
                     for r in comparison["runs"] if "server_cause" in r)
    return "Server side, matched by load level", html_table(["run", "load", *shown], rows, left=2) + (
        f"<ul class='advice'>{causes}</ul>" if causes else "")
