"""Run a load scenario with Locust and record every request.

SCENARIO is a .toml file (see `scenarios/`) or the name of a packaged
scenario (listed below). Locust runs headless in a child process; a live line on stderr shows the step, users, request rate,
TTFT/TPOT p50/p95 of the current step and errors.

`--web` runs the scenario in Locust's web UI instead (on 127.0.0.1 unless
`--web-host`): the UI's URL is printed on a line of its own as soon as it
answers, the scenario starts at once, and the UI stays up after the plan ends
until Ctrl-C. Its tokenload tab shows live TTFT, TPOT, ITL and e2e percentiles,
tokens/s and error kinds per step, charts over time, and a link to each
finished run's report.html. Every start in the UI is a run directory of its
own (RUN_DIR, RUN_DIR-2, ...), finalised and analysed when it stops; at Ctrl-C
they are all printed, the last one last.

The scenario's [channel] values are defaults: the CHANNEL flags, the
environment and settings.json win over them, and the channel line says where
each value came from. Everything (scenario, dataset, options, --out) is checked
before Locust starts: a problem is one line and exit code 2. The --slo-*
flags override the scenario's [slo] table before the run, so manifest.json's
resolved scenario carries the SLO that `tokenload analyze` then judges by.

Records are flushed to RUN_DIR at least once a second, so Ctrl-C or SIGTERM
keeps them (a second one kills Locust and may lose the last second); Ctrl-C
works even when this command was started with SIGINT ignored (`&` in a
script), and with `--web` it quits the UI too. Locust never outlives this
command: killed even with SIGKILL, its Locust processes (web UI included)
stop within a second or two, cutting their open streams (kept as `cancelled`
records), and `tokenload analyze RUN_DIR` finalises what they flushed.
`--web` checks its port first: a port in use is one line and exit 2.
At the end RUN_DIR
holds requests.parquet (one row per request, columns defined in
tokenload/record.py) and manifest.json;
RUN_DIR is printed as the last line of stdout, ready for `tokenload analyze`.
Errors are listed by kind with the fix. A run whose requests fail on the
channel's configuration (auth, unknown model, wrong base URL) stops after a
handful of them in a row (`[stop] config_errors`, default 5) with doctor's
finding and fix, instead of hammering the channel; a 429/529/503 makes the
users back off as the server asks (see README, "Kind to the channel").
Exit code 1 when no request succeeded, or when a Locust worker was lost (killed
or crashed) mid-run: RUN_DIR is still finalised with everything it flushed, and
manifest.json names it in `workers_lost` and `warnings`.

While it runs, the line above it warns once when the load generator itself is
the bottleneck (its event loop wakes late, with healthy responses) and says
what helps: `--processes auto` when cores are idle, more cores or fewer users
when every core already runs a process.

Distributed: `--processes N` forks N local workers (`--processes auto`: one per
core this command may use, e.g. under `taskset`); across machines start
`tokenload run SCENARIO --master --master-bind-host ADDR --expect-workers N
--out DIR` and on each machine `tokenload run SCENARIO --worker --master-host
ADDR --out SPOOL`. No shared filesystem is needed: workers take the master's
run id and resolved scenario over Locust's channel and send their records to
the master the same way; a worker's --out holds its log and the records the
master has not acknowledged yet (a worker given the master's own DIR on a
shared filesystem writes into it directly). The master waits for each
worker's last records, then finalises.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenload.channel import add_channel_arguments
from tokenload.commands import threshold_flags
from tokenload.commands.prometheus_flags import add_prometheus_arguments, linger, serve_from_args
from tokenload.commands.slo_flags import add_slo_arguments, slo_from_args
from tokenload.workload.scenario import SCHEMA_HELP, ThresholdsSection, packaged_names

if TYPE_CHECKING:
    from rich.console import Console

HELP = "run a load scenario with Locust; prints the run directory last"
__doc__ = f"{__doc__}\nPackaged scenarios: {', '.join(packaged_names())}.\n\nScenario file {SCHEMA_HELP}"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO", help=f"scenario .toml or packaged name ({', '.join(packaged_names())})")
    parser.add_argument("--out", metavar="DIR", help="run directory (default results/<scenario>-<timestamp>); "
                        "--worker: its log and spool (default results/<scenario>-worker-<timestamp>)")
    parser.add_argument("--users", type=int, help="cap users: constant load of N, a ramp up to N, or an open-loop pool of N")
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds (caps the scenario's plan)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the breakpoint search of a stopped run (Ctrl-C, crash, budget) in a new run "
                             "directory: its decided probes are not repeated; same scenario and SLO required")
    parser.add_argument("--processes", metavar="N|auto",
                        help="fork N >= 1 local Locust worker processes; auto: one per core this command may use "
                             "(one process on a single core)")
    parser.add_argument("--web", action="store_true",
                        help="run in Locust's web UI (with a tokenload tab) instead of headless: it prints its URL, "
                             "starts the scenario, and stays up after the plan ends until Ctrl-C; every start in the "
                             "UI is a new run directory (DIR, DIR-2, ...)")
    parser.add_argument("--web-host", default="127.0.0.1", metavar="ADDR",
                        help="--web: interface the UI listens on (default 127.0.0.1)")
    parser.add_argument("--web-port", type=int, metavar="N",
                        help="--web: the UI's port (default $LOCUST_WEB_PORT, else 8089)")
    parser.add_argument("--server-metrics", action="append", metavar="URL",
                        help="the inference server's Prometheus metrics address, sampled every second during the "
                             "run into server_metrics.parquet (repeatable; replaces [server] metrics_url); without "
                             "it the base URL's origin + /metrics is tried once (see docs/server-metrics.md)")
    add_slo_arguments(parser)
    threshold_flags.add_threshold_arguments(parser)
    add_prometheus_arguments(parser, "the run's records (all workers'; the master or the single process, headless)")
    dist = parser.add_argument_group("distributed across machines")
    dist.add_argument("--master", action="store_true", help="run as Locust master")
    dist.add_argument("--expect-workers", type=int, default=1, metavar="N", help="master: workers to wait for (default 1)")
    dist.add_argument("--worker", action="store_true", help="run as Locust worker of --master-host")
    dist.add_argument("--master-host", default="127.0.0.1", help="worker: the master's address")
    dist.add_argument("--master-port", type=int, default=5557, help="master port (default 5557)")
    dist.add_argument("--master-bind-host", default="127.0.0.1",
                      help="master: interface to listen on (default 127.0.0.1; give the machine's address for "
                           "workers on other machines)")
    add_channel_arguments(parser, several_models=True)


def live_line(live: dict) -> str:
    """The live status line of a running scenario (also `tokenload demo`'s)."""

    def ms(key: str) -> str:
        value = live.get(key)
        return "-" if value is None else f"{value * 1000:.0f}"

    from tokenload.servermetrics.scrape import describe

    server = live.get("server") or {}
    seen = f" · server {describe(server)}" if server else ""
    return (f"step {live['step']} · {live['users']}/{live['target_users']} users · {live['step_rps']:.1f} req/s · "
            f"TTFT p50/p95 {ms('ttft_p50_s')}/{ms('ttft_p95_s')} ms · TPOT p50/p95 {ms('tpot_p50_s')}/"
            f"{ms('tpot_p95_s')} ms · {live['requests']} req · {live['errors']} errors{seen} · {live['elapsed_s']:.0f} s")


def _live_reporter(err: Console, show: Callable[[str], None]) -> Callable[[dict], None]:
    """The live line, and the client-bottleneck warning and stall note, each printed once above it when it first
    shows.

    Once is enough: the warning names the fix, and the final summary repeats both
    from the manifest.
    """
    warned, stalled = False, False

    def report(live: dict) -> None:
        nonlocal warned, stalled
        if live.get("client_bound") and not warned:
            warned = True
            err.print(f"[bold red]WARNING (live):[/] {live['client_bound']}", soft_wrap=True)
        if live.get("client_stalls") and not stalled:
            stalled = True
            err.print(f"[bold yellow]NOTE (live):[/] {live['client_stalls']}", soft_wrap=True)
        show(live_line(live))

    return report


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.console import Console

    from tokenload.channel import channel_flags
    from tokenload.load.handoff import resolve_scenario_channel
    from tokenload.load.runner import ProcessLayout, execute, plan_run
    from tokenload.rundir import REQUESTS_FILE
    from tokenload.workload.scenario import load_scenario

    distribution = ProcessLayout(processes=ProcessLayout.process_count(args.processes), master=args.master, worker=args.worker,
                                 master_host=args.master_host, master_port=args.master_port,
                                 master_bind_host=args.master_bind_host, expect_workers=args.expect_workers)
    scenario = load_scenario(args.scenario).with_server_metrics(args.server_metrics)
    scenario = dataclasses.replace(scenario, slo=slo_from_args(args, scenario.slo),
                                   thresholds=_thresholds(scenario.thresholds, args))
    scenario, resolution = resolve_scenario_channel(scenario, f"scenario {scenario.name} [channel]",
                                                    channel_flags(args), args.model or ())
    plan = plan_run(scenario, resolution.channel, args.out, users=args.users, duration_s=args.duration,
                    distribution=distribution, web=args.web, web_host=args.web_host, web_port=args.web_port)
    threshold_flags.check_plan(plan.scenario)
    if args.prometheus_port is not None and (args.web or args.worker):
        from tokenload.errors import ConfigError

        raise ConfigError("--prometheus-port serves a headless run's records from its master (or single process); "
                          "drop it on a --worker, or drop --web")
    metrics = serve_from_args(args)
    if args.resume:
        from tokenload.errors import ConfigError
        from tokenload.search import resume

        if args.web or args.worker:
            raise ConfigError("--resume continues a headless search run; drop --web / --worker")
        resume.write(plan.run_dir, resume.resumed(Path(args.resume), plan.scenario))
    err = Console(stderr=True, highlight=False)
    for warning in resolution.warnings:
        err.print(f"[yellow]warning:[/] {warning}")
    err.print(f"[bold]{plan.scenario.name}[/] against {plan.channel}")
    err.print(f"[dim]{resolution.describe()}[/]", markup=True, soft_wrap=True)
    if args.web:
        return _run_web(args, plan.scenario, plan.channel, distribution, err)
    try:
        with err.status("starting Locust") as status:
            run_dir = execute(plan, on_live=_live_reporter(err, status.update), metrics=metrics)
        failed, gate = False, 0
        if not args.worker:
            failed = _print_summary(err, run_dir / REQUESTS_FILE)
            if plan.scenario.thresholds.checks and not failed:
                gate = _judge(run_dir, args, err)
        print(run_dir)
        sys.stdout.flush()
        linger(metrics)
    finally:
        if metrics is not None:
            metrics.close()
    return 1 if failed else gate


def _thresholds(declared: ThresholdsSection, args: argparse.Namespace) -> ThresholdsSection:
    """The scenario's `[thresholds]` with the `--threshold` and `--inconclusive` flags added, so manifest.json's
    resolved scenario carries what `tokenload analyze` judges again."""
    import dataclasses

    merged = declared.with_exprs(args.threshold) if args.threshold else declared
    return dataclasses.replace(merged, inconclusive=args.inconclusive) if args.inconclusive else merged


def _judge(run_dir: Path, args: argparse.Namespace, err: Console) -> int:
    """Analyse the run (summary.json, report.html) and judge its thresholds: the ✓/✗ table, JUnit, the step
    summary; 0 or 99."""

    from tokenload.analysis.pipeline import analyze, scenario_thresholds

    analysis = analyze(run_dir, console=err)
    summary = analysis.summary
    err.print(f"analysed: {run_dir / 'report.html'}", markup=False, soft_wrap=True)
    return threshold_flags.report(summary["thresholds"], args, title=threshold_flags.title(summary),
                                  inconclusive=scenario_thresholds(analysis.run.manifest)[1],
                                  verdict=threshold_flags.verdict_pairs(summary),
                                  plots=sorted(str(p) for p in run_dir.glob("plots/*.png")))


def _run_web(args: argparse.Namespace, scenario: Any, channel: Any, distribution: Any, err: Console) -> int:
    """`--web`: the UI's URL on a line of its own once it answers; at Ctrl-C, every run of the session.

    Each start in the UI is a run directory of its own, finalised (and analysed)
    by Locust when it stops; they are listed here in start order, the last one
    on the last line.
    """
    import time

    from tokenload.load import websession
    from tokenload.load.runner import run_scenario
    from tokenload.rundir import REQUESTS_FILE

    def say(url: str) -> None:
        print(url, flush=True)
        err.print(f"web UI at {url} (tokenload tab: live token statistics). It stays up after the plan ends; "
                  "each start in it is a new run directory. Press Ctrl-C to quit.", markup=False, soft_wrap=True)

    since = time.time()
    giving_up = websession.announce_when_up(websession.url(args.web_host, args.web_port), say)
    try:
        first = run_scenario(scenario, channel, args.out, users=args.users, duration_s=args.duration,
                             distribution=distribution, web=True, web_host=args.web_host, web_port=args.web_port)
    finally:
        giving_up.set()
    if args.worker:
        print(first)
        return 0
    failed = False
    runs = websession.session_runs(first, since) or [first]
    for run_dir in runs:
        err.print(f"[bold]{run_dir}[/]")
        failed = _print_summary(err, run_dir / REQUESTS_FILE) or failed
    for run_dir in runs:
        print(run_dir)
    sys.stdout.flush()
    return 1 if failed else 0


def _print_summary(err: Console, path: Path) -> bool:
    """Counts, errors by kind and TTFT/TPOT/e2e percentiles from the raw records.

    Percentiles come from the records, not Locust's rounded histogram. Returns
    True when the run failed as a measurement: no request succeeded, or a worker
    was lost (killed or crashed; the run directory is complete up to its last
    flush), so the command exits 1.
    """
    import json

    import numpy as np
    import pyarrow.parquet as pq

    from tokenload.contracts.manifest import Manifest
    from tokenload.failures import fix_for
    from tokenload.rundir import MANIFEST_FILE

    columns = ["status", "error_kind", "http_status", "error_message", "in_flight", "ttft_s", "tpot_s", "e2e_s"]
    df = pq.read_table(path, columns=columns).to_pandas()
    done = df[(df.status == "ok") & ~df.in_flight]
    errors = df[df.status == "error"]
    parts = [f"{len(df)} requests", f"{len(errors)} errors", f"{int(df.in_flight.sum())} in flight"]
    for col in ("ttft_s", "tpot_s", "e2e_s"):
        vals = done[col].dropna().to_numpy()
        if len(vals):
            p50, p95 = np.percentile(vals, (50, 95))
            parts.append(f"{col[:-2].upper()} p50 {p50:.3f} s p95 {p95:.3f} s")
    manifest: Manifest = json.loads((path.parent / MANIFEST_FILE).read_text())
    err.print(" · ".join(parts))
    for kind, group in errors.groupby("error_kind", sort=False):
        first = group.iloc[0]
        status = "" if first.http_status != first.http_status else f" HTTP {int(first.http_status)}"
        err.print(f"  {len(group)} x {kind}{status}: {first.error_message}", markup=False, soft_wrap=True)
        err.print(f"    fix: {fix_for(str(kind), first.error_message) or ''}", markup=False, soft_wrap=True)
    server = manifest.get("server_metrics") or {}
    if server:
        err.print(f"server metrics: {', '.join(server['sources'])} ({', '.join(server.get('servers') or []) or 'no known names'}; "
                  f"{server.get('scrapes', 0)} scrapes)" if server.get("sources") else server.get("note"),
                  markup=False, soft_wrap=True)
    if manifest.get("stop_reason"):
        err.print(f"stopped: {manifest['stop_reason']}", markup=False, soft_wrap=True)
    for warning in manifest.get("warnings", []):
        err.print(f"[bold red]WARNING:[/] {warning}")
    seen = df.ttft_s.dropna().to_numpy()
    if done.empty and len(seen):  # a channel slower than the run: first tokens came, no answer finished
        err.print(f"[bold red]no request finished[/]: {len(seen)} TTFT(s) recorded (p50 {np.median(seen):.3f} s, "
                  f"max {seen.max():.3f} s) on requests still open or cut mid-stream; the channel is slower than "
                  "the run: lengthen the steps or the run, or lower [output] max_tokens", soft_wrap=True)
    elif done.empty:
        err.print("[bold red]no request succeeded[/]: nothing was measured")
    return done.empty or bool(manifest.get("workers_lost"))
