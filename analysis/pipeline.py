"""`analyze_run`: RUN_DIR in, summary.json + plots/*.png + report.html out.

The one entry point the CLI and `tokenload demo` call. Stages report progress
through rich when the run is large enough for the wait to be noticeable.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tokenload.analysis import plots
from tokenload.analysis.records import REQUESTS_FILE, load_run
from tokenload.analysis.report import figure, h, html_table, page, steps_html, verdict_html, verdict_table
from tokenload.analysis.steps import Slo
from tokenload.analysis.summary import Analysis, summarize

# Runs with at least this many rows show a progress bar.
PROGRESS_MIN_ROWS = 100_000
PLOTS: tuple[tuple[str, Callable[..., Path], str], ...] = (
    ("ttft_vs_input.png", plots.plot_ttft_vs_input,
     "TTFT against input length; lines are the fits over the low-load steps (grey points queued and were not fitted)."),
    ("e2e_vs_output.png", plots.plot_e2e_vs_output,
     "Total latency against output length: the least-squares fit and the TTFT + TPOT × N formula with median values."),
    ("latency_vs_users.png", plots.plot_latency_vs_users,
     "TTFT, TPOT and end-to-end p50/p95 per concurrency step; dotted line: breakpoint, dash-dot: SLO."),
    ("throughput_vs_users.png", plots.plot_throughput_vs_users,
     "Output tokens/s, request rate (all and within SLO) and error rate per concurrency step."),
    ("cdfs.png", plots.plot_cdfs, "Distribution of TTFT, TPOT and end-to-end latency over all successful requests."),
    ("timeline.png", plots.plot_timeline,
     "The run over time: active users, request outcomes per second and each request's TTFT."),
)


def _row_count(run_dir: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return int(pq.ParquetFile(run_dir / REQUESTS_FILE).metadata.num_rows)
    except Exception:  # load_run reports a bad file properly; this is only for the progress bar
        return 0


@contextlib.contextmanager
def _stages(console: Console | None, enabled: bool, total: int) -> Iterator[Callable[[str], None]]:
    """Yield `advance(description)`; a no-op unless progress is enabled."""
    if console is None or not enabled:
        yield lambda _desc: None
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    with progress:
        task = progress.add_task("reading records", total=total)
        yield lambda desc: progress.update(task, advance=1, description=desc)


def analyze_run(run_dir: str | Path, slo_ttft: float = 1.0, slo_e2e: float = 3.0, *, slo_target: float = 0.90,
                low_load_users: int | None = None, console: Console | None = None,
                write: bool = True) -> dict[str, Any]:
    """Analyse RUN_DIR, write summary.json, plots/*.png and report.html there, return the summary.

    Raises `ConfigError` when RUN_DIR is not a run (see `records.load_run`).
    With `write=False` only the summary is computed.
    """
    analysis = analyze(run_dir, Slo(slo_ttft, slo_e2e, slo_target), low_load_users, console, write)
    return analysis.summary


def analyze(run_dir: str | Path, slo: Slo = Slo(), low_load_users: int | None = None,
            console: Console | None = None, write: bool = True) -> Analysis:
    """Like `analyze_run` but returns the full `Analysis` (used by comparisons)."""
    path = Path(run_dir)
    enabled = path.is_dir() and _row_count(path) >= PROGRESS_MIN_ROWS
    with _stages(console, enabled, total=3 + len(PLOTS)) as advance:
        run = load_run(path)
        advance("per-step statistics and fits")
        analysis = summarize(run, slo, low_load_users)
        if write:
            advance("writing summary.json")
            (path / "summary.json").write_text(json.dumps(analysis.summary, indent=2, default=str) + "\n",
                                               encoding="utf-8")
            write_report(analysis, path, advance)
    return analysis


def write_report(analysis: Analysis, out_dir: Path, advance: Callable[[str], None] = lambda _d: None) -> Path:
    """Draw the plots into out_dir/plots and write out_dir/report.html."""
    s = analysis.summary
    view = [(s["run"]["label"], analysis)]
    figures: list[str] = []
    if len(analysis.ok):
        for name, draw, caption in PLOTS:
            advance(f"plotting {name}")
            target = out_dir / "plots" / name
            draw(view, target)
            figures.append(figure(target, caption))
    advance("writing report.html")
    sections = [("Verdict", verdict_html(s)),
                ("Diagnosis: " + s["diagnosis"]["bound"] + "-bound",
                 "<ul class='advice'>" + "".join(f"<li>{h(a)}</li>" for a in s["diagnosis"]["advice"]) + "</ul>")]
    if s["problems"]:
        sections.append(("What is missing", "<div class='problems'><ul>" +
                         "".join(f"<li>{h(p)}</li>" for p in s["problems"]) + "</ul></div>"))
    if figures:
        sections.append(("Charts", "".join(figures)))
    sections += _tables(s)
    target = out_dir / "report.html"
    target.write_text(page(f"tokenload report: {s['run']['label']}", sections), encoding="utf-8")
    return target


def _tables(s: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    if s["steps"]:
        out.append(("Per step (times in seconds)", steps_html(s["steps"])))
    rules = s["breakpoint_rules"]
    if rules:
        out.append(("Breakpoint rules", html_table(
            ["rule", "fired", "at users", "detail"],
            [[name, r["fired"], r.get("active_users", ""), r.get("detail", "")] for name, r in rules.items()], left=4)))
    if s["errors_by_kind"]:
        out.append(("Errors by kind", html_table(["kind", "count"], sorted(s["errors_by_kind"].items()))))
    fit_rows = []
    for name, fit in s["fits"].items():
        fit_rows.append([name, fit.get("model", "linear"), fit.get("slope_s_per_token"), fit.get("intercept_s"),
                         fit.get("exponent", 1.0), fit.get("r2"), fit.get("n"),
                         " / ".join(f"{v:.4g}" for v in fit.get("slope_ci95") or fit.get("linear", {}).get("slope_ci95", []))])
    out.append(("Fits (low-load steps: " + h(s["fits"]["ttft_vs_input"].get("steps_used_reason", "")) + ")",
                html_table(["fit", "model", "slope s/token", "intercept s", "exponent", "R²", "n",
                            "slope 95% CI (linear)"], fit_rows, left=2)))
    f = s["formula"]
    out.append(("Formula", html_table(["form", "MAPE"], [["TTFT + TPOT × N", f.get("mape_simple")],
                                                         ["TTFT + TPOT × (N − 1)", f.get("mape_exact")]])))
    run = s["run"]
    meta = [["run id", run.get("run_id")], ["run dir", run.get("run_dir")], ["models", ", ".join(run["models"])],
            ["scenario", run.get("scenario")], ["channel", json.dumps(run.get("channel"))],
            ["scheduler lag", json.dumps(run.get("scheduler_lag"))], ["duration s", run.get("duration_s")]]
    out.append(("Run", html_table(["", "value"], meta, left=2)))
    return out


def print_verdict(summary: dict[str, Any], console: Console | None = None) -> None:
    """Print the verdict table (the demo calls this after `analyze_run`)."""
    (console or Console()).print(verdict_table(summary))
