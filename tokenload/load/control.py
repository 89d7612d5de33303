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
Locust's aggregated stats (read about once a second, 3 s behind on a master:
fast failures overshoot a limit read there): each process gets a share
of `[stop] max_requests` / `max_tokens` (`Budget`; split between workers by the
master in its first step message) and a user takes a ticket before each send.
Once a process's share is used up its users park, it tells the master
(`BUDGET_MESSAGE`), and the run stops when every process is spent. A request
limit is therefore never exceeded; a token budget by at most the requests in
flight when it ran out. The breakpoint checks read the run's live token
statistics (`tokenstats.current_run`, merged from the workers about every 3 s):
good enough for deciding when to stop, never used for reported numbers.

The stop rules themselves are pure functions in `stoprules.py`; this module
gathers their input. Two of them need news faster than the 3-s worker reports:
configuration errors are counted where they happen (`FailFast`: a process parks
its users after `[stop] config_errors` in a row and a worker reports each one to
the master at once, `FAILFAST_MESSAGE`), and the error-storm breaker pauses every
process's users (`PAUSE_MESSAGE`) and then probes the channel itself, once every
`storm_s`, until a probe succeeds (the users resume) or `storm_probes` failed
(the run stops).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from locust.env import Environment

from tokenload.channel import Channel
from tokenload.contracts.manifest import StopRecord
from tokenload.load import roles, stoprules
from tokenload.load.drain import ANSWERED, Drain, derive, initial
from tokenload.load.messages import (
    BUDGET_MESSAGE,
    DRAIN_MESSAGE,
    FAILFAST_MESSAGE,
    PAUSE_MESSAGE,
    STEP_MESSAGE,
    BudgetSpent,
    ConfigErrors,
    Step,
)
from tokenload.load.plan import Phase, build_plan
from tokenload.load.probing import Prober
from tokenload.load.records import SEGMENTS_DIR, AsideWriter, write_json
from tokenload.load.state import Budget, LoadState, shares
from tokenload.load.stoprules import Counts, FailureStreak, Live
from tokenload.load.tokenstats import Snapshot, current_run, live_thresholds
from tokenload.record import STORM_PROBE, RequestRecord
from tokenload.thresholds import parse as parse_threshold
from tokenload.workload.scenario import Scenario

log = logging.getLogger(__name__)

CONTROL_FILE = "control.json"
INTERRUPTED = "interrupted"  # the stop reason of a Ctrl-C (or a lost parent): it drains for the floor only
# Locust's request type for an LLM request (one Locust request per LLM request).
REQUEST_TYPE = "POST"


class EarlyMessages:
    """On a worker, from its start: the master's step, drain and pause messages, kept until the worker has joined
    the run and then handed to its listeners in order.

    A worker joins when the master's run message comes (the answer to its hello, or the test's start), and the
    master may send its first step message before that: it starts the plan as soon as every worker is ready,
    which can be before it has read a worker's hello. Locust drops a message nobody listens to, and that one
    carries the worker's share of `max_requests`: without it the worker sent until the master stopped the run
    (60 requests of a 40 limit, with the machine busy).
    """

    NAMES = (STEP_MESSAGE, DRAIN_MESSAGE, PAUSE_MESSAGE)

    def __init__(self, role: roles.Role) -> None:
        self._listeners: dict[str, Callable[..., None]] = {}
        self._kept: list[tuple[str, Environment, Any]] = []
        for name in self.NAMES:
            role.listen(name, self._receiver(name))

    def _receiver(self, name: str) -> Callable[..., None]:
        def receive(environment: Environment, msg: Any, **_: Any) -> None:
            listener = self._listeners.get(name)
            if listener is None:
                self._kept.append((name, environment, msg))
            else:
                listener(environment, msg)
        return receive

    def listen(self, listeners: Mapping[str, Callable[..., None]]) -> None:
        """From now on each message goes to its listener; the ones kept so far go first, in the order they came."""
        self._listeners = dict(listeners)
        kept, self._kept = self._kept, []
        for name, environment, msg in kept:
            self._listeners[name](environment, msg)


