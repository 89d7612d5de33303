"""One run per start: with Locust's web UI, every start is a run directory of its own.

Locust's web UI lets a user stop a test and start another (NEW / start, or
POST /swarm). Written into one run directory, two tests merged into one
analysis (a step "lasting" both tests, doubled rates). So on the master (or a
local runner) with the web UI:

- the first start uses the run directory and run id Locust was started with;
  every later start gets a new run id and a sibling directory (`DIR-2`,
  `DIR-3`, ...), its own `RunControl` (steps, stop conditions, control.json),
  and every process switches its record writer to it (the master tells the
  workers with `RUN_MESSAGE` at `test_start`, before the spawn messages on the
  same socket, so no request of the new test lands in the old run);
- at each stop every process closes its writer (plugin's `test_stop`), and a
  greenlet waits for every worker's final flush, merges requests.parquet,
  writes manifest.json (`runner.finalise`) and then runs `tokenload analyze`
  in a child process, so the UI never blocks; the tokenload tab links to each
  finished run's report.html;
- at quit a run still open is finalised before Locust exits (not analysed:
  the user is leaving).

Headless runs have exactly one start; the master still sends `RUN_MESSAGE`.
It is how every worker learns the run: its id, the resolved scenario, the
channel without secrets and the master's run directory. A worker asks for it
when it connects (`HELLO_MESSAGE`, answered to that worker alone) and gets it
again at each start; it builds its users' context from the first one and its
record writer from each (`courier.writer_for`: into the master's run directory
when it can see it, else a spool whose batches go to the master over Locust's
channel).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gevent
from locust.env import Environment

from tokenload.compat import python_module
from tokenload.load import courier, records, roles
from tokenload.load.control import CONTROL, RunControl
from tokenload.load.messages import HELLO_MESSAGE, RUN_MESSAGE, Announcement
from tokenload.load.rundirs import RUN_INFO, finalise, new_run_id, write_run_info
from tokenload.load.user import PROCESS
from tokenload.rundir import MANIFEST_FILE
from tokenload.workload.scenario import Scenario

REPORT_FILE = "report.html"
FINALISE_GRACE_S = 15.0  # beyond the drain time: workers' last flush after their users stopped


@dataclass
class Run:
    """One start of the test and its run directory's progress."""

    number: int
    run_id: str
    run_dir: Path
    control: RunControl | None
    state: str = "ready"  # ready | running | finalising | analysing | done | finalised (not analysed) | failed
    started_at: float | None = None
    stopped_at: float | None = None
    detail: str = ""

    def public(self) -> dict[str, Any]:
        return {"number": self.number, "run_id": self.run_id, "run_dir": str(self.run_dir), "state": self.state,
                "started_at": self.started_at, "stopped_at": self.stopped_at, "detail": self.detail,
                "report": (self.run_dir / REPORT_FILE).is_file() and self.state == "done"}


def sibling(first: Path, number: int) -> Path:
    """The run directory of the `number`-th start of a session whose first run is `first`."""
    return first if number == 1 else first.with_name(f"{first.name}-{number}")


