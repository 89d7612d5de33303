"""The tokenload tab in Locust's web UI, its CSV downloads, and the `--csv` file of token statistics.

Locust (>= 2.22) builds extra tabs from `web_ui.template_args`: `extended_tabs`
names the tab, `extended_tables` its columns, and the rows come with every
`/stats/requests` poll as `extended_stats` (added here by an `after_request`
hook, so they refresh with Locust's own table, every 2 s). The rows are the
current run's load steps and an "Aggregated" row: requests, failures, rates,
tokens/s and TTFT, TPOT, ITL and e2e p50 / p95 / p99, plus the error kinds.

Locust's extended tabs hold one table only; the charts over time (TTFT p50/p95,
TPOT p50/p95, output tokens/s) and the links to each finished run's
report.html come from a small script (`static/tokenload.js`) that the
hook adds to Locust's page: it draws them under the table while the tokenload
tab is open, from `tokenload/stats.json`. `extended_csv_files` puts the token
statistics CSV next to Locust's own downloads; with `--csv PREFIX`
(headless runs) the same table is written to `PREFIX_tokenload.csv` every
few seconds and at exit, like Locust's `PREFIX_stats.csv`. Like Locust's own
numbers, a headless master's file misses what workers finish after they are
told to quit (Locust gives their last report 0.5 s); requests.parquet has
every request.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
from flask import Blueprint, Response, abort, request, send_file
from locust import events
from locust.env import Environment

from tokenload.load import roles
from tokenload.load.control import CONTROL
from tokenload.load.series import REPORT_FILE, SERIES, Series
from tokenload.load.tokenstats import METRICS, PERCENTILES, Cell, RunStats, current_run
from tokenload.servermetrics.scrape import read_live

TAB = "tokenload"
STATIC_DIR = Path(__file__).parent / "static"
CSV_SUFFIX = "_tokenload.csv"
CSV_EVERY_S = 2.0
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}
# The tab's columns: (key, title). Times in ms like Locust's own table; each cell holds p50 / p95 / p99.
COLUMNS = (("name", "Step"), ("users", "Users"), ("requests", "Requests"), ("failures", "Failures"),
           ("rps", "Req/s"), *((m, f"{_LABELS[m]} ms p50 / p95 / p99") for m in METRICS),
           ("input_tok_s", "Input tok/s"), ("output_tok_s", "Output tok/s"), ("error_kinds", "Error kinds"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}" if value >= 0.01 else f"{value * 1000:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


Windows = dict[str, float]  # row name ("step N", "Aggregated") -> wall seconds it covers


def windows(environment: Environment) -> Windows:
    """The wall time each step of the current run lasted (so far, for the running one) and the run's.

    The rates divide by these: over the span of the requests alone a burst of fast
    failures read hundreds of requests a second. Empty once the run's control is
    gone (a finalised web-UI run): the rates then fall back to that span.
    """
    control = roles.of(environment).get(CONTROL)
    steps = control.steps if control is not None else []
    now = time.time()
    out = {f"step {s['step']}": max(0.0, s.get("ended_at", now) - s["started_at"]) for s in steps}
    if steps:
        out["Aggregated"] = max(0.0, steps[-1].get("ended_at", now) - steps[0]["started_at"])
    return out


def _named_cells(stats: RunStats) -> list[tuple[str, Cell]]:
    steps = [(f"step {k}", stats.steps[k]) for k in sorted(stats.steps)]
    return [*steps, ("Aggregated", stats.total())]


def table_rows(stats: RunStats, elapsed: Windows | None = None) -> list[dict[str, Any]]:
    """The tab's rows: one per load step, then the whole run (rates over `elapsed`: `windows`)."""
    rows = []
    for name, cell in _named_cells(stats):
        s = cell.summary((elapsed or {}).get(name))
        row: dict[str, Any] = {"name": name, "users": s["users"], "requests": s["requests"], "failures": s["errors"],
                               "rps": _rate(s["rps"]), "input_tok_s": _rate(s["input_tok_s"]),
                               "output_tok_s": _rate(s["output_tok_s"]),
                               "error_kinds": ", ".join(f"{k} {n}" for k, n in s["error_kinds"].items()) or "-"}
        for metric in METRICS:
            row[metric] = " / ".join(_ms(s[f"{metric}_p{p}_s"]) for p in PERCENTILES)
        rows.append(row)
    return rows


