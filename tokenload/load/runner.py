"""Run a scenario with Locust in a child process, then finalise the run directory.

Why a child process: Locust monkey-patches the whole interpreter with gevent
when imported, which would break the caller (`tokenload demo` runs an asyncio
simulator next to it) and makes Ctrl-C handling depend on Locust's internals.
The child runs the real `locust` command line (headless, `--web`, `--processes`,
`--master`, `--worker`), so everything Locust users know still applies. It gets
its own session: a Ctrl-C (or SIGTERM) reaches only this process, which
forwards exactly one SIGINT to Locust's process group (master and forked
workers; SIGINT because a headless shape run handles no SIGTERM until the
shape ends), waits for it to drain and flush, and finalises. A second one
kills the group (the last second of records may be lost, never more). Locust
dies with this process (see `lifeline.py`).

Finalising happens here, after every Locust process has exited, never in a
Locust `test_stop`: the segments are merged into `requests.parquet` and
`manifest.json` is written (scenario as resolved, channel without secrets,
versions, host, start/end, steps, stop reason, scheduler lag, open-loop
lateness, record counts per worker).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenload.channel import Channel
from tokenload.compat import python_module
from tokenload.errors import ConfigError, HarnessError
from tokenload.exporter import COLUMNS as METRIC_COLUMNS
from tokenload.exporter import LiveMetrics
from tokenload.load import handoff, lag, lifeline, records, websession
from tokenload.load.drain import DRAIN_CAP_S
from tokenload.load.handoff import bind
from tokenload.load.rundirs import (
    LOG_FILE,
    default_run_dir,
    finalise,
    new_run_id,
    read_json,
    write_run_info,
)
from tokenload.rundir import REQUESTS_FILE
from tokenload.servermetrics import scrape as server_metrics
from tokenload.workload.scenario import Scenario

# After the drain time, how long the processes of a stopping run get to flush and exit before they are killed.
GROUP_GRACE_S = 10.0


def locustfile() -> Path:
    """The locustfile Locust runs (`tokenload.locustfiles.llm`), found as a file: this process never imports Locust."""
    spec = importlib.util.find_spec("tokenload.locustfiles")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "llm.py"


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """How Locust is spread over processes and machines; invalid combinations are a `ConfigError`."""

    processes: int | None = None
    master: bool = False
    worker: bool = False
    master_host: str = "127.0.0.1"
    master_port: int = 5557
    master_bind_host: str = "127.0.0.1"
    expect_workers: int = 1

    def __post_init__(self) -> None:
        if self.master and self.worker:
            raise ConfigError("--master and --worker exclude each other; give one")
        if self.processes is not None and self.processes < 1:
            raise ConfigError(f"--processes must be at least 1, got {self.processes}; leave it out for one process")
        if self.processes is not None and (self.master or self.worker):
            raise ConfigError("--processes forks local workers and cannot be combined with --master or --worker")
        if self.expect_workers < 1:
            raise ConfigError(f"--expect-workers must be at least 1, got {self.expect_workers}")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port must be a TCP port (1-65535), got {self.master_port}")

    @staticmethod
    def process_count(value: str | None) -> int | None:
        """`--processes`: a number of local workers, or `auto` for one per usable core (None: one process).

        `auto` on a single core is one process, not a master with one forked
        worker: the master would only take CPU from the one worker.
        """
        if value is None:
            return None
        if value.strip().lower() == "auto":
            cores = lag.usable_cores()
            return cores if cores > 1 else None
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"--processes must be a number of processes or auto, got {value!r}") from None

    def locust_args(self) -> list[str]:
        if self.worker:
            return ["--worker", "--master-host", self.master_host, "--master-port", str(self.master_port)]
        args: list[str] = []
        if self.processes:
            # Forked workers meet their master on a free loopback port, not Locust's fixed 5557,
            # so two local runs (or a run next to a real master) never collide.
            port = str(_free_loopback_port())
            args = ["--processes", str(self.processes), "--master-bind-host", "127.0.0.1", "--master-bind-port", port,
                    "--master-host", "127.0.0.1", "--master-port", port]
        if self.master:
            args += ["--master", "--master-bind-host", self.master_bind_host, "--master-bind-port", str(self.master_port),
                     "--expect-workers", str(self.expect_workers)]
        return args


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A validated run, not started yet: nothing exists on disk and no process runs."""

    scenario: Scenario
    channel: Channel
    run_dir: Path
    distribution: ProcessLayout
    web: bool
    web_host: str = "127.0.0.1"
    web_port: int | None = None


