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
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenload.channel import Channel, ChannelFlags, Resolution, resolve
from tokenload.errors import ConfigError, HarnessError
from tokenload.load import handoff, lag, lifeline, records, websession
from tokenload.load.drain import DRAIN_CAP_S
from tokenload.load.scenario import OPEN_LOOP_KINDS, Scenario
from tokenload.rundir import MANIFEST_FILE, REQUESTS_FILE

if TYPE_CHECKING:
    import pyarrow as pa

RUN_INFO = "run.json"
SCENARIO_FILE = "scenario.json"
LOG_FILE = "locust.log"
# Open-loop sends later than this count as late; more than LATE_WARN_FRACTION late means
# the user pool could not keep up with the arrival rate.
LATE_THRESHOLD_S = 0.010
LATE_WARN_FRACTION = 0.05
# After the drain time, how long the processes of a stopping run get to flush and exit before they are killed.
GROUP_GRACE_S = 10.0
# `analyze` finalises a killed run only when every process finished, or none flushed for this long
# (live ones flush every second).
RECOVER_QUIET_S = 5.0


def new_run_id() -> str:
    return f"{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def default_run_dir(scenario_name: str) -> Path:
    return Path("results") / f"{scenario_name}-{datetime.now():%Y%m%d-%H%M%S}"


def locustfile() -> Path:
    import tokenload.locustfiles

    return Path(tokenload.locustfiles.__file__).parent / "llm.py"


def write_run_info(run_dir: Path, run_id: str, scenario: Scenario, channel_public: dict[str, Any]) -> Path:
    """What the manifest needs from the start of the run; returns the resolved scenario's path."""
    seg = run_dir / records.SEGMENTS_DIR
    seg.mkdir(parents=True, exist_ok=True)
    path = seg / SCENARIO_FILE
    records.write_json(path, scenario.to_dict())
    records.write_json(seg / RUN_INFO, {"run_id": run_id, "channel": channel_public, "started_at": time.time()})
    return path


def scenario_layer(scenario: Scenario) -> dict[str, str | None]:
    """The scenario's `[channel]` table as `channel.resolve()`'s scenario layer (defaults, not flags)."""
    section = scenario.channel
    return {"protocol": section.protocol, "base_url": section.base_url,
            "model": section.models[0] if section.models else None}


def resolve_scenario_channel(scenario: Scenario, label: str, flags: ChannelFlags) -> tuple[Scenario, Resolution]:
    """Resolve the channel with the scenario as a layer; the scenario's model list follows the result.

    A scenario may list several models (requests pick among them); that list
    stands only while the model comes from the scenario layer. A model set by a
    flag, the environment or a settings file replaces it, as any layer above
    the scenario does.
    """
    resolution = resolve(**flags, scenario=scenario_layer(scenario), scenario_label=label)
    if resolution.sources.get("model") != label:
        scenario = dataclasses.replace(
            scenario, channel=dataclasses.replace(scenario.channel, models=(resolution.channel.model,)))
    return scenario, resolution


def bind(scenario: Scenario, channel: Channel) -> tuple[Scenario, Channel]:
    """A scenario and a channel made consistent: the models to send to, the scenario's timeouts."""
    if not scenario.channel.models:
        scenario = dataclasses.replace(scenario, channel=dataclasses.replace(scenario.channel, models=(channel.model,)))
    channel = dataclasses.replace(channel, first_token_timeout_s=scenario.channel.first_token_timeout_s,
                                  idle_timeout_s=scenario.channel.idle_timeout_s)
    return scenario, channel


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
    from tokenload.load.prompts import PromptSource
    from tokenload.protocols import adapter_for

    if scenario.load.kind == "trace" and (distribution.processes or distribution.master or distribution.worker):
        raise ConfigError("a trace replay runs in one Locust process (every process would send the whole trace); "
                          "drop --processes / --master / --worker")
    scenario, channel = bind(scenario.with_overrides(users=users, duration_s=duration_s), channel)
    Scenario.from_dict(json.loads(json.dumps(scenario.to_dict())), "resolved scenario", Path("."), scenario.name)
    PromptSource(scenario, scenario.channel.models, 0)
    for model in scenario.channel.models:
        adapter_for(channel.with_model(model))
    if distribution.worker:
        if out_dir is None:
            raise ConfigError("a worker needs --out: the master's run directory, on a filesystem both machines share")
        run_dir = Path(out_dir)
    else:
        run_dir = Path(out_dir) if out_dir else default_run_dir(scenario.name)
        _check_new_run_dir(run_dir)
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


