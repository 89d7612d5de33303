"""`analyze_run`: RUN_DIR in, summary.json + plots/*.png + report.html out.

The one entry point the CLI and `tokenload demo` call. Stages report progress
through rich when the run is large enough for the wait to be noticeable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tokenload.analysis import attribution, caching, levers, models, plots, serverplot
from tokenload.analysis.ratelimits import rate_limits_html
from tokenload.analysis.records import REQUESTS_FILE, load_run
from tokenload.analysis.report import (
    figure,
    h,
    html_table,
    page,
    probes_html,
    slope_text,
    steps_html,
    verdict_html,
    verdict_table,
)
from tokenload.analysis.search import search_summary
from tokenload.analysis.steps import StepOptions
from tokenload.analysis.summary import Analysis, summarize
from tokenload.analysis.thresholds import judge as judge_thresholds
from tokenload.analysis.windows import level_text
from tokenload.contracts.manifest import Manifest
from tokenload.contracts.summary import Summary
from tokenload.errors import ConfigError, error_class
from tokenload.slo import Slo
from tokenload.thresholds import Threshold
from tokenload.thresholds import parse as parse_threshold

# Runs with at least this many rows show a progress bar.
PROGRESS_MIN_ROWS = 100_000
PLOTS: tuple[tuple[str, Callable[..., Path], str], ...] = (
    ("ttft_vs_input.png", plots.plot_ttft_vs_input,
     "TTFT against input length; lines are the fits over the low-load steps (grey points queued and were not fitted)."),
    ("e2e_vs_output.png", plots.plot_e2e_vs_output,
     "Total latency against output length: the least-squares fit and the TTFT + TPOT × N formula with median values."),
    ("latency_vs_users.png", plots.plot_latency_vs_users,
     "TTFT, TPOT and end-to-end p50/p95 per load step with 95% bootstrap bands; x marks a step with too few "
     "requests to judge; dotted line: breakpoint, dash-dot: SLO."),
    ("throughput_vs_users.png", plots.plot_throughput_vs_users,
     "Output and total tokens/s counted in each step's window (warm-up requests included: the channel served "
     "them), completed requests/s (all, and the step's own requests within the SLO) and error rates per load "
     "step; hollow: a window shorter than 5 of its requests (a search's short probe), whose count spans the "
     "level's start and is no steady rate."),
    ("itl_vs_load.png", plots.plot_itl,
     "Inter-token latency per step: per request the median and the 99th-percentile gap between streamed tokens, "
     "then the median over the step's requests (stalls show as a p99 far above the median)."),
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


def analyze_run(run_dir: str | Path, slo: Slo | None = None, *, slo_overrides: Mapping[str, Any] | None = None,
                low_load_users: int | None = None, console: Console | None = None,
                write: bool = True, options: StepOptions | None = None,
                thresholds: Sequence[Threshold] = ()) -> Summary:
    """Analyse RUN_DIR, write summary.json, plots/*.png and report.html there, return the summary.

    Raises `ConfigError` when RUN_DIR is not a run (see `records.load_run`).
    With `write=False` only the summary is computed. The SLO is `slo`, else the run's own
    (its scenario's `[slo]`), with `slo_overrides` (the `--slo-*` flags) applied. `options`
    (percentiles, warm-up, goodput) default to the run's scenario: its `[load] step_warmup_s`,
    p50/p95/p99, SLO goodput. The run's own thresholds (its scenario's `[thresholds]`) and `thresholds` are
    judged into `thresholds[]`.
    """
    analysis = analyze(run_dir, slo, low_load_users, console, write, options, slo_overrides=slo_overrides,
                       thresholds=thresholds)
    return analysis.summary


def scenario_slo(manifest: Manifest) -> Slo:
    """The SLO the run was planned with: its resolved scenario's `[slo]` (runs without one: the default)."""
    table = (manifest.get("scenario") or {}).get("slo")
    try:
        return Slo.from_dict(table if isinstance(table, dict) else None)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"manifest.json's scenario [slo] is not valid ({exc}): give the SLO with the --slo-* "
                          "flags") from None


def resolve_slo(manifest: Manifest, overrides: Mapping[str, Any] | None) -> Slo:
    """The run's own SLO with the `--slo-*` flags' fields replaced."""
    return dataclasses.replace(scenario_slo(manifest), **(overrides or {}))


def scenario_thresholds(manifest: Manifest) -> tuple[list[Threshold], str]:
    """The thresholds the run was planned with (its resolved scenario's `[thresholds]`, `run --threshold`
    included), and what an inconclusive one counts as."""
    table = (manifest.get("scenario") or {}).get("thresholds") or {}
    checks = [parse_threshold(c["expr"], abort_on_fail=bool(c.get("abort_on_fail"))) for c in table.get("checks", [])]
    return checks, str(table.get("inconclusive") or "pass")


def scenario_warmup(manifest: Manifest) -> float:
    """The run's own `[load] step_warmup_s` (0 when the scenario set none)."""
    value = ((manifest.get("scenario") or {}).get("load") or {}).get("step_warmup_s", 0.0)
    return float(value) if isinstance(value, (int, float)) and value >= 0 else 0.0


def analyze(run_dir: str | Path, slo: Slo | None = None, low_load_users: int | None = None,
            console: Console | None = None, write: bool = True, options: StepOptions | None = None, *,
            slo_overrides: Mapping[str, Any] | None = None, thresholds: Sequence[Threshold] = (),
            model: str | None = None) -> Analysis:
    """Like `analyze_run` but returns the full `Analysis` (used by comparisons); `model`: that model's requests
    only (a comparison of a run's models)."""
    path = Path(run_dir)
    enabled = path.is_dir() and _row_count(path) >= PROGRESS_MIN_ROWS
    with _stages(console, enabled, total=3 + len(PLOTS)) as advance:
        run = load_run(path)
        if model is not None:
            run = dataclasses.replace(run, df=run.df[run.df["model"].astype(str) == model].reset_index(drop=True),
                                      sample=run.sample and dataclasses.replace(run.sample, model=model))
        advance("per-step statistics and fits")
        if slo is None:
            slo = resolve_slo(run.manifest, slo_overrides)
        options = options or StepOptions()
        if options.warmup_s is None:
            options = dataclasses.replace(options, warmup_s=scenario_warmup(run.manifest))
        # The probes are recounted against the SLO the run decided them by, whatever the flags say.
        search = search_summary(run, scenario_slo(run.manifest), options.percentiles)
        analysis = summarize(run, slo, low_load_users, options, search)
        for attach in (models.attach, attribution.attach, levers.attach):  # per model, which factor, which lever
            attach(analysis)
        analysis.summary["thresholds"] = judge_thresholds(analysis, [*scenario_thresholds(run.manifest)[0], *thresholds])
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
        drawn = serverplot.plot_server_gauges(analysis, out_dir / "plots" / serverplot.NAME)
        if drawn is not None:
            figures.append(figure(drawn, serverplot.CAPTION))
    advance("writing report.html")
    sections = [("Which lever", levers.levers_html(s))] if s.get("lever_baseline") else []
    sections.append(("Verdict", verdict_html(s)))
    if search := s.get("search"):
        sections.append(("Probes: each judged on its own requests, at its own load (times in seconds)",
                         probes_html(search, s["analysis_options"]["percentiles"])))
    sections.append(("Diagnosis: " + (f"{s['diagnosis']['bound']}-bound" if s["diagnosis"]["bound"]
                                      else "bound not determined"),
                     "<ul class='advice'>" + "".join(f"<li>{h(a)}</li>" for a in s["diagnosis"]["advice"]) + "</ul>"))
    factor = attribution.attribution_html(s)
    if factor:
        sections.append(("Which factor: TTFT, TPOT and e2e over input length, output length, model size and load",
                         factor))
    if s["problems"]:
        sections.append(("What is missing", "<div class='problems'><ul>" +
                         "".join(f"<li>{h(p)}</li>" for p in s["problems"]) + "</ul></div>"))
    if search := s.get("search"):
        target = plots.plot_capacity([(s["run"]["label"], search)], out_dir / "plots" / "capacity.png")
        figures.insert(0, figure(target, "The breakpoint search: each probe's SLO attainment (95% interval) and "
                                         "goodput, numbered in the order the probes ran; shaded: where the boundary "
                                         "lies; dash-dot: the SLO target."))
    if figures:
        sections.append(("Charts", "".join(figures)))
    sections.append(serverplot.report_section(s))
    if caching.report_rows(s):
        sections.append(("Prompt caching", html_table(["", "value"], caching.report_rows(s), left=2)))
    sections += [("Rate limits", rate_limits_html(s["rate_limits"]))] + _tables(s)
    target = out_dir / "report.html"
    target.write_text(page(f"tokenload report: {s['run']['label']}", sections), encoding="utf-8")
    return target


def _channel_text(channel: Any) -> str:
    """'anthropic · http://host/api · model sim-7b' (the manifest's channel has no secrets)."""
    if not isinstance(channel, dict):
        return str(channel or "n/a")
    models = channel.get("models") or channel.get("model")
    models = ", ".join(models) if isinstance(models, list) else models
    return " · ".join(str(v) for v in (channel.get("protocol"), channel.get("base_url"),
                                       f"model {models}" if models else None) if v)


def _lag_text(lag: Any) -> str:
    if not isinstance(lag, dict) or not lag:
        return "not recorded"
    parts = [f"{k.replace('_', ' ')} {v:.3g}" for k, v in lag.items() if isinstance(v, (int, float))]
    return "; ".join(parts + [str(lag["warning"])] if lag.get("warning") else parts) or "not recorded"


def _tables(s: Summary) -> list[tuple[str, str]]:
    out = []
    opts = s["analysis_options"]
    if s["steps"]:
        out.append(("Per step (times in seconds)", steps_html(s["steps"], opts["percentiles"])))
    goodput = opts.get("goodput_s")
    settings = [["warm-up excluded per step", f"{opts['warmup_s'] or 0:g} s (requests started in each step's first "
                 "seconds; scenario [load] step_warmup_s or analyze --warmup)"],
                ["percentiles", ", ".join(f"p{p:g}" for p in opts["percentiles"])],
                ["SLO", f"{s['slo']['describe']}; load errors <= {100 * s['slo']['max_error_rate']:g}% per step "
                        "(configuration and input errors are not judged)"],
                ["goodput criteria", ", ".join(f"{k} <= {1000 * v:g} ms" for k, v in goodput.items()) if goodput
                 else "the SLO"],
                ["a step decides the breakpoint from", f"{opts['min_step_requests']} finished requests"],
                ["throughput", "tokens counted in the window they were streamed (each request's output spread "
                 "between its first and last token), input tokens at the first token, requests at completion"]]
    out.append(("How the numbers were made", html_table(["", "setting"], settings, left=2)))
    rules = cast("dict[str, Mapping[str, Any]]", s["breakpoint_rules"])
    if rules:
        out.append(("Breakpoint rules", html_table(
            ["rule", "fired", "at", "detail"],
            [[name, r["fired"], level_text(r["load_level"], r["load_unit"]) if r["fired"] else "",
              r.get("detail", "")] for name, r in rules.items()], left=4)))
    if s["errors_by_kind"]:
        classes = {k: error_class(k) for k in s["errors_by_kind"]}
        out.append(("Errors by kind", html_table(["kind", "class", "count"],
                                                 sorted([k, classes[k], v] for k, v in s["errors_by_kind"].items()),
                                                 left=2)))
    fit_rows = []
    fits: dict[str, Mapping[str, Any]] = {"ttft_vs_input": s["fits"]["ttft_vs_input"],
                                          "e2e_vs_output": s["fits"]["e2e_vs_output"]}
    for name, fit in fits.items():
        slope = slope_text(fit) if fit.get("slope_s_per_token") is not None else None
        fit_rows.append([name, fit.get("model") or "not fitted", slope, fit.get("intercept_s"),
                         fit.get("exponent", 1.0), fit.get("r2"), fit.get("n"),
                         " / ".join(f"{v:.4g}" for v in fit.get("slope_ci95") or fit.get("linear", {}).get("slope_ci95", [])),
                         fit.get("note") or fit.get("intercept_check") or ""])
    out.append(("Fits (low-load steps: " + s["fits"]["ttft_vs_input"].get("steps_used_reason", "") + ")",
                html_table(["fit", "model", "slope", "intercept s", "exponent", "R²", "n",
                            "slope 95% CI (linear)", "note"], fit_rows, left=2)))
    f = s["formula"]
    out.append(("Formula: e2e predicted from each step's typical (median) TTFT and TPOT", html_table(
        ["form", "MAPE", "what it tests"],
        [["TTFT + TPOT × N", f.get("mape_simple"), "the form users quote, with typical values"],
         ["TTFT + TPOT × (N − 1)", f.get("mape_exact"), "the exact form, with typical values: fails when TPOT or "
                                                         "queueing vary a lot within a step"],
         ["e2e fit residuals", s["fits"]["e2e_vs_output"].get("residual_mape"),
          "how far single requests fall from the fitted line"]], left=1)))
    run = s["run"]
    complete = run.get("completeness") or {}
    meta: list[list[Any]] = [["run id", run.get("run_id")], ["run dir", run.get("run_dir")], ["models", ", ".join(run["models"])],
            ["scenario", run.get("scenario")], ["load", f"{run.get('load_kind') or 'unknown'} ({run.get('load_unit')})"],
            ["stopped because", complete.get("stop_reason") or "not recorded"],
            ["channel", _channel_text(run.get("channel"))], ["scheduler lag (s)", _lag_text(run.get("scheduler_lag"))],
            ["duration s", run.get("duration_s")]]
    out.append(("Run", html_table(["", "value"], meta, left=2)))
    return out


def print_verdict(summary: Summary, console: Console | None = None) -> None:
    """Print the lever table, when the run can speak to one, then the verdict table (the demo calls this after
    `analyze_run`)."""
    console = console or Console()
    if summary.get("lever_baseline"):
        console.print(levers.levers_rich(summary))
    console.print(verdict_table(summary))