def plan_run(
    scenario: Scenario,
    channel: Channel,
    out_dir: str | Path | None = None,
    *,
    users: int | None = None,
    duration_s: float | None = None,
    distribution: ProcessLayout = ProcessLayout(),
    web: bool = False,
    web_host: str = "127.0.0.1",
    web_port: int | None = None,
) -> RunPlan:
    """Check everything a Locust process would trip over, before any process starts.

    A problem found inside Locust is a log file to read and a half-made run
    directory that blocks reusing `--out`; found here it is one `ConfigError`
    line. This builds what each Locust process builds from the scenario
    (the resolved scenario as the processes will read it, the prompt source
    with its dataset, one protocol adapter per model) and throws it away.
    """
    from tokenload.protocols import adapter_for
    from tokenload.workload.prompts import PromptSource

    if scenario.load.kind == "trace" and (distribution.processes or distribution.master or distribution.worker):
        raise ConfigError("a trace replay runs in one Locust process (every process would send the whole trace); "
                          "drop --processes / --master / --worker")
    scenario, channel = bind(scenario.with_overrides(users=users, duration_s=duration_s), channel)
    Scenario.from_dict(json.loads(json.dumps(scenario.to_dict())), "resolved scenario", Path("."), scenario.name)
    PromptSource(scenario, scenario.channel.models, 0)
    for model in scenario.channel.models:
        adapter_for(channel.with_model(model))
    if distribution.worker:  # its log and its spool; or the master's run directory, if the machines share it
        run_dir = Path(out_dir) if out_dir else default_run_dir(f"{scenario.name}-worker")
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"--out {run_dir} is a file, not a directory; choose another --out")
    else:
        run_dir = Path(out_dir) if out_dir else default_run_dir(scenario.name)
        _check_new_run_dir(run_dir)
    if web and not distribution.worker:
        websession.check_port(web_host, web_port)
    return RunPlan(scenario, channel, run_dir, distribution, web, web_host, web_port)


def _check_new_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} is a file, not a directory; choose another --out")
    if any((run_dir / name).exists() for name in (REQUESTS_FILE, records.SEGMENTS_DIR, records.SEALED_DIR)):
        raise ConfigError(f"run directory {run_dir} already holds a run; choose another --out")
    existing = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create the run directory {run_dir}: {existing} is not writable; choose another --out")


