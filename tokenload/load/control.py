"""Sharing the shape's decisions: the current step with every process, the run's state with `tokenload run`.

Users label each request with the step and user level it was sent in, but the
shape runs only on the master. When a phase begins the master sends it to the
workers as a custom Locust message (ahead of the spawn messages on the same
socket, so new users already see their step); a local runner sets it directly.
Open-loop rates are split evenly between the workers.

The master also keeps `segments/control.json` up to date once a second: the
steps so far with their request and error counts, the live numbers that
`tokenload run` shows, the worker ids (the merge waits for each of them) and,
at the end, why the run stopped. Stop conditions are read from Locust's
aggregated stats: good enough for deciding when to stop (rounded histogram,
3 s worker report lag), never used for reported numbers.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner
from locust.stats import RequestStats, calculate_response_time_percentile

from tokenload.load.records import SEGMENTS_DIR, write_json
from tokenload.load.scenario import Scenario
from tokenload.load.shapes import Phase, build_plan

STEP_MESSAGE = "tokenload_step"
CONTROL_FILE = "control.json"
# Locust stats request types; TTFT/TPOT/E2E carry milliseconds (per token for TPOT).
REQUEST_TYPE, TTFT, TPOT, E2E = "POST", "TTFT", "TPOT", "E2E"


@dataclass
class LoadState:
    """What every process knows about the current phase (its share of the rate)."""

    step: int = 0
    users: int = 0
    rate: float | None = None


@dataclass(frozen=True)
class Snapshot:
    """Cumulative counters from Locust's stats at one moment."""

    requests: int
    failures: int
    tokens: int
    ttft: Counter
    tpot: Counter

    @classmethod
    def take(cls, stats: RequestStats) -> Snapshot:
        requests = failures = tokens = 0
        hist: dict[str, Counter] = {TTFT: Counter(), TPOT: Counter()}
        for (_, method), entry in list(stats.entries.items()):
            if method == REQUEST_TYPE:
                requests += entry.num_requests  # failures included
                failures += entry.num_failures
                tokens += entry.total_content_length
            elif method in hist:
                hist[method].update(entry.response_times)
        return cls(requests, failures, tokens, hist[TTFT], hist[TPOT])

    def since(self, earlier: Snapshot) -> dict[str, Any]:
        """Counts and TTFT/TPOT percentiles (s) between `earlier` and this snapshot."""
        out: dict[str, Any] = {"requests": self.requests - earlier.requests, "failures": self.failures - earlier.failures}
        out["error_rate"] = out["failures"] / out["requests"] if out["requests"] else 0.0
        for name, now, before in ((TTFT, self.ttft, earlier.ttft), (TPOT, self.tpot, earlier.tpot)):
            diff = now - before
            n = sum(diff.values())
            for pct in (50, 95):
                value = calculate_response_time_percentile(diff, n, pct / 100) / 1000 if n else None
                out[f"{name.lower()}_p{pct}_s"] = value
        return out


def install_step_listener(environment: Environment, state: LoadState) -> None:
    """On a worker: follow the master's phase announcements."""

    def on_step(environment: Environment, msg: Any, **_: Any) -> None:
        data = msg.data
        state.step, state.users = data["step"], data["users"]
        state.rate = None if data["rate"] is None else data["rate"] / max(1, data["workers"])

    assert isinstance(environment.runner, WorkerRunner)
    environment.runner.register_message(STEP_MESSAGE, on_step)


class RunControl:
    """Master-side (or local) run state: plan, stop conditions, step publishing, control.json."""

    def __init__(self, environment: Environment, scenario: Scenario, run_dir: Path, state: LoadState) -> None:
        self.environment = environment
        self.scenario = scenario
        self.plan = build_plan(scenario)
        self.state = state
        self.path = run_dir / SEGMENTS_DIR / CONTROL_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.steps: list[dict[str, Any]] = []
        self.workers: set[str] = set()
        self.stopped: str | None = None
        self._step_start: Snapshot | None = None
        self._started_at = time.time()

    def _snapshot(self) -> Snapshot:
        return Snapshot.take(self.environment.runner.stats)  # type: ignore[union-attr]

    def _close_step(self) -> dict[str, Any] | None:
        if not self.steps or self._step_start is None:
            return None
        step = self.steps[-1]
        if "ended_at" not in step:
            step.update(self._snapshot().since(self._step_start), ended_at=time.time())
        return step

    def enter(self, phase: Phase) -> None:
        """A new phase begins: close the previous step, tell every process."""
        self._close_step()
        self._step_start = self._snapshot()
        self.steps.append({**asdict(phase), "started_at": time.time()})
        runner = self.environment.runner
        if isinstance(runner, MasterRunner):
            self.workers.update(runner.clients.keys())
            runner.send_message(STEP_MESSAGE, {**asdict(phase), "workers": max(1, runner.worker_count)})
        else:
            self.state.step, self.state.users, self.state.rate = phase.step, phase.users, phase.rate

    def stop_reason(self, elapsed_s: float, phase: Phase | None, current: Phase | None) -> str | None:
        """Why the run must stop now, or None to go on."""
        stop = self.scenario.stop
        if phase is None:
            return "duration" if stop.duration_s and elapsed_s >= stop.duration_s else "plan complete"
        totals = self._snapshot()
        if stop.max_requests and totals.requests >= stop.max_requests:
            return f"max_requests: {totals.requests} >= {stop.max_requests}"
        if stop.max_tokens and totals.tokens >= stop.max_tokens:
            return f"token budget: {totals.tokens} >= {stop.max_tokens}"
        if current is not None and phase != current and self._step_start is not None:
            step = self._close_step()
            assert step is not None
            if stop.breakpoint_error_rate and step["requests"] and step["error_rate"] > stop.breakpoint_error_rate:
                return (f"breakpoint: step {current.step} ({current.users} users) error rate "
                        f"{step['error_rate']:.2f} > {stop.breakpoint_error_rate:g}")
            p95 = step.get("ttft_p95_s")
            if stop.breakpoint_ttft_p95_s and p95 is not None and p95 > stop.breakpoint_ttft_p95_s:
                return (f"breakpoint: step {current.step} ({current.users} users) TTFT p95 "
                        f"{p95:.2f} s > {stop.breakpoint_ttft_p95_s:g} s")
        return None

    def finish(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
            self._close_step()
            self.write_live()

    def live(self) -> dict[str, Any]:
        """The numbers for `tokenload run`'s live line: the current step so far."""
        runner = self.environment.runner
        snap = self._snapshot()
        current = snap.since(self._step_start) if self._step_start is not None else {}
        started = self.steps[-1]["started_at"] if self.steps else self._started_at
        return {
            "elapsed_s": time.time() - self._started_at,
            "step": self.steps[-1]["step"] if self.steps else 0,
            "target_users": self.steps[-1]["users"] if self.steps else 0,
            "users": runner.user_count if runner else 0,
            "requests": snap.requests,
            "errors": snap.failures,
            "step_rps": current.get("requests", 0) / max(1e-9, time.time() - started),
            **{k: current.get(k) for k in ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s")},
        }

    def write_live(self) -> None:
        runner = self.environment.runner
        if isinstance(runner, MasterRunner):
            self.workers.update(runner.clients.keys())
        write_json(self.path, {
            "started_at": self._started_at,
            "plan": [asdict(p) for p in self.plan],
            "steps": self.steps,
            "stop_reason": self.stopped,
            "workers": sorted(self.workers),
            "live": self.live(),
            "updated_at": time.time(),
        })