def execute(plan: RunPlan, on_live: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Start Locust for a validated plan, supervise it, and finalise the run directory.

    Finalising waits until every Locust process of this machine has exited
    (forked workers included: Locust's own `kill_workers` can leave one behind
    its master), so each one's last flush is in; a process still there after
    the drain time and a grace period is killed and named in the manifest.
    """
    scenario, channel, run_dir, distribution = plan.scenario, plan.channel, plan.run_dir, plan.distribution
    if distribution.worker:
        run_id, scenario_path = _join_master_run(run_dir)
        log_name = f"locust-worker-{socket.gethostname()}-{os.getpid()}.log"
    else:
        run_id = new_run_id()
        started = time.time()
        scenario_path = write_run_info(run_dir, run_id, scenario, channel.public())
        log_name = LOG_FILE
    command = [
        sys.executable, "-m", "locust", "-f", str(locustfile()),
        "--scenario", str(scenario_path), "--run-dir", str(run_dir), "--run-id", run_id,
        "--host", channel.base_url,
        "--exit-code-on-error", "0", "--loglevel", "INFO",
        *(websession.locust_args(plan.web_host, plan.web_port) if plan.web else ["--headless"]),
        *distribution.locust_args(),
    ]
    env = {**os.environ, **handoff.channel_to_env(channel), **lifeline.parent_env(), "TOKENLOAD_MANAGED": "1",
           "PYTHONUNBUFFERED": "1"}
    lifeline.adopt_orphans()
    with open(run_dir / log_name, "ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        rc = _supervise(proc, run_dir, on_live)
        drain_s = drain_used(run_dir, scenario)
        lingering = lifeline.wait_group(proc.pid, drain_s + GROUP_GRACE_S)
    if distribution.worker:
        return run_dir
    if plan.web:  # each start was a run of its own, finalised by the Locust master at its stop
        websession.session_runs(run_dir, since=started)
    else:
        finalise(run_dir, wait_s=drain_s + GROUP_GRACE_S if distribution.master else 0.0, locust_rc=rc,
                 lingering=lingering)
    if rc != 0:
        raise HarnessError(f"Locust exited with code {rc}; see {run_dir / LOG_FILE}")
    return run_dir


def drain_used(run_dir: Path, scenario: Scenario) -> float:
    """The drain the run's master settled on (derived when the plan ended: `drain.py`), from control.json.

    A worker machine reads the master's (on the shared run directory); without one, the longest the
    scenario allows.
    """
    drain = _read_json(run_dir / records.SEGMENTS_DIR / "control.json").get("drain") or {}
    if drain.get("drain_s") is not None:
        return float(drain["drain_s"])
    return scenario.stop.drain_s if scenario.stop.drain_s is not None else max(scenario.stop.drain_min_s, DRAIN_CAP_S)


def _join_master_run(run_dir: Path, timeout_s: float = 60.0) -> tuple[str, Path]:
    """A worker's run id and resolved scenario: the master's, read from the shared run directory.

    The master writes them before it starts Locust; a worker started first waits for them,
    so every record of the run carries one run id and follows one scenario.
    """
    seg = run_dir / records.SEGMENTS_DIR
    deadline = time.monotonic() + timeout_s
    while not ((seg / RUN_INFO).exists() and (seg / SCENARIO_FILE).exists()):
        if time.monotonic() > deadline:
            raise ConfigError(f"no master run in {run_dir} after {timeout_s:g} s; start the master with the same --out "
                              "first, on a filesystem both machines share")
        time.sleep(0.2)
    return str(_read_json(seg / RUN_INFO)["run_id"]), seg / SCENARIO_FILE


def _supervise(proc: subprocess.Popen[bytes], run_dir: Path, on_live: Callable[[dict[str, Any]], None] | None) -> int:
    """Wait for Locust, reporting live numbers; Ctrl-C or SIGTERM stops it gracefully, a second one kills it."""
    control = run_dir / records.SEGMENTS_DIR / "control.json"
    interrupts = 0
    with lifeline.sigterm_as_interrupt():
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if on_live is not None:
                    live = _read_json(control).get("live")
                    if live:
                        on_live(_with_client_lag(live, run_dir))
            except KeyboardInterrupt:
                interrupts += 1
                try:
                    os.killpg(proc.pid, signal.SIGINT if interrupts == 1 else signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _with_client_lag(live: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The live numbers plus `client_bound`: the bottleneck warning as the processes' last flushes show it.

    The same test as the manifest's (`lag.summarise`), so the live warning and
    the final one agree; only finished requests that succeeded count as healthy.
    """
    requests = int(live.get("requests") or 0)
    ok_share = (requests - int(live.get("errors") or 0)) / requests if requests else 0.0
    states = records.worker_states(run_dir / records.SEGMENTS_DIR)
    warning = lag.summarise({w: s.get("lag", {}) for w, s in states.items()}, ok_share).get("warning")
    return {**live, "client_bound": warning}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("tokenload", "locust", "gevent", "geventhttpclient", "pyarrow"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat()


def finalise(run_dir: Path, wait_s: float = 0.0, locust_rc: int | None = None, lingering: list[int] | None = None,
             recovered: bool = False) -> pa.Table:
    """Seal the run, merge its segments into requests.parquet and write manifest.json; returns the records.

    `wait_s` > 0 (a master with workers on other machines): first wait that
    long for every worker to flush its last records. `lingering`: pids of
    Locust processes that had to be killed. `recovered`: finalised by
    `tokenload analyze` for a run whose `tokenload run` was killed.
    """
    missing = records.wait_for_workers(run_dir, _read_json(run_dir / records.SEGMENTS_DIR / "control.json").get(
        "workers", []), wait_s) if wait_s else []
    seg = records.seal(run_dir)
    info, control = _read_json(seg / RUN_INFO), _read_json(seg / "control.json")
    scenario = _read_json(seg / SCENARIO_FILE)
    states = records.worker_states(seg)
    table = records.merge_segments(run_dir, seg)
    ended = max((s.get("updated_at", 0.0) for s in states.values()), default=time.time())
    warnings: list[str] = []
    finished = [s for s, f in zip(table.column("status").to_pylist(), table.column("in_flight").to_pylist()) if not f]
    ok_share = finished.count("ok") / len(finished) if finished else 0.0
    scheduler_lag = lag.summarise({w: s.get("lag", {}) for w, s in states.items()}, ok_share)
    if scheduler_lag.get("warning"):
        warnings.append(scheduler_lag["warning"])
    lateness = _lateness(table, scenario)
    if lateness.get("warning"):
        warnings.append(lateness["warning"])
    # A worker that never marked itself done was killed or crashed: what it flushed (every
    # second) is kept, the records of its last second and its open streams are lost.
    unfinished = missing if wait_s else sorted(w for w, s in states.items() if not s.get("done"))
    if unfinished:
        last = ", ".join(f"{w} (last flush {_iso(states.get(w, {}).get('updated_at'))})" for w in unfinished)
        warnings.append(f"workers did not finish (killed or crashed): {last}; records after their last flush "
                        "are lost (at most about 1 s of each)")
    # A worker that lost its master (killed, or the network to it cut) stopped early on its own: its
    # records are all there, but its users were missing from the rest of the run.
    cut_off = sorted(w for w, s in states.items() if s.get("lost") and w not in unfinished)
    if cut_off:
        warnings.append("workers stopped early: " + ", ".join(f"{w} ({states[w]['lost']})" for w in cut_off)
                        + "; Locust did not replace their users, the records' active_users say how many ran")
    lost = sorted({*unfinished, *cut_off})
    if lingering:
        warnings.append(f"Locust processes {', '.join(map(str, lingering))} did not exit after the drain time and "
                        "were killed")
    if locust_rc:
        warnings.append(f"Locust exited with code {locust_rc}; see {LOG_FILE}")
    if recovered:
        warnings.append("this run's `tokenload run` was killed; `tokenload analyze` finalised what its processes "
                        "had flushed")
    counts = table.group_by("worker").aggregate([("request_id", "count")]).to_pylist() if len(table) else []
    manifest = {
        "run_id": info.get("run_id"),
        "scenario": scenario,
        "channel": info.get("channel"),
        "versions": _versions(),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "started_at": info.get("started_at"),
        "ended_at": ended,
        "started_at_iso": _iso(info.get("started_at")),
        "ended_at_iso": _iso(ended),
        "stop_reason": control.get("stop_reason") or ("interrupted" if locust_rc or recovered else None),
        "drain": control.get("drain"),
        "workers_lost": lost,
        "plan": control.get("plan", []),
        "steps": control.get("steps", []),
        "storms": control.get("storms", []),
        "records": {
            "total": len(table),
            "in_flight": int(sum(table.column("in_flight").to_pylist())) if len(table) else 0,
            "per_worker": {c["worker"]: c["request_id_count"] for c in counts},
            "written_per_worker": {w: s.get("records") for w, s in states.items()},
        },
        "scheduler_lag": scheduler_lag,
        "open_loop_lateness": lateness,
        "warnings": warnings,
    }
    records.write_json(run_dir / MANIFEST_FILE, manifest)
    return table


def recover(run_dir: Path, quiet_s: float = RECOVER_QUIET_S) -> int | None:
    """Finalise a run whose `tokenload run` was killed; the number of records recovered, or None.

    None when there is nothing to recover (no segments, or already finalised).
    A run with a process that has not finished and flushed within the last
    `quiet_s` seconds may still be running: finalising it would seal it under
    that process, so that is a `ConfigError`.
    """
    seg = records.unfinalised(run_dir)
    if seg is None or (run_dir / REQUESTS_FILE).exists():
        return None
    states = records.worker_states(seg).values()
    latest = max((s.get("updated_at", 0.0) for s in states), default=0.0)
    running = not all(s.get("done") for s in states) and time.time() - latest < quiet_s
    if seg.name == records.SEGMENTS_DIR and running:
        raise ConfigError(f"{run_dir} is still being written (a Locust process flushed {time.time() - latest:.0f} s "
                          "ago); wait for the run to end, then analyse it")
    return len(finalise(run_dir, recovered=True))


def _lateness(table: Any, scenario: dict[str, Any]) -> dict[str, Any]:
    """How late open-loop sends were against their schedule (empty for closed loop)."""
    if (scenario.get("load") or {}).get("kind") not in OPEN_LOOP_KINDS or not len(table):
        return {}
    import numpy as np

    late = np.asarray(table.column("late_s").to_numpy(zero_copy_only=False), dtype=float)
    late = late[np.isfinite(late)]
    if not len(late):
        return {}
    frac = float((late > LATE_THRESHOLD_S).mean())
    out: dict[str, Any] = {"p50_s": float(np.percentile(late, 50)), "p99_s": float(np.percentile(late, 99)),
                           "max_s": float(late.max()), "late_fraction": frac, "threshold_s": LATE_THRESHOLD_S}
    if frac > LATE_WARN_FRACTION:
        out["warning"] = (f"the users could not keep up with the arrival rate: {frac:.0%} of sends were more than "
                          f"{LATE_THRESHOLD_S * 1000:.0f} ms late (p99 {out['p99_s']:.2f} s); raise [load] max_users")
    return out