def run_scenario(
    scenario: Scenario,
    channel: Channel,
    out_dir: str | Path | None = None,
    *,
    users: int | None = None,
    duration_s: float | None = None,
    distribution: ProcessLayout = ProcessLayout(),
    web: bool = False,
    web_host: str = "127.0.0.1",
    web_port: int | None = None,
    on_live: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """Run `scenario` against `channel` and return the finalised run directory.

    `users` / `duration_s` override the scenario like `tokenload run --users/--duration`;
    `on_live` receives the live numbers about twice a second. With `web`, Locust's UI
    on `web_host` stays up until Ctrl-C and every start in it is a run of its own
    (`run_dir`, then `run_dir-2`, ...: `websession.session_runs`). Raises `ConfigError`
    for bad input (before anything starts); a Locust process that fails is
    reported in the manifest and by a `HarnessError` naming the log file.
    """
    plan = plan_run(scenario, channel, out_dir, users=users, duration_s=duration_s, distribution=distribution,
                    web=web, web_host=web_host, web_port=web_port)
    return execute(plan, on_live)


def execute(plan: RunPlan, on_live: Callable[[dict[str, Any]], None] | None = None,
            metrics: LiveMetrics | None = None) -> Path:
    """Start Locust for a validated plan, supervise it, and finalise the run directory.

    Finalising waits until every Locust process of this machine has exited
    (forked workers included: Locust's own `kill_workers` can leave one behind
    its master), so each one's last flush is in; a process still there after
    the drain time and a grace period is killed and named in the manifest.
    `metrics` (a headless run's master or single process) is fed every record
    as its segment appears, workers' included, and the last ones at the seal.
    """
    scenario, channel, run_dir, distribution = plan.scenario, plan.channel, plan.run_dir, plan.distribution
    # One scraper per run, in this process (never in a Locust one); a worker has none. In a web session it
    # also feeds the tab's live view, and each start's samples go to that start's run directory.
    sources = None if distribution.worker else server_metrics.resolve(
        scenario.server.metrics_url, channel.base_url, scenario.server.interval_s, scenario.server.discover)
    if distribution.worker:  # the run id and the resolved scenario come from the master (`series.follow_master`)
        run_dir.mkdir(parents=True, exist_ok=True)
        run_args = ["--run-dir", str(run_dir)]
        run_id = ""
        log_name = f"locust-worker-{socket.gethostname()}-{os.getpid()}.log"
    else:
        run_id = new_run_id()
        started = time.time()
        scenario_path = write_run_info(run_dir, run_id, scenario, channel.public())
        run_args = ["--scenario", str(scenario_path), "--run-dir", str(run_dir), "--run-id", run_id]
        log_name = LOG_FILE
    feed = None if metrics is None else _MetricsFeed(metrics, run_id, run_dir)
    command = [
        *python_module("locust"), "-f", str(locustfile()), *run_args,
        "--host", channel.base_url,
        "--exit-code-on-error", "0", "--loglevel", "INFO",
        *(websession.locust_args(plan.web_host, plan.web_port) if plan.web else ["--headless"]),
        *distribution.locust_args(),
    ]
    live = run_dir / "server_live.json" if plan.web else None
    env = {**os.environ, **handoff.channel_to_env(channel), **lifeline.parent_env(), "TOKENLOAD_MANAGED": "1",
           "PYTHONUNBUFFERED": "1", **({server_metrics.LIVE_ENV: str(live.absolute())} if live else {})}
    lifeline.adopt_orphans()
    # Headless, the samples go to the run directory; in a web session, to the run of the current start.
    target = (lambda: websession.current_run(run_dir, started)) if plan.web else (lambda: run_dir)
    sampler = None if sources is None else server_metrics.Sampler(sources, target, live).start()
    with open(run_dir / log_name, "ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        rc = _supervise(proc, run_dir, on_live if sampler is None or on_live is None else _with_server(on_live, sampler),
                        feed)
        drain_s = drain_used(run_dir, scenario)
        lingering = lifeline.wait_group(proc.pid, drain_s + GROUP_GRACE_S)
    if sampler is not None:
        sampler.stop()
    if distribution.worker:
        return run_dir
    if plan.web:  # each start was a run of its own, finalised by the Locust master at its stop
        websession.session_runs(run_dir, since=started)
    else:
        finalise(run_dir, wait_s=drain_s + GROUP_GRACE_S if distribution.master else 0.0, locust_rc=rc,
                 lingering=lingering, on_sealed=None if feed is None else feed.sealed)
    if rc != 0:
        raise HarnessError(f"Locust exited with code {rc}; see {run_dir / LOG_FILE}")
    return run_dir


def drain_used(run_dir: Path, scenario: Scenario) -> float:
    """The drain the run's master settled on (derived when the plan ended: `drain.py`), from control.json.

    A worker machine reads the master's when it shares the run directory; otherwise, the longest the
    scenario allows.
    """
    drain = read_json(run_dir / records.SEGMENTS_DIR / "control.json").get("drain") or {}
    if drain.get("drain_s") is not None:
        return float(drain["drain_s"])
    return scenario.stop.drain_s if scenario.stop.drain_s is not None else max(scenario.stop.drain_min_s, DRAIN_CAP_S)


class _MetricsFeed:
    """Feeds a run's live metrics from its run directory: each new segment's records, the live user count."""

    def __init__(self, metrics: LiveMetrics, run_id: str, run_dir: Path) -> None:
        self.metrics = metrics
        self.run_dir = run_dir
        self.tail = records.SegmentTail(METRIC_COLUMNS)
        metrics.run_id = run_id
        metrics.set_active_users(0)

    def tick(self, live: dict[str, Any] | None) -> None:
        self.metrics.observe(self.tail.new_records(self.run_dir / records.SEGMENTS_DIR))
        if live:
            self.metrics.set_active_users(int(live.get("users") or 0))

    def sealed(self, seg: Path) -> None:
        """The run is over: the segments flushed last, and no users."""
        self.metrics.observe(self.tail.new_records(seg))
        self.metrics.set_active_users(0)
        self.metrics.seal()


def _supervise(proc: subprocess.Popen[bytes], run_dir: Path, on_live: Callable[[dict[str, Any]], None] | None,
               feed: _MetricsFeed | None = None) -> int:
    """Wait for Locust, reporting live numbers; Ctrl-C or SIGTERM stops it gracefully, a second one kills it."""
    control = run_dir / records.SEGMENTS_DIR / "control.json"
    interrupts = 0
    with lifeline.stop_signals_as_interrupt():
        while True:
            try:  # the interrupt may land in the live tick too (a handler's exception passes its siblings by)
                try:
                    return proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    live = read_json(control).get("live") if on_live is not None or feed is not None else None
                    if feed is not None:
                        feed.tick(live)
                    if on_live is not None and live:
                        on_live(_with_client_lag(live, run_dir))
            except KeyboardInterrupt:
                interrupts += 1
                try:
                    os.killpg(proc.pid, signal.SIGINT if interrupts == 1 else signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _with_server(on_live: Callable[[dict[str, Any]], None],
                 sampler: server_metrics.Sampler) -> Callable[[dict[str, Any]], None]:
    """The live numbers plus `server`: the server's gauges in the scraper's last scrape."""
    return lambda live: on_live({**live, "server": sampler.latest()})


def _with_client_lag(live: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The live numbers plus `client_bound`: the bottleneck warning as the processes' last flushes show it,
    and `client_stalls`: the note on the load generator's stalls (`lag.stall_summary`), if any.

    The same test as the manifest's (`lag.summarise`), so the live warning and
    the final one agree; only finished requests that succeeded count as healthy.
    """
    requests = int(live.get("requests") or 0)
    ok_share = (requests - int(live.get("errors") or 0)) / requests if requests else 0.0
    states = records.worker_states(run_dir / records.SEGMENTS_DIR)
    summary = lag.summarise(records.process_lags(states), ok_share)
    return {**live, "client_bound": summary.get("warning"), "client_stalls": (summary.get("stalls") or {}).get("note")}