def csv_text(stats: RunStats, elapsed: Windows | None = None) -> str:
    """The token statistics as CSV, Locust-style: one row per step and an Aggregated row, times in ms; rates
    over `elapsed` (`windows`)."""
    out = io.StringIO()
    writer = csv.writer(out)
    head = ["Step", "Users", "Request Count", "Failure Count", "Requests/s", "Input Tokens/s", "Output Tokens/s",
            *(f"{_LABELS[m]} {p}% (ms)" for m in METRICS for p in PERCENTILES), "Error Kinds"]
    writer.writerow(head)
    for name, cell in _named_cells(stats):
        s = cell.summary((elapsed or {}).get(name))
        times = [None if s[f"{m}_p{p}_s"] is None else round(s[f"{m}_p{p}_s"] * 1000, 2)
                 for m in METRICS for p in PERCENTILES]
        writer.writerow([name, s["users"], s["requests"], s["errors"], *(None if s[k] is None else round(s[k], 3)
                         for k in ("rps", "input_tok_s", "output_tok_s")), *times,
                         ";".join(f"{k}={n}" for k, n in s["error_kinds"].items())])
    return out.getvalue()


def stats_payload(environment: Environment, series: Series) -> dict[str, Any]:
    """What the tab's script draws: the current run's rows and time series, and every run of the session."""
    stats = current_run(environment)
    elapsed = windows(environment)
    return {"run": series.current.public(), "rows": table_rows(stats, elapsed),
            "summary": stats.total().summary(elapsed.get("Aggregated")),
            "series": stats.timeline(), "runs": [run.public() for run in series.runs],
            "server": (read_live() or {}).get("gauges")}


@events.init.add_listener
def _init(environment: Environment, **_: Any) -> None:
    """After the load plugin's own `init` (the locustfile imports it first): where it leads a series of runs."""
    role = roles.find(environment)
    series = role.get(SERIES) if role is not None else None
    if series is not None:
        install(environment, series)


def install(environment: Environment, series: Series) -> None:
    """Add the tab and routes to the web UI (when there is one) and the `--csv` token statistics file."""
    opts = environment.parsed_options
    prefix = getattr(opts, "csv_prefix", None)
    if prefix:
        _write_csv_forever(environment, Path(f"{prefix}{CSV_SUFFIX}"))
    if environment.web_ui is not None:
        _install_tab(environment, series)


def _write_csv_forever(environment: Environment, path: Path) -> None:
    def write(**_: Any) -> None:
        path.write_text(csv_text(current_run(environment), windows(environment)), encoding="utf-8")

    def loop() -> None:
        while True:
            gevent.sleep(CSV_EVERY_S)
            write()

    gevent.spawn(loop)
    environment.events.quit.add_listener(write)


def _install_tab(environment: Environment, series: Series) -> None:
    web_ui = environment.web_ui
    assert web_ui is not None and web_ui.app is not None
    app = web_ui.app
    base = (environment.parsed_options.web_base_path or "") if environment.parsed_options else ""
    web_ui.template_args.update(
        extended_tabs=[{"title": "tokenload", "key": TAB}],
        extended_tables=[{"key": TAB, "structure": [{"key": k, "title": t} for k, t in COLUMNS]}],
        extended_csv_files=[{"href": "./tokenload/stats.csv", "title": "Download tokenload token statistics CSV"}],
    )
    page = Blueprint(TAB, __name__, static_folder=str(STATIC_DIR), static_url_path="/static")
    _routes(page, environment, series, web_ui.auth_required_if_enabled)
    app.register_blueprint(page, url_prefix=f"{base}/tokenload")
    index, stats_path, swarm = f"{base}/", f"{base}/stats/requests", f"{base}/swarm"
    script = b'<script src="./tokenload/static/tokenload.js"></script></body>'

    @app.before_request
    def new_run_per_start() -> None:
        if request.method == "POST" and request.path == swarm:
            series.next_run()

    @app.after_request
    def extend(response: Response) -> Response:
        if request.path == stats_path and response.is_json:
            data = response.get_json()
            data["extended_stats"] = [{"key": TAB, "data": table_rows(current_run(environment), windows(environment))}]
            response.set_data(json.dumps(data))
        elif request.path == index and response.mimetype == "text/html" and not response.direct_passthrough:
            response.set_data(response.get_data().replace(b"</body>", script, 1))
        return response


def _routes(page: Blueprint, environment: Environment, series: Series,
            auth: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    @page.route("/stats.json")
    @auth
    def stats_json() -> Response:
        return Response(json.dumps(stats_payload(environment, series)), mimetype="application/json")

    @page.route("/stats.csv")
    @auth
    def stats_csv() -> Response:
        run = series.current
        return Response(csv_text(current_run(environment), windows(environment)), mimetype="text/csv", headers={
            "Content-Disposition": f"attachment;filename=tokenload_{run.run_id}_tokens.csv"})

    @page.route("/runs/<int:number>/report.html")
    @auth
    def report(number: int) -> Response:
        run = next((r for r in series.runs if r.number == number), None)
        if run is None or not (run.run_dir / REPORT_FILE).is_file():
            abort(404)
        return send_file((run.run_dir / REPORT_FILE).resolve(), mimetype="text/html", max_age=0)
