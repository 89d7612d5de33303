"""Run a scenario with Locust in a child process, then finalise the run directory.

Why a child process: Locust monkey-patches the whole interpreter with gevent
when imported, which would break the caller (`tokenload demo` runs an asyncio
simulator next to it) and makes Ctrl-C handling depend on Locust's internals.
The child runs the real `locust` command line (headless, `--web`, `--processes`,
`--master`, `--worker`), so everything Locust users know still applies. It gets
its own session: a Ctrl-C reaches only this process, which forwards exactly one
SIGINT to Locust's process group (master and forked workers), waits for it to
drain and flush, and finalises. A second Ctrl-C kills the group (the last
second of records may be lost, never more).

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
from typing import Any

from tokenload.channel import Channel
from tokenload.errors import ConfigError, HarnessError
from tokenload.load import handoff, lag, records, websession
from tokenload.load.scenario import Scenario
from tokenload.rundir import MANIFEST_FILE, REQUESTS_FILE

RUN_INFO = "run.json"
SCENARIO_FILE = "scenario.json"
LOG_FILE = "locust.log"
# Open-loop sends later than this count as late; more than LATE_WARN_FRACTION late means
# the user pool could not keep up with the arrival rate.
LATE_THRESHOLD_S = 0.010
LATE_WARN_FRACTION = 0.05


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


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """How Locust is spread over processes and machines."""

    processes: int = 0
    master: bool = False
    worker: bool = False
    master_host: str = "127.0.0.1"
    master_port: int = 5557
    master_bind_host: str = "127.0.0.1"
    expect_workers: int = 1

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
    for bad input; a Locust process that fails is reported in the manifest and by
    a `HarnessError` naming the log file.
    """
    scenario = scenario.with_overrides(users=users, duration_s=duration_s)
    if not scenario.channel.models:
        scenario = dataclasses.replace(scenario, channel=dataclasses.replace(scenario.channel, models=(channel.model,)))
    channel = dataclasses.replace(channel, first_token_timeout_s=scenario.channel.first_token_timeout_s,
                                  idle_timeout_s=scenario.channel.idle_timeout_s)
    if distribution.worker:
        if out_dir is None:
            raise ConfigError("a worker needs --out: the master's run directory, on a filesystem both machines share")
        run_dir = Path(out_dir)
        run_id, scenario_path = _join_master_run(run_dir)
        log_name = f"locust-worker-{socket.gethostname()}-{os.getpid()}.log"
    else:
        run_dir = Path(out_dir) if out_dir else default_run_dir(scenario.name)
        if (run_dir / REQUESTS_FILE).exists() or (run_dir / records.SEGMENTS_DIR).exists():
            raise ConfigError(f"run directory {run_dir} already holds a run; choose another --out")
        run_id = new_run_id()
        started = time.time()
        scenario_path = write_run_info(run_dir, run_id, scenario, channel.public())
        log_name = LOG_FILE
    command = [
        sys.executable, "-m", "locust", "-f", str(locustfile()),
        "--scenario", str(scenario_path), "--run-dir", str(run_dir), "--run-id", run_id,
        "--host", channel.base_url, "--stop-timeout", f"{scenario.stop.drain_s:g}",
        "--exit-code-on-error", "0", "--loglevel", "INFO",
        *(websession.locust_args(web_host, web_port) if web else ["--headless"]),
        *distribution.locust_args(),
    ]
    env = {**os.environ, **handoff.channel_to_env(channel), "TOKENLOAD_MANAGED": "1", "PYTHONUNBUFFERED": "1"}
    with open(run_dir / log_name, "ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        rc = _supervise(proc, run_dir, on_live)
    if distribution.worker:
        return run_dir
    if web:  # each start was a run of its own, finalised by the Locust master at its stop
        websession.session_runs(run_dir, since=started)
    else:
        finalise(run_dir, wait_s=scenario.stop.drain_s + 10 if distribution.master else 0.0, locust_rc=rc)
    if rc != 0:
        raise HarnessError(f"Locust exited with code {rc}; see {run_dir / LOG_FILE}")
    return run_dir


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
    """Wait for Locust, reporting live numbers; Ctrl-C stops it gracefully, twice kills it."""
    control = run_dir / records.SEGMENTS_DIR / "control.json"
    interrupts = 0
    while True:
        try:
            rc = proc.wait(timeout=0.5)
            return rc
        except subprocess.TimeoutExpired:
            if on_live is not None:
                live = _read_json(control).get("live")
                if live:
                    on_live(live)
        except KeyboardInterrupt:
            interrupts += 1
            sig = signal.SIGINT if interrupts == 1 else signal.SIGKILL
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass


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


def finalise(run_dir: Path, wait_s: float = 0.0, locust_rc: int | None = None) -> Path:
    """Merge the segments into requests.parquet and write manifest.json; returns `run_dir`."""
    seg = run_dir / records.SEGMENTS_DIR
    info, control = _read_json(seg / RUN_INFO), _read_json(seg / "control.json")
    scenario = _read_json(seg / SCENARIO_FILE)
    missing = records.wait_for_workers(run_dir, control.get("workers", []), wait_s) if wait_s else []
    states = records.worker_states(run_dir)
    table = records.merge_segments(run_dir)
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
    lost = missing if wait_s else sorted(w for w, s in states.items() if not s.get("done"))
    if lost:
        last = ", ".join(f"{w} (last flush {_iso(states.get(w, {}).get('updated_at'))})" for w in lost)
        warnings.append(f"workers did not finish (killed or crashed): {last}; records after their last flush "
                        "are lost (at most about 1 s of each)")
    if locust_rc:
        warnings.append(f"Locust exited with code {locust_rc}; see {LOG_FILE}")
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
        "stop_reason": control.get("stop_reason") or ("interrupted" if locust_rc else None),
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
    for name in (RUN_INFO, SCENARIO_FILE, "control.json"):
        (seg / name).unlink(missing_ok=True)
    for path in seg.glob("*.state.json"):
        path.unlink()
    if seg.is_dir() and not any(seg.iterdir()):
        seg.rmdir()
    return run_dir


def _lateness(table: Any, scenario: dict[str, Any]) -> dict[str, Any]:
    """How late open-loop sends were against their schedule (empty for closed loop)."""
    if (scenario.get("load") or {}).get("kind") != "poisson" or not len(table):
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