def install_step_listener(role: roles.Role, state: LoadState, inbox: EarlyMessages) -> None:
    """On a worker: follow the master's phase announcements and pauses (those that came before this call
    included: `inbox`); report configuration errors."""

    def spent(budget: Budget) -> None:
        report: BudgetSpent = {"worker": role.worker_id, "reason": budget.spent, "sent": budget.sent,
                               "tokens": budget.tokens}
        role.to_master(BUDGET_MESSAGE, report)

    def on_step(environment: Environment, msg: Any, **_: Any) -> None:
        data: Step = msg.data
        state.follow(data["step"], data["users"], None if data["rate"] is None else data["rate"] / max(1, data["workers"]),
                     data["spawn_rate"], data["spread_s"])
        state.pacer.workers = max(1, data["workers"])
        state.started_at, state.plan_ends_at = data["started_at"], data["plan_ends_at"]
        share = (data.get("budget") or {}).get(role.worker_id)
        if share is not None and (state.budget is None or data["step"] == 1):  # step 1: a (re)started test
            state.budget = Budget(share[0], share[1], spent)
        if data["step"] == 1:
            state.run_started_at = data["started_at"]
            state.new_test()

    def config_errors(streak: int, last: dict[str, Any] | None) -> None:
        report: ConfigErrors = {"worker": role.worker_id, "streak": streak, "last": last}
        role.to_master(FAILFAST_MESSAGE, report)

    state.failfast.report = config_errors
    def on_drain(environment: Environment, msg: Any, **_: Any) -> None:
        environment.stop_timeout = msg.data["drain_s"]  # ahead of the master's stop or quit on the same socket

    inbox.listen({STEP_MESSAGE: on_step, DRAIN_MESSAGE: on_drain,
                  PAUSE_MESSAGE: lambda environment, msg, **_: state.pause(msg.data["paused"])})