class Series:
    """The runs of one Locust session, on the master or a local runner."""

    def __init__(self, environment: Environment, web: bool) -> None:
        opts = environment.parsed_options
        assert opts is not None
        self.role = roles.of(environment)
        control = self.role.need(CONTROL)
        self.environment = environment
        self.web = web
        self.scenario = control.scenario
        self.state = control.state  # every run's control shares this process's state
        self.runs = [Run(1, opts.run_id, Path(opts.run_dir), control)]
        info = Path(opts.run_dir) / records.SEGMENTS_DIR / RUN_INFO
        self._channel = json.loads(info.read_text(encoding="utf-8")).get("channel")
        self._channel_config = control.channel  # every run's doctor fix and storm probe use it
        self._channel_sources = control.sources
        self._finalisers: list[gevent.Greenlet] = []
        self._quitting = False

    @property
    def current(self) -> Run:
        return self.runs[-1]

    def next_run(self) -> Run | None:
        """Begin a new run for a new start; None when the current run has not started yet (or still runs)."""
        previous = self.current
        if previous.state in ("ready", "running"):
            return None
        number = previous.number + 1
        while sibling(self.runs[0].run_dir, number).exists():  # a directory left by an earlier session
            number += 1
        run_dir, run_id = sibling(self.runs[0].run_dir, number), new_run_id()
        write_run_info(run_dir, run_id, self.scenario, self._channel or {})
        env = self.environment
        control = self.role.put(CONTROL, RunControl(env, self.scenario, run_dir, self.state, self._channel_config,
                                                    self._channel_sources))
        switch_run(env, run_id, run_dir)
        run = Run(number, run_id, run_dir, control)
        self.runs.append(run)
        return run

    def announcement(self) -> Announcement:
        """`RUN_MESSAGE`'s data: what a worker needs to take part in the current run (no secrets)."""
        run = self.current
        return {"run_id": run.run_id, "run_dir": str(run.run_dir), "number": run.number,
                "scenario": self.scenario.to_dict(), "channel": self._channel}

    def run_dir_of(self, run_id: str) -> Path | None:
        return next((run.run_dir for run in self.runs if run.run_id == run_id), None)

    def on_test_start(self, **_: Any) -> None:
        run = self.current
        run.state, run.started_at = "running", time.time()
        self.role.to_workers(RUN_MESSAGE, self.announcement())

    def on_hello(self, environment: Environment, msg: Any, **_: Any) -> None:
        """A worker connected: tell it the current run (before any spawn message the master sends it later)."""
        self.role.to_workers(RUN_MESSAGE, self.announcement(), client_id=msg.node_id)

    def on_test_stop(self, **_: Any) -> None:
        run = self.current
        if run.state != "running":
            return
        run.state, run.stopped_at = "finalising", time.time()
        self._finalisers.append(gevent.spawn(self._finalise, run, not self._quitting))

    def on_quitting(self, **_: Any) -> None:
        self._quitting = True

    def on_quit(self, **_: Any) -> None:
        """Locust is exiting: a run still being finalised gets the time to finish (its records matter).

        A run that was never started is finalised too (empty): its directory is
        already there, and a run directory is either finalised or still running.
        """
        if self.current.state == "ready":
            self.current.state = "finalising"
            self._finalisers.append(gevent.spawn(self._finalise, self.current, False))
        gevent.joinall(self._finalisers, timeout=self.environment.stop_timeout + 2 * FINALISE_GRACE_S)

    def _finalise(self, run: Run, analyse: bool) -> None:
        try:
            finalise(run.run_dir, wait_s=self.environment.stop_timeout + FINALISE_GRACE_S
                     if self.role.has_workers else 0.0)
        except Exception as exc:  # reported in the tab and the log, the UI stays up
            run.state, run.detail = "failed", f"finalising failed: {type(exc).__name__}: {exc}"
            return
        finally:
            if self.role.get(CONTROL) is run.control:
                self.role.drop(CONTROL)  # its control.json is gone
        warnings = json.loads((run.run_dir / MANIFEST_FILE).read_text(encoding="utf-8")).get("warnings", [])
        run.detail = "; ".join(warnings)
        if not analyse:
            run.state = "finalised"
            return
        run.state = "analysing"
        proc = subprocess.run([*python_module("tokenload"), "analyze", str(run.run_dir)],
                              check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if (run.run_dir / REPORT_FILE).is_file():
            run.state = "done"
        else:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            run.state, run.detail = "failed", f"analyze exited {proc.returncode}: {lines[-1] if lines else ''}"


SERIES: roles.Part[Series] = roles.Part("series of runs")  # on the master or local process


def switch_run(environment: Environment, run_id: str, run_dir: Path, spool_root: Path | None = None) -> None:
    """Point this process at a new run: its run id, and a record writer for it.

    A worker's writer is `courier.writer_for`'s (its spool under `spool_root` when it cannot see `run_dir`).
    """
    opts = environment.parsed_options
    assert opts is not None
    opts.run_id, opts.run_dir = run_id, str(run_dir)
    role = roles.of(environment)
    ctx = role.get(PROCESS)
    if ctx is not None:
        ctx.run_id = run_id
        ctx.writer = courier.writer_for(environment, run_id, run_dir, spool_root, ctx.worker) \
            if role.follows else records.SegmentWriter(run_dir, ctx.worker)


def lead(environment: Environment) -> Series:
    """On the master or a local runner: track the runs; with the web UI, one run per start.

    A master also answers its workers' hellos and takes the records they send over Locust's channel (`courier`).
    """
    web = environment.web_ui is not None
    role = roles.of(environment)
    series = role.put(SERIES, Series(environment, web))
    events = environment.events
    events.test_start.add_listener(series.on_test_start)
    if web:
        events.test_stop.add_listener(series.on_test_stop)
        events.quitting.add_listener(series.on_quitting)
        events.quit.add_listener(series.on_quit)
    if role.has_workers:
        role.listen(HELLO_MESSAGE, series.on_hello)
        courier.receive(environment, series.run_dir_of)
    return series


def follow_master(environment: Environment, join: Callable[[Scenario, dict[str, Any]], None]) -> None:
    """On a worker: join the master's run at the first `RUN_MESSAGE`, switch to each run it announces later.

    `join(scenario, channel)` builds this process's part of the run from the master's resolved scenario and
    channel (no secrets). A worker started with its own --run-dir (`tokenload run --worker --out DIR`) maps
    the master's later runs to siblings of DIR: the master's path may be relative to another machine's working
    directory. Whether DIR holds the master's run (a shared filesystem) or is only a spool decides
    `courier.writer_for`.
    """
    role = roles.of(environment)
    opts = environment.parsed_options
    assert opts is not None
    own = Path(opts.run_dir) if opts.run_dir else None

    def on_run(environment: Environment, msg: Any, **_: Any) -> None:
        data: Announcement = msg.data
        ctx = role.get(PROCESS)
        if ctx is not None and data["run_id"] == ctx.run_id:
            return
        if ctx is None:
            scenario = data["scenario"]
            join(Scenario.from_dict(scenario, "the master's resolved scenario", Path("."), scenario.get("name", "")),
                 data.get("channel") or {})
        run_dir = Path(data["run_dir"])
        if own is not None:
            run_dir = own if data["number"] == 1 else own.with_name(run_dir.name)
        switch_run(environment, data["run_id"], run_dir, own)

    role.listen(RUN_MESSAGE, on_run)
    role.to_master(HELLO_MESSAGE)
