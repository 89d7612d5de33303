"""See everything tokenload does in about a minute, with no key and no network.

The demo starts the built-in channel simulator on a free loopback port with its
`demo-offpeak` profile (8 batch slots to ourselves), runs the packaged `demo`
scenario against it (a breakpoint search from 4 users for the highest load whose
TTFT stays within 0.3 s for 85% of requests), analyses the run and prints the
verdict table with the capacity found. Then it does the same against the
`demo-peak` profile (other tenants slow every step and take half the slots) and
compares the two: the capacities with the intervals their boundaries lie in, and
the latencies at the load levels both runs held, as you would compare a channel
at night and at noon.

Everything lands under one directory (default results/demo-<time>/):
offpeak/ and peak/ are ordinary run directories (requests.parquet,
manifest.json, summary.json, report.html, plots/), comparison/ holds
comparison.html. Point your own channel at `tokenload doctor`, `tokenload probe`
and `tokenload run` next.

`--history` shows `watch` and `history` instead: the simulator's `diurnal`
profile (off-peak 01:00-06:00, peak 13:00-17:00) runs one day compressed into
--duration seconds (default 120), a watcher samples it into history.db, and
`history` finds the windows: history/history.html and the verdict.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenload.protocolspec import DEFAULT_PROTOCOL, PROTOCOLS

HELP = "run the whole pipeline against the built-in simulator: off-peak and peak capacity searches, reports, comparison"

# (label, simulator profile, run directory name)
PHASES: tuple[tuple[str, str, str], ...] = (("off-peak", "demo-offpeak", "offpeak"), ("peak", "demo-peak", "peak"))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", help="where the runs go (default results/demo-<time>)")
    parser.add_argument("--protocol", choices=PROTOCOLS, default=DEFAULT_PROTOCOL,
                        help=f"wire protocol the simulator is spoken to with (default {DEFAULT_PROTOCOL})")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="cap each run at S seconds (default: until the search ends, about 25 s)")
    parser.add_argument("--offpeak-only", action="store_true", help="skip the peak run and the comparison")
    parser.add_argument("--history", action="store_true",
                        help="watch a simulated day (compressed into --duration seconds, default 120) and find its "
                             "peak and off-peak hours")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.rule import Rule

    from tokenload.analysis import analyze_run, compare_runs, comparison_table, print_verdict
    from tokenload.channel import Channel
    from tokenload.commands.run import live_line
    from tokenload.errors import ConfigError
    from tokenload.load.runner import run_scenario
    from tokenload.sim import launch
    from tokenload.workload.scenario import load_scenario

    if args.duration is not None and args.duration <= 0:
        raise ConfigError(f"--duration must be positive, got {args.duration:g}")
    console = Console(stderr=True, highlight=False)
    root = Path(args.out) if args.out else Path("results") / f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"{root} is not empty; pass another --out")
    root.mkdir(parents=True, exist_ok=True)
    if args.history:
        return _history_demo(args, console, root)
    scenario = load_scenario("demo")
    phases = PHASES[:1] if args.offpeak_only else PHASES
    run_dirs: list[Path] = []
    for label, profile, name in phases:
        console.print(Rule(f"{label}: simulator profile '{profile}', scenario '{scenario.name}'"))
        with launch(["--profile", profile, "--truth", str(root / f"{name}-truth.jsonl")]) as sim:
            channel = Channel(base_url=sim.base_url, protocol=args.protocol, model="sim-7b")
            console.print(f"simulator at {sim.base_url}; {scenario.description}")
            with console.status("starting Locust") as status:
                run_dir = run_scenario(scenario, channel, root / name, duration_s=args.duration,
                                       on_live=lambda live: status.update(f"{label}: {live_line(live)}"))  # noqa: B023 (runs in this iteration)
        summary = analyze_run(run_dir, console=console)
        print_verdict(summary, console)
        console.print(f"report: {run_dir / 'report.html'}")
        run_dirs.append(run_dir)
    if len(run_dirs) > 1:
        console.print(Rule("off-peak vs peak"))
        comparison = compare_runs(run_dirs, [label for label, _, _ in phases], root / "comparison", console=console)
        for line in (comparison.get("capacity") or {}).get("headline", []):
            console.print(f"[bold]{escape(line)}[/bold]")
        console.print(comparison_table(comparison))
        console.print(f"comparison: {root / 'comparison' / 'comparison.html'}")
    for run_dir in run_dirs:
        print(run_dir / "report.html")
    if len(run_dirs) > 1:
        print(root / "comparison" / "comparison.html")
    return 0



HISTORY_DAY_S = 120.0
HISTORY_SAMPLES_PER_DAY = 400


def _history_demo(args: argparse.Namespace, console: Any, root: Path) -> int:
    """One compressed diurnal day, watched and then reported: `watch` and `history` end to end."""
    import threading
    from contextlib import closing

    from tokenload.channel import Channel
    from tokenload.commands.history import report
    from tokenload.dayclock import DAY_S
    from tokenload.history.sampler import Watcher, WatchPlan, probe_scenario, status_line
    from tokenload.history.store import open_store
    from tokenload.sim import launch

    period = args.duration or HISTORY_DAY_S
    sim_args = ["--profile", "diurnal", "--time-scale", f"{DAY_S / period:g}", "--truth", str(root / "truth.jsonl")]
    console.print(f"simulator profile 'diurnal' (off-peak 01:00-06:00, peak 13:00-17:00), one day in {period:g} s")
    with launch(sim_args) as sim, closing(open_store(root / "history.db")) as store:
        channel = Channel(base_url=sim.base_url, protocol=args.protocol, model="sim-7b")
        stop = threading.Event()
        timer = threading.Timer(period, stop.set)
        with console.status("watching") as status:
            watcher = Watcher(store, channel, WatchPlan(every_s=period / HISTORY_SAMPLES_PER_DAY, requests=2,
                                                        period_s=period), probe_scenario(32, 4), stop=stop,
                              on_sample=lambda result: status.update(f"watch: {status_line(result)}"))
            timer.start()
            try:
                watcher.run()
            finally:
                timer.cancel()
        frames = {watcher.fingerprint: store.query()}
    return report(frames, period, root / "history", csv=False)
