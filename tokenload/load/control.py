"""Sharing the shape's decisions: the current step with every process, the run's state with `tokenload run`.

Users label each request with the step and user level it was sent in, but the
shape runs only on the master. When a phase begins the master sends it to the
workers as a custom Locust message (ahead of the spawn messages on the same
socket, so new users already see their step); a local runner sets it directly.
Open-loop rates are split evenly between the workers.

The master also keeps `segments/control.json` up to date once a second: the
steps so far with their request and error counts, the live numbers that
`tokenload run` shows, the worker ids (the merge waits for each of them) and,
at the end, why the run stopped.

Request and token limits are enforced where the requests are sent, not from
Locust's aggregated stats (read about once a second, 3 s behind on a master,
so fast failures overshot a limit of 200 to 2810): each process gets a share
of `[stop] max_requests` / `max_tokens` (`Budget`; split between workers by the
master in its first step message) and a user takes a ticket before each send.
Once a process's share is used up its users park, it tells the master
(`BUDGET_MESSAGE`), and the run stops when every process is spent. A request
limit is therefore never exceeded; a token budget by at most the requests in
flight when it ran out. The breakpoint checks read the run's live token
statistics (`tokenstats.current_run`, merged from the workers about every 3 s):
good enough for deciding when to stop, never used for reported numbers.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from tokenload import errors as ek
from tokenload.load.records import SEGMENTS_DIR, write_json
from tokenload.load.scenario import Scenario
from tokenload.load.shapes import Phase, build_plan
from tokenload.load.tokenstats import Hist, current_run

STEP_MESSAGE = "tokenload_step"
BUDGET_MESSAGE = "tokenload_budget_spent"
CONTROL_FILE = "control.json"
# Error kinds that mean the channel itself is misconfigured, and how many requests
# (all failed, all with these kinds) end a run early.
CONFIG_ERROR_KINDS = (ek.AUTH, ek.NOT_FOUND_MODEL, ek.BAD_BASE_URL)
MISCONFIGURED_AFTER = 20
# Locust's request type for an LLM request (one Locust request per LLM request).
REQUEST_TYPE = "POST"


class Budget:
    """One process's share of the request and token limits (None = unlimited; 0 = none left)."""

    __slots__ = ("max_requests", "max_tokens", "sent", "tokens", "spent", "on_spent")

    def __init__(self, max_requests: int | None, max_tokens: int | None,
                 on_spent: Callable[[Budget], None] | None = None) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.sent = 0
        self.tokens = 0
        self.spent: str | None = None
        self.on_spent = on_spent

    def admit(self) -> bool:
        """Take a ticket for one request; False once the share is used up."""
        if self.spent is None:
            if self.max_requests is not None and self.sent >= self.max_requests:
                self._spend(f"max_requests: {self.sent} sent")
            elif self.max_tokens is not None and self.tokens >= self.max_tokens:
                self._spend(f"token budget: {self.tokens} tokens")
            else:
                self.sent += 1
                return True
        return False

    def finished(self, tokens: int) -> None:
        """A request ended having used `tokens` (input + output)."""
        self.tokens += tokens
        if self.spent is None and self.max_tokens is not None and self.tokens >= self.max_tokens:
            self._spend(f"token budget: {self.tokens} tokens")
        elif self.spent is None and self.max_requests is not None and self.sent >= self.max_requests:
            self._spend(f"max_requests: {self.sent} sent")

    def _spend(self, reason: str) -> None:
        self.spent = reason
        if self.on_spent is not None:
            self.on_spent(self)


