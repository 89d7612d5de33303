"""Sample a channel for days, cheaply, into the history database: when is it slow?

Every --every (default 15m, jittered by 10%) `watch` sends a small fixed probe
(default 3 sequential streaming requests, 64 prompt tokens, at most 32 output
tokens; --scenario FILE takes the prompt and output sections of a scenario
instead) and commits the requests, with the same columns as requests.parquet
plus a channel fingerprint (protocol, host, model: never a key) and a sample
id, to the history database. One status line per sample: time, TTFT and TPOT
medians, errors, budget left. `tokenload history` then draws the hours.

--max-tokens-per-day N is never exceeded: a sample whose worst case (input
plus max_tokens per request) does not fit in what is left of the day is skipped
and logged. A channel that is down is recorded as errors and watching goes on;
a sample stops at its first failed request. SIGTERM or Ctrl-C stop cleanly
after the request in flight (a stress run in progress finishes first; Ctrl-C
again stops it); a restart resumes the rhythm and the day's budget from the
database.

--server-metrics URL (repeatable) scrapes the inference server's Prometheus
metrics as each sample begins and keeps its gauges (running, waiting, KV cache)
beside the sample: the status line shows them, and `tokenload history` puts
them beside the hours, so a slow hour can be told from a busy server.

--stress SCENARIO@HH:MM,... also runs a load test at those local times (e.g.
ramp@03:00,14:00 to compare the breakpoint at night and at peak): the run
directory goes to runs/ beside the database and its requests into the database
(`tokenload history` compares like with like, by load level); the --slo-*
flags override its [slo] as on `tokenload run`. Under a budget the
run's [stop] max_tokens is capped so that even the requests in flight when it
runs out fit in what is left of the day. Several watchers (of several channels) may share one file.

The database defaults to $XDG_DATA_HOME/tokenload/history.db, else
~/.local/share/tokenload/history.db. --period compresses the day for the
simulator (`tokenload sim --profile diurnal --time-scale N` pairs with
--period 86400/N seconds); the daily budget then applies per compressed day.

Run it as a service, e.g. a systemd user unit
~/.config/systemd/user/tokenload-watch.service:
  [Service]
  EnvironmentFile=%h/.config/tokenload/channel.env
  ExecStart=%h/.local/bin/tokenload watch --every 15m --max-tokens-per-day 200000
  Restart=on-failure
  [Install]
  WantedBy=default.target
then `systemctl --user enable --now tokenload-watch`. Or one sample per cron
run: `*/15 * * * * tokenload watch --samples 1 >> ~/tokenload-watch.log 2>&1`.
"""

from __future__ import annotations

import argparse

from tokenload.channel import add_channel_arguments
from tokenload.commands.prometheus_flags import add_prometheus_arguments, linger, serve_from_args
from tokenload.commands.slo_flags import add_slo_arguments, slo_from_args