class RunControl:
    """Master-side (or local) run state: plan, stop rules, step publishing, the breaker, control.json."""

    def __init__(self, environment: Environment, scenario: Scenario, run_dir: Path, state: LoadState,
                 channel: Channel | None = None, sources: Mapping[str, str] | None = None) -> None:
        """`sources`: where each channel field came from, for a fix in the user's terms (default: flags)."""
        self.environment = environment
        self.role = roles.of(environment)
        # The drain in force: a fixed one, or the floor until `finish` derives it (`drain.py`).
        flag = getattr(environment.parsed_options, "stop_timeout", None)
        self.drain = initial(scenario.stop.drain_s, scenario.stop.drain_min_s, flag)
        self._floor = self.drain
        self.scenario = scenario
        self.channel = channel  # for doctor's fix and the breaker's probe
        self.sources = sources
        self.plan = build_plan(scenario)
        run_id = str(getattr(environment.parsed_options, "run_id", "") or "")
        self.prober = Prober(scenario, run_dir, run_id) if scenario.load.search is not None else None
        self.run_id, self.run_dir = run_id, run_dir
        self._probes: AsideWriter | None = None  # the breaker's probe records, from its first probe on
        environment.stop_timeout = self._stop_timeout()
        self.state = state
        self.path = run_dir / SEGMENTS_DIR / CONTROL_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.steps: list[dict[str, Any]] = []
        self.workers: set[str] = set()
        self.stopped: str | None = None
        self.stop_record: StopRecord | None = None  # the rule that stopped the run, by name and fields
        # the thresholds that stop the run once the live statistics decide them breached
        self.aborting = [parse_threshold(c.expr, abort_on_fail=True) for c in scenario.thresholds.checks
                         if c.abort_on_fail]
        self._step_start: Snapshot | None = None
        self._started_at = time.time()
        self.budgets: dict[str, list[int | None]] = {}  # master: each worker's [requests, tokens] share
        self.spent: dict[str, dict[str, Any]] = {}  # master: workers whose share is used up
        self.config_errors: dict[str, dict[str, Any]] = {}  # master: each worker's latest streak report
        self.storms: list[dict[str, Any]] = []  # every breaker pause: when, why, probes, outcome
        self._window: deque[tuple[float, Counts]] = deque()  # the breaker's recent snapshots
        self._streak = FailureStreak(time.monotonic())  # the breaker's load failures in a row
        # A new run (web UI) takes over from the previous one; a local process never gets these (no workers).
        self.role.listen(BUDGET_MESSAGE, self._on_spent, replace=True)
        self.role.listen(FAILFAST_MESSAGE, self._on_config_errors, replace=True)

    def _on_spent(self, environment: Environment, msg: Any, **_: Any) -> None:
        self.spent[msg.data["worker"]] = msg.data

    def _on_config_errors(self, environment: Environment, msg: Any, **_: Any) -> None:
        self.config_errors[msg.data["worker"]] = msg.data

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
        if phase.step == 1:  # a test (re)started from the web UI starts with whole budgets and the first drain
            self.budgets, self.spent, self.state.budget = {}, {}, None
            self.config_errors = {}
            self.state.new_test()
            self.drain = self._floor
            self.environment.stop_timeout = self._stop_timeout()
        self._step_start = self._snapshot()
        self.steps.append({**asdict(phase), "started_at": time.time()})
        stop = self.scenario.stop
        started_at, plan_ends_at = clock_zero + phase.start_s, clock_zero + self.plan[-1].end_s
        if self.role.has_workers:
            ids = sorted(worker.id for worker in self.role.workers())
            self.workers.update(ids)
            message: Step = {"step": phase.step, "start_s": phase.start_s, "end_s": phase.end_s, "users": phase.users,
                             "rate": phase.rate, "workers": max(1, self.role.worker_count), "started_at": started_at,
                             "plan_ends_at": plan_ends_at, "spawn_rate": phase.spawn_rate, "spread_s": phase.spread_s}
            if self.limited and not self.budgets:  # shares are fixed by the workers present at the start
                req, tok = shares(stop.max_requests, ids), shares(stop.max_tokens, ids)
                self.budgets = {w: [req[w], tok[w]] for w in ids}
            if self.budgets:
                message["budget"] = self.budgets
            self.role.to_workers(STEP_MESSAGE, message)
        else:
            self.state.follow(phase.step, phase.users, phase.rate, phase.spawn_rate, phase.spread_s)
            self.state.started_at, self.state.plan_ends_at = started_at, plan_ends_at
            if phase.step == 1:
                self.state.run_started_at = started_at
            if self.limited and self.state.budget is None:
                self.state.budget = Budget(stop.max_requests or None, stop.max_tokens or None)

    def _config_streak(self) -> tuple[int, dict[str, Any] | None]:
        """Configuration errors in a row, summed over processes, and the latest one."""
        if self.role.has_workers:
            reports = [r for r in self.config_errors.values() if r["streak"]]
            return sum(r["streak"] for r in reports), next((r["last"] for r in reports), None)
        return self.state.failfast.streak, self.state.failfast.last

    def stop_reason(self, elapsed_s: float, phase: Phase | None, current: Phase | None) -> str | None:
        """Why the run must stop now, or None to go on (the first of `stoprules.RULES` that fires)."""
        totals = self._snapshot().counts
        ended = None
        if phase is not None and current is not None and phase != current and self._step_start is not None:
            ended = self._close_step()
        storm = self.storms[-1] if self.storms and self.storms[-1].get("outcome") is None else None
        if phase is not None:
            storm = self._breaker(totals, storm)
        budget = self.state.budget
        all_spent = bool(self.budgets) and set(self.budgets) <= set(self.spent)
        streak, last = self._config_streak()
        live = Live(
            elapsed_s=elapsed_s, plan_over=phase is None, stop=self.scenario.stop, totals=totals, ended_step=ended,
            budget_spent=budget.spent if budget is not None else None,
            workers_spent=self.spent if all_spent else {}, config_streak=streak, config_error=last,
            storm_failed_probes=storm["failed_probes"] if storm else 0, storm_detail=storm["detail"] if storm else None,
            thresholds=live_thresholds(current_run(self.environment).total(), self.aborting) if self.aborting else (),
        )
        fired = stoprules.first_stop(live)
        if fired is None:
            return None
        rule, reason = fired
        if self.stopped is None:
            self.stop_record = stoprules.record(rule, reason, live)
        if storm is not None:  # the run ends with the users paused
            storm["outcome"] = "stopped"
        if rule == "misconfigured" and last is not None:
            reason += self._doctor_fix(last["kind"])
            # Locust's log and console too, not only manifest.json: under plain `locust -f` nothing else says it.
            log.error("tokenload: stopping the run: %s", reason)
        else:
            log.info("tokenload: stopping the run: %s", reason)
        return reason

    def _doctor_fix(self, kind: str) -> str:
        """Doctor's finding and exact fix for a configuration error kind (its base-URL, auth or model check)."""
        if self.channel is None:
            return "; run `tokenload doctor` with the same channel options"
        from tokenload.doctor import explain

        result = explain(self.channel, kind, sources=self.sources)
        if result is None:
            return "; run `tokenload doctor` with the same channel options"
        return f"; doctor: {result.saw}; fix: {result.fix or 'see tokenload doctor'}"

    def _breaker(self, totals: Counts, storm: dict[str, Any] | None) -> dict[str, Any] | None:
        """The error-storm breaker: pause every user on a storm, probe every `storm_s`, resume on success.

        Returns the open storm (users paused), if any.
        """
        stop, now = self.scenario.stop, time.monotonic()
        if storm is None:
            self._window.append((now, totals))
            self._streak.observe(totals, now)
            while len(self._window) > 1 and self._window[1][0] <= now - stop.storm_s:  # keep one at the window's start
                self._window.popleft()
            if now - self._window[0][0] < stop.storm_s * 0.9:  # not a whole window yet
                return None
            detail = stoprules.storm(totals.minus(self._window[0][1]), stop, self.role.user_count,
                                     self._streak.streak, self._streak.quiet_s(now))
            if detail is None:
                return None
            storm = {"paused_at": time.time(), "detail": detail, "failed_probes": 0, "outcome": None,
                     "_next": now + stop.storm_s}
            self.storms.append(storm)
            self._pause(True)
            return storm
        if now < storm["_next"]:
            return storm
        ok, what = self._probe()
        if ok:
            storm.update(outcome="resumed", resumed_at=time.time())
            self._window.clear()
            self._streak.restart(now)
            self._pause(False)
            return None
        storm["failed_probes"] += 1
        storm["last_probe"] = what
        storm["_next"] = now + stop.storm_s
        return storm

    def _pause(self, paused: bool) -> None:
        if self.role.has_workers:
            self.role.to_workers(PAUSE_MESSAGE, {"paused": paused})
        else:
            self.state.pause(paused)

    def _probe(self) -> tuple[bool, str]:
        """One small streaming request: is the channel answering again? Recorded (phase `storm_probe`), so the
        records hold every request the channel saw."""
        if self.channel is None:
            return True, "no channel to probe"
        from tokenload.transport.httpx_client import stream_exchange

        record, _ = stream_exchange(self.channel, "Reply with OK.", 1, answered=True)
        self._keep_probe(record)
        return record["status"] == "ok", record["error_kind"] or "ok"

    def _keep_probe(self, record: RequestRecord) -> None:
        if self._probes is None:
            self._probes = AsideWriter(self.run_dir, "breaker")
        duration = record["duration_s"]
        record.update({
            "request_id": f"{self.run_id or 'run'}-breaker-{self._probes.written + 1:04d}", "run_id": self.run_id,
            "worker": "breaker", "step": self.steps[-1]["step"] if self.steps else 0,
            "active_users": 0,  # every user was paused
            "scheduled_at": record["started_at"], "late_s": 0.0, "held_s": 0.0, "in_flight": False,
            "finished_at": None if duration is None else record["started_at"] + duration, "phase": STORM_PROBE,
        })
        self._probes.write(record)

    def finish(self, reason: str) -> None:
        """The run ends (`reason`): close its step; a plan that ended by itself derives its drain (a search
        cuts its streams instead: `drain.ANSWERED`)."""
        if self.stopped is None:
            self.stopped = reason
            if self.prober is not None:
                self.prober.stop(reason)
            self._close_step()
            if reason != INTERRUPTED and self.drain.source == "floor":
                self._set_drain(ANSWERED if self.prober is not None else self._derived_drain())
            elif self.prober is not None:  # the stop drains as set (a Ctrl-C: the floor), not as a step down
                self._set_drain(self.drain)
            self.write_live()

    def _stop_timeout(self) -> float:
        """Locust's wait for stopped users while the run goes on: the drain, but none in a search, whose
        step downs cut the streams of the users they stop (their level's verdict is in: the rest of those
        streams would only spend tokens, and keep the channel busier than the lower level it now probes)."""
        return 0.0 if self.prober is not None else self.drain.drain_s

    def _derived_drain(self) -> Drain:
        """The drain from the run's live statistics."""
        stats = current_run(self.environment)
        last = self.steps[-1]["step"] if self.steps else 0
        return derive(self.scenario.stop.drain_min_s, last, stats.steps.get(last), stats.total(),
                      time.time() - self._started_at)

    def _set_drain(self, drain: Drain) -> None:
        """Drain for `drain`, here and (ahead of their stop) on every worker."""
        self.drain = drain
        self.environment.stop_timeout = self.drain.drain_s
        self.role.to_workers(DRAIN_MESSAGE, {"drain_s": self.drain.drain_s})

    def live(self) -> dict[str, Any]:
        """The numbers for `tokenload run`'s live line: the current step so far."""
        snap = self._snapshot()
        current = snap.since(self._step_start) if self._step_start is not None else {}
        started = self.steps[-1]["started_at"] if self.steps else self._started_at
        return {
            "elapsed_s": time.time() - self._started_at,
            "step": self.steps[-1]["step"] if self.steps else 0,
            "target_users": self.steps[-1]["users"] if self.steps else 0,
            "users": self.role.user_count,
            "requests": snap.requests,
            "errors": snap.failures,
            "step_rps": current.get("requests", 0) / max(1e-9, time.time() - started),
            **{k: current.get(k) for k in ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s")},
            **({"search": self.prober.live()} if self.prober is not None else {}),
        }

    def write_live(self) -> None:
        self.workers.update(worker.id for worker in self.role.workers())
        write_json(self.path, {
            "started_at": self._started_at,
            "plan": [asdict(p) for p in self.plan],
            "steps": self.steps,
            "stop_reason": self.stopped,
            "stop": self.stop_record,
            "drain": self.drain.to_dict(),
            "storms": [{k: v for k, v in storm.items() if not k.startswith("_")} for storm in self.storms],
            "workers": sorted(self.workers),
            "live": self.live(),
            "updated_at": time.time(),
        })


CONTROL: roles.Part[RunControl] = roles.Part("run control")  # on the master or local process
