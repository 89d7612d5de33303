"""Why a run stops: a table of small pure functions over the live state, first match wins.

Each rule reads one `Live` (what the master, or the local runner, knows at a
tick) and returns the stop reason or None. They are pure so that each one is
unit-tested without starting Locust (tests/test_stoprules.py); `RunControl`
gathers the state and acts on the answer, as doctor's `CHECKS` are run by
`run_checks`.

The live error rate has the analysis's definition: load errors only
(`tokenload.errors.LOAD_KINDS`: 429, 5xx, timeouts, broken streams) over all
requests. Configuration errors (auth, unknown model, wrong base URL) stop the
run through their own rule after a few in a row; input errors (a prompt over
the context window, a refused body) say nothing about the channel's capacity and
count towards neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenload.contracts.manifest import StopRecord
from tokenload.errors import error_class
from tokenload.search.evidence import wilson_interval
from tokenload.workload.scenario import StopSection

# The breaker's share needs this many requests in its window before it means anything, scaled to the load:
# as many as there are users, at least STORM_FLOOR and at most STORM_MIN_REQUESTS. A fixed 10 per window was
# out of reach of 4 users whose failures each took 4-5 s (a relay retrying a dead backend): no pause, ever.
STORM_MIN_REQUESTS = 10
STORM_FLOOR = 3


def storm_minimum(users: int) -> int:
    """Requests the breaker needs to judge: one per user (every user has seen it), within the floor and cap."""
    return max(STORM_FLOOR, min(STORM_MIN_REQUESTS, users))


class FailFast:
    """One process's configuration errors in a row (auth, unknown model, wrong base URL).

    Any other outcome ends the streak. At `limit` the process's users park: the run
    is about to stop, and every further request would fail the same way.
    """

    __slots__ = ("last", "limit", "report", "streak")

    def __init__(self, limit: int = 0, report: Callable[[int, dict[str, Any] | None], None] | None = None) -> None:
        self.limit = limit
        self.streak = 0
        self.last: dict[str, Any] | None = None
        self.report = report  # a worker tells the master at once

    @property
    def tripped(self) -> bool:
        return bool(self.limit) and self.streak >= self.limit

    def observe(self, kind: str | None, http_status: int | None, message: str | None) -> None:
        if error_class(kind) == "config":
            self.streak += 1
            self.last = {"kind": kind, "http_status": http_status, "message": message}
        elif self.streak:
            self.streak = 0
        else:
            return
        if self.report is not None:
            self.report(self.streak, self.last)


@dataclass(frozen=True)
class Counts:
    """Cumulative request counts (from Locust's stats), split by error class."""

    requests: int = 0
    failures: int = 0
    load_failures: int = 0
    tokens: int = 0

    def minus(self, earlier: Counts) -> Counts:
        return Counts(self.requests - earlier.requests, self.failures - earlier.failures,
                      self.load_failures - earlier.load_failures, self.tokens - earlier.tokens)

    @property
    def load_error_rate(self) -> float:
        return self.load_failures / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class LiveThreshold:
    """An `abort_on_fail` threshold as the live statistics see it: of `n` observations, `beyond` lie on the
    breaching side of its bound, where it allows at most the share `allowed` (`tokenstats.live_thresholds`)."""

    expr: str
    n: int
    beyond: int
    allowed: float
    what: str  # "TTFT at or above 0.05 s", "requests failed"


@dataclass(frozen=True)
class Live:
    """What the stop rules read at one tick."""

    elapsed_s: float
    plan_over: bool  # no phase of the plan is left
    stop: StopSection
    totals: Counts = Counts()
    ended_step: dict[str, Any] | None = None  # the step that ended at this tick: its phase and counts
    budget_spent: str | None = None  # a local runner's own budget
    workers_spent: dict[str, dict[str, Any]] = field(default_factory=dict)  # master: every share used up
    config_streak: int = 0  # configuration errors in a row, summed over processes
    config_error: dict[str, Any] | None = None  # the latest one: kind, http_status, message
    storm_failed_probes: int = 0  # error-storm probes that failed since the pause began
    storm_detail: str | None = None  # what the breaker saw when it paused the users
    thresholds: tuple[LiveThreshold, ...] = ()  # the scenario's abort_on_fail thresholds


def plan_over(live: Live) -> str | None:
    if not live.plan_over:
        return None
    return "duration" if live.stop.duration_s and live.elapsed_s >= live.stop.duration_s else "plan complete"


def budget_spent(live: Live) -> str | None:
    if live.budget_spent:
        return live.budget_spent
    spent = live.workers_spent
    if not spent:
        return None
    sent = sum(s["sent"] for s in spent.values())
    tokens = sum(s["tokens"] for s in spent.values())
    kind = "token budget" if all(s["reason"].startswith("token") for s in spent.values()) else "max_requests"
    return f"{kind}: every worker spent its share ({sent} requests, {tokens} tokens)"


def misconfigured(live: Live) -> str | None:
    """A few configuration errors in a row: every further request would fail the same way."""
    limit, error = live.stop.config_errors, live.config_error
    if not limit or live.config_streak < limit or error is None:
        return None
    status = f" (HTTP {error['http_status']})" if error.get("http_status") else ""
    return (f"channel misconfigured: {live.config_streak} requests in a row failed with "
            f"{error['kind']}{status}: {error['message']}")


def request_limit(live: Live) -> str | None:
    limit = live.stop.max_requests
    return f"max_requests: {live.totals.requests} >= {limit}" if limit and live.totals.requests >= limit else None


def token_limit(live: Live) -> str | None:
    limit = live.stop.max_tokens
    return f"token budget: {live.totals.tokens} >= {limit}" if limit and live.totals.tokens >= limit else None


def _at(step: dict[str, Any]) -> str:
    level = f"{step['rate']:g} req/s" if step.get("rate") is not None else f"{step['users']} users"
    return f"step {step['step']} ({level})"


# An abort_on_fail threshold is decided breached on at least this many observations.
THRESHOLD_MIN_N = 10


def threshold_breached(live: Live) -> str | None:
    """An `abort_on_fail` threshold the live statistics already decide is breached: the 95% Wilson interval of
    the share beyond its bound lies above the share it allows (the analysis judges it again at the end)."""
    for t in live.thresholds:
        interval = wilson_interval(t.beyond, t.n) if t.n >= THRESHOLD_MIN_N else None
        if interval is not None and interval[0] > t.allowed:
            return (f"threshold {t.expr} breached (abort_on_fail): {t.beyond} of {t.n} {t.what}, at least "
                    f"{interval[0]:.0%} at 95% confidence where it allows {t.allowed:.0%}")
    return None


def _errors_over(live: Live) -> tuple[float, str] | None:
    """(value, condition) when the step that ended was over the load-error limit."""
    step, limit = live.ended_step, live.stop.breakpoint_error_rate
    if not limit or step is None or not step["requests"] or step["load_error_rate"] <= limit:
        return None
    return step["load_error_rate"], f"load error rate {step['load_error_rate']:.2f} > {limit:g}"


def _ttft_over(live: Live) -> tuple[float, str] | None:
    """(value, condition) when the step that ended had its TTFT p95 over the limit."""
    step, limit = live.ended_step, live.stop.breakpoint_ttft_p95_s
    p95 = None if step is None else step.get("ttft_p95_s")
    if not limit or p95 is None or p95 <= limit:
        return None
    return p95, f"TTFT p95 {p95:.2f} s > {limit:g} s"


# The auto-stops: rule name -> (its [stop] key, the condition it checks on the step that ended).
AUTO_STOPS: dict[str, tuple[str, Callable[[Live], tuple[float, str] | None]]] = {
    "breakpoint_errors": ("breakpoint_error_rate", _errors_over),
    "breakpoint_ttft": ("breakpoint_ttft_p95_s", _ttft_over),
}


def _auto_stop(live: Live, name: str) -> str | None:
    key, over = AUTO_STOPS[name]
    found = over(live)
    if found is None or live.ended_step is None:
        return None
    return f"auto-stop: {_at(live.ended_step)} {found[1]} ([stop] {key})"


def breakpoint_errors(live: Live) -> str | None:
    """A whole step over the load-error limit."""
    return _auto_stop(live, "breakpoint_errors")


def breakpoint_ttft(live: Live) -> str | None:
    return _auto_stop(live, "breakpoint_ttft")


def storm_unresolved(live: Live) -> str | None:
    """The error-storm breaker paused the users and every probe since failed."""
    if live.storm_failed_probes < live.stop.storm_probes:
        return None
    return (f"error storm: {live.storm_detail}; users paused and {live.storm_failed_probes} probe requests "
            f"{live.stop.storm_s:g} s apart failed too")


StopRule = Callable[[Live], str | None]
RULES: tuple[tuple[str, StopRule], ...] = (
    ("plan_over", plan_over),
    ("budget_spent", budget_spent),
    ("misconfigured", misconfigured),
    ("request_limit", request_limit),
    ("token_limit", token_limit),
    ("storm_unresolved", storm_unresolved),
    ("threshold_breached", threshold_breached),
    ("breakpoint_errors", breakpoint_errors),
    ("breakpoint_ttft", breakpoint_ttft),
)


def first_stop(live: Live) -> tuple[str, str] | None:
    """(rule name, reason) of the first rule that fires, in table order."""
    for name, rule in RULES:
        reason = rule(live)
        if reason is not None:
            return name, reason
    return None


def record(name: str, reason: str, live: Live) -> StopRecord:
    """manifest.json's `stop`: the rule that fired by name, with an auto-stop's fields beside its sentence."""
    out: StopRecord = {"rule": name, "reason": reason}
    if name in AUTO_STOPS and live.ended_step is not None:
        key, over = AUTO_STOPS[name]
        found = over(live)
        if found is not None:
            out.update({"key": key, "step": live.ended_step["step"], "condition": found[1], "value": found[0],
                        "limit": getattr(live.stop, key)})
    return out


class FailureStreak:
    """Load failures in a row across every user, from the cumulative counts at each tick.

    A tick in which any request ended other than by a load error ends the streak (the order
    within one tick is unknown, so a mixed tick counts as a success). `quiet_s` is how long no
    request has succeeded: failures slower than the breaker's window (a hung backend's timeouts)
    still add up here.
    """

    __slots__ = ("_last", "last_ok", "streak")

    def __init__(self, now: float) -> None:
        self.streak = 0
        self.last_ok = now
        self._last: Counts | None = None

    def observe(self, totals: Counts, now: float) -> None:
        new = totals.minus(self._last) if self._last is not None else Counts()
        self._last = totals
        if new.requests < 0:  # the statistics were reset (a new test from the web UI)
            self.restart(now)
        elif new.requests > new.load_failures:
            self.streak, self.last_ok = 0, now
        else:
            self.streak += new.load_failures

    def restart(self, now: float) -> None:
        """After a pause, or with new statistics: nothing failed yet."""
        self.streak, self.last_ok = 0, now

    def quiet_s(self, now: float) -> float:
        return now - self.last_ok


def storm(window: Counts, stop: StopSection, users: int, streak: int = 0, quiet_s: float = 0.0) -> str | None:
    """The breaker's trigger, scaled to the load (`users` running), so 2 users or 2,000 are protected alike.

    Either over `storm_error_rate` load errors among at least `storm_minimum(users)` requests across a
    window of `storm_s` seconds, or at least that many load failures in a row across all users with no
    success for `storm_s` seconds. A brief blip trips neither: the share is over a whole window, and a
    streak must outlast one. Not a stop rule: when it fires the users pause and a probe decides (see
    `RunControl`).
    """
    if not stop.storm_error_rate:
        return None
    needed = storm_minimum(users)
    if window.requests >= needed and window.load_error_rate > stop.storm_error_rate:
        return (f"{window.load_failures} of {window.requests} requests failed under load in {stop.storm_s:g} s "
                f"({window.load_error_rate:.0%} > {stop.storm_error_rate:.0%})")
    if streak >= needed and quiet_s >= stop.storm_s:
        return f"{streak} requests in a row failed under load and none succeeded for {quiet_s:.0f} s"
    return None