def shares(total: int, workers: list[str]) -> dict[str, int | None]:
    """Split a limit between workers as evenly as integers allow (a limit of 0 means none: None each)."""
    n = len(workers)
    return {w: (total // n + (i < total % n)) if total else None for i, w in enumerate(workers)}


@dataclass
class LoadState:
    """What every process knows about the current phase (its share of the rate and limits)."""

    step: int = 0
    users: int = 0
    rate: float | None = None
    budget: Budget | None = None
    started_at: float = 0.0  # wall time the phase began on the shape's clock
    plan_ends_at: float = 0.0  # wall time the whole plan ends (no open-loop send is scheduled after it)


@dataclass(frozen=True)
class Snapshot:
    """Cumulative counters of the current run at one moment (from `tokenstats.current_run`)."""

    requests: int
    failures: int
    tokens: int
    ttft: Hist
    tpot: Hist

    @classmethod
    def take(cls, environment: Environment) -> Snapshot:
        total = current_run(environment).total()
        return cls(total.requests, total.errors, total.input_tokens + total.output_tokens,
                   Hist(total.hists["ttft"]), Hist(total.hists["tpot"]))

    def since(self, earlier: Snapshot) -> dict[str, Any]:
        """Counts and TTFT/TPOT percentiles (s) between `earlier` and this snapshot."""
        out: dict[str, Any] = {"requests": self.requests - earlier.requests, "failures": self.failures - earlier.failures}
        out["error_rate"] = out["failures"] / out["requests"] if out["requests"] else 0.0
        for name, now, before in (("ttft", self.ttft, earlier.ttft), ("tpot", self.tpot, earlier.tpot)):
            diff = Hist(now - before)
            for pct in (50, 95):
                out[f"{name}_p{pct}_s"] = diff.percentile(pct)
        return out


def install_step_listener(environment: Environment, state: LoadState) -> None:
    """On a worker: follow the master's phase announcements."""

    runner = environment.runner
    assert isinstance(runner, WorkerRunner)

    def spent(budget: Budget) -> None:
        runner.send_message(BUDGET_MESSAGE, {"worker": runner.client_id, "reason": budget.spent,
                                             "sent": budget.sent, "tokens": budget.tokens})

    def on_step(environment: Environment, msg: Any, **_: Any) -> None:
        data = msg.data
        state.step, state.users = data["step"], data["users"]
        state.rate = None if data["rate"] is None else data["rate"] / max(1, data["workers"])
        state.started_at, state.plan_ends_at = data["started_at"], data["plan_ends_at"]
        share = (data.get("budget") or {}).get(runner.client_id)
        if share is not None and (state.budget is None or data["step"] == 1):  # step 1: a (re)started test
            state.budget = Budget(share[0], share[1], spent)

    runner.register_message(STEP_MESSAGE, on_step)


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
        self.budgets: dict[str, list[int | None]] = {}  # master: each worker's [requests, tokens] share
        self.spent: dict[str, dict[str, Any]] = {}  # master: workers whose share is used up
        runner = environment.runner
        if isinstance(runner, MasterRunner):
            runner.register_message(BUDGET_MESSAGE, self._on_spent)

    def _on_spent(self, environment: Environment, msg: Any, **_: Any) -> None:
        self.spent[msg.data["worker"]] = msg.data

    @property
    def limited(self) -> bool:
        return bool(self.scenario.stop.max_requests or self.scenario.stop.max_tokens)

    def _snapshot(self) -> Snapshot:
        return Snapshot.take(self.environment)

    def _close_step(self) -> dict[str, Any] | None:
        if not self.steps or self._step_start is None:
            return None
        step = self.steps[-1]
        if "ended_at" not in step:
            step.update(self._snapshot().since(self._step_start), ended_at=time.time())
        return step

    def enter(self, phase: Phase, clock_zero: float) -> None:
        """A new phase begins: close the previous step, tell every process.

        `clock_zero` is the wall time of the shape's elapsed 0: open-loop arrivals
        are scheduled from the phase's start on that clock, not from whenever
        the first user got going, so a run offers `rate x duration` requests.
        """
        self._close_step()
        if phase.step == 1:  # a test (re)started from the web UI starts with whole budgets
            self.budgets, self.spent, self.state.budget = {}, {}, None
        self._step_start = self._snapshot()
        self.steps.append({**asdict(phase), "started_at": time.time()})
        runner = self.environment.runner
        stop = self.scenario.stop
        timing = {"started_at": clock_zero + phase.start_s, "plan_ends_at": clock_zero + self.plan[-1].end_s}
        if isinstance(runner, MasterRunner):
            self.workers.update(runner.clients.keys())
            message: dict[str, Any] = {**asdict(phase), "workers": max(1, runner.worker_count), **timing}
            if self.limited and not self.budgets:  # shares are fixed by the workers present at the start
                ids = sorted(runner.clients.keys())
                req, tok = shares(stop.max_requests, ids), shares(stop.max_tokens, ids)
                self.budgets = {w: [req[w], tok[w]] for w in ids}
            if self.budgets:
                message["budget"] = self.budgets
            runner.send_message(STEP_MESSAGE, message)
        else:
            self.state.step, self.state.users, self.state.rate = phase.step, phase.users, phase.rate
            self.state.started_at, self.state.plan_ends_at = timing["started_at"], timing["plan_ends_at"]
            if self.limited and self.state.budget is None:
                self.state.budget = Budget(stop.max_requests or None, stop.max_tokens or None)

    def stop_reason(self, elapsed_s: float, phase: Phase | None, current: Phase | None) -> str | None:
        """Why the run must stop now, or None to go on."""
        stop = self.scenario.stop
        if phase is None:
            return "duration" if stop.duration_s and elapsed_s >= stop.duration_s else "plan complete"
        budget = self.state.budget
        if budget is not None and budget.spent:  # local runner: its own budget
            return budget.spent
        if self.budgets and set(self.budgets) <= set(self.spent):  # master: every worker's share used
            sent = sum(s["sent"] for s in self.spent.values())
            tokens = sum(s["tokens"] for s in self.spent.values())
            kind = "token budget" if all(s["reason"].startswith("token") for s in self.spent.values()) else "max_requests"
            return f"{kind}: every worker spent its share ({sent} requests, {tokens} tokens)"
        totals = self._snapshot()
        misconfigured = self._misconfigured(totals)
        if misconfigured:
            return misconfigured
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

    def _misconfigured(self, totals: Snapshot) -> str | None:
        """Stop a run whose first requests all failed on the channel's configuration.

        A wrong key, base URL or model fails every request the same way; hammering
        the channel with thousands of them measures nothing (and may get the key
        blocked), so the run stops and points at `tokenload doctor`.
        """
        if totals.requests < MISCONFIGURED_AFTER or totals.failures < totals.requests:
            return None
        stats = self.environment.runner.stats  # type: ignore[union-attr]
        kinds: Counter[str] = Counter()
        for error in stats.errors.values():
            # The exception itself in this process; its repr once it came from a worker's report.
            text = error.error if isinstance(error.error, str) else repr(error.error)
            kind = next((k for k in CONFIG_ERROR_KINDS if f"'{k} (" in text), None)
            if kind is None:
                return None
            kinds[kind] += error.occurrences
        if not kinds:
            return None
        kind, count = kinds.most_common(1)[0]
        return (f"channel misconfigured: all {totals.requests} requests failed ({count} with {kind}); "
                "run `tokenload doctor` with the same channel options")

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