HELP = "long-running low-cost sampler of a channel into the history database (peak-hour finding)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--every", default="15m", metavar="DUR", help="time between samples, e.g. 90s, 15m (default 15m)")
    parser.add_argument("--db", metavar="FILE", help="history database (default: see above)")
    parser.add_argument("--period", default="24h", metavar="DUR",
                        help="length of a day: 24h, or shorter for a simulator day compressed by --time-scale")
    parser.add_argument("--requests", type=int, default=3, metavar="N",
                        help="sequential requests per sample (default 3)")
    parser.add_argument("--max-tokens-per-day", type=int, default=0, metavar="N",
                        help="token budget (input + output) per day, never exceeded; 0 = none (default)")
    parser.add_argument("--scenario", metavar="FILE",
                        help="take the probe's prompt and output lengths from this scenario file")
    parser.add_argument("--stress", metavar="SCENARIO@HH:MM,...",
                        help="also run this scenario (a packaged name or a file) at these local times, e.g. "
                             "ramp@03:00,14:00; runs go to runs/ beside the database and into it")
    parser.add_argument("--samples", type=int, metavar="N", help="stop after N samples (default: run until stopped)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds to wait for the first token, and between tokens (default 60)")
    parser.add_argument("--server-metrics", action="append", metavar="URL",
                        help="the inference server's Prometheus metrics address (repeatable), scraped as each sample "
                             "begins: its gauges (running, waiting, KV cache) are kept beside the sample")
    add_slo_arguments(parser)
    add_prometheus_arguments(parser, "the samples' requests (stress runs not included)")
    add_channel_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import signal
    import sys
    import threading
    from contextlib import closing
    from pathlib import Path

    from tokenload.channel import resolve_from_args
    from tokenload.dayclock import duration_text, parse_duration
    from tokenload.errors import ConfigError
    from tokenload.history.sampler import Watcher, WatchPlan, parse_stress, status_line
    from tokenload.history.store import default_db_path, fingerprint_of, open_store
    from tokenload.workload.scenario import load_scenario

    try:
        every, period = parse_duration(args.every, "--every"), parse_duration(args.period, "--period")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for name, value, low in (("--requests", args.requests, 1), ("--max-tokens-per-day", args.max_tokens_per_day, 0),
                             ("--samples", args.samples, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{name} must be at least {low}, got {value}")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be positive, got {args.timeout:g}")
    probe = load_scenario(args.scenario) if args.scenario else None
    resolution = resolve_from_args(args)
    channel = dataclasses.replace(resolution.channel, first_token_timeout_s=args.timeout, idle_timeout_s=args.timeout)
    for warning in resolution.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    db_path = Path(args.db).expanduser() if args.db else default_db_path()
    stress = parse_stress(args.stress, db_path.parent / "runs") if args.stress else None
    if stress is not None:  # the --slo-* flags judge the stress runs, as on `tokenload run`
        stress = dataclasses.replace(stress, scenario=dataclasses.replace(
            stress.scenario, slo=slo_from_args(args, stress.scenario.slo)))
    if stress is not None and args.max_tokens_per_day:
        stress.worst_overshoot()  # a scenario without bounded lengths cannot keep a budget: say so now
    server_metrics: tuple[str, ...] = ()
    if args.server_metrics:  # each must answer Prometheus text now: exit 2 before any sample otherwise
        from tokenload.servermetrics.scrape import resolve
        from tokenload.workload.scenario import Scenario

        server_metrics = Scenario.server_metrics_urls(args.server_metrics)
        resolve(server_metrics, channel.base_url)
        if stress is not None:  # the stress runs sample the same server
            stress = dataclasses.replace(stress, scenario=stress.scenario.with_server_metrics(list(server_metrics)))
    plan = WatchPlan(every_s=every, requests=args.requests, period_s=period, max_tokens_per_day=args.max_tokens_per_day,
                     stress=stress, server_metrics=server_metrics)
    stop = threading.Event()
    metrics = serve_from_args(args, run_id="watch")

    def on_signal(signum: int, _frame: object) -> None:
        print(f"tokenload watch: {signal.Signals(signum).name}, stopping after the request in flight", file=sys.stderr)
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts at once

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with closing(open_store(db_path)) as store:
            bare = "" if args.every.strip()[-1:].isalpha() else f" (--every {args.every.strip()}: a number without a unit is seconds)"
            print(f"watching {fingerprint_of(channel)} every {duration_text(every)}{bare} into {store.path}",
                  file=sys.stderr, flush=True)
            watcher = Watcher(store, channel, plan, probe, stop=stop, metrics=metrics,
                              on_sample=lambda result: print(status_line(result), flush=True))
            taken = watcher.run(max_samples=args.samples, on_stress=lambda line: print(line, flush=True))
        if metrics is not None:
            metrics.seal()
        print(f"tokenload watch: {taken} sample(s) taken", file=sys.stderr)
        if not stop.is_set():  # stopped by a signal: whoever sent it wants the watcher gone now
            linger(metrics)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if metrics is not None:
            metrics.close()
    return 0
