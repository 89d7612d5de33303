"""What one load process knows about the run's current phase: its share of the rate and of the limits.

Every process that sends holds one `LoadState`: the master's step messages (or,
in one process, the run's control) update it, and the users, the arrival
schedule and the warm-up read it. Request and token limits are enforced where
the requests are sent (`Budget`, a user takes a ticket before each send); a
master splits them between its workers (`shares`), see `control.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenload.load.pacing import Pacer
from tokenload.load.stoprules import FailFast
from tokenload.workload.scenario import Scenario

PAUSE_S = 24 * 3600.0  # a breaker pause lasts until the master lifts it


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
    run_started_at: float = 0.0  # wall time the test's first phase began (the run-level warm-up counts from it)
    plan_ends_at: float = 0.0  # wall time the whole plan ends (no open-loop send is scheduled after it)
    pacer: Pacer = field(default_factory=Pacer)  # back-off, rate caps and breaker pauses of this process
    failfast: FailFast = field(default_factory=FailFast)
    probe_decided: bool = False  # a search's probe is decided: closed-loop users send nothing until the next one
    rose_from: int = 0  # a step up's previous users (its users start at `spawn_rate`); else `users`
    spawn_rate: float | None = None  # the phase's own rate of starting users (a search's re-phased probe)
    spread_s: float = 0.0  # ... and the span its new users' first requests are spread over (`Phase.spread_s`)

    @classmethod
    def for_scenario(cls, scenario: Scenario) -> LoadState:
        load = scenario.load
        return cls(pacer=Pacer(load.max_rps, load.max_tokens_per_min), failfast=FailFast(scenario.stop.config_errors))

    def follow(self, step: int, users: int, rate: float | None, spawn_rate: float | None = None,
               spread_s: float = 0.0) -> None:
        """The phase `step` begins with `users` closed-loop users or (this process's share of) `rate` req/s, the
        users it adds started at `spawn_rate` a second (None: the scenario's), their first requests spread over
        `spread_s`."""
        self.rose_from = self.users if rate is None and users > self.users else users
        self.step, self.users, self.rate = step, users, rate
        self.spawn_rate, self.spread_s = spawn_rate, spread_s
        self.probe_decided = False

    def new_test(self) -> None:
        """A (re)started test: no streak of configuration errors, no hold left from the previous one."""
        self.failfast.streak = 0
        self.pacer.release()

    def pause(self, paused: bool) -> None:
        """The error-storm breaker: hold every send, or lift the hold."""
        if paused:
            self.pacer.hold(time.monotonic() + PAUSE_S)
        else:
            self.pacer.release()
