"""When open-loop users send: a process's arrival schedule (Poisson, constant, gamma) or a trace replayed.

Both hand out send times one waiter at a time against the shape's clock
(`LoadState.started_at`), so a user that starts late records how late it sent
instead of shifting the schedule.
"""

from __future__ import annotations

import random
import time

import gevent
from gevent.lock import Semaphore

from tokenload.load.state import LoadState
from tokenload.workload.traces import TraceRow

PARK_S = 3600.0  # a parked user's wait: Locust stops a waiting user at once


class Arrivals:
    """Open-loop send times for this process: Poisson, evenly spaced or gamma at the current rate.

    The schedule starts at each phase's start on the shape's clock (`LoadState.started_at`),
    so users that start a little later send the first slots late (and record it) instead
    of shifting the whole schedule; slots at or after the plan's end are never sent.
    Gamma gaps have shape `burstiness` and mean 1/rate (vLLM's `--burstiness`): the gaps'
    coefficient of variation is 1/sqrt(burstiness), 1 being Poisson. With a `ramp` the rate
    rises within each phase from the previous phase's rate (the first phase from a tenth
    of its own), linearly or exponentially; each gap is drawn at the rate of its start.
    """

    def __init__(self, state: LoadState, rng: random.Random, arrival: str = "poisson", burstiness: float = 1.0,
                 ramp: str = "none", step_s: float = 0.0) -> None:
        self._state = state
        self._rng = rng
        self._arrival = arrival
        self._burstiness = burstiness
        self._ramp = ramp
        self._step_s = step_s
        self._next: float | None = None
        self._phase_start: float | None = None
        self._phase_rate: float | None = None
        self._ramp_from = 0.0
        self._lock = Semaphore()

    def wait(self) -> float | None:
        """Block until the next slot is due (one waiter at a time); its scheduled time, or None after the plan."""
        with self._lock:
            state = self._state
            if state.started_at != self._phase_start:  # a new phase: its schedule starts at its start
                self._phase_start = state.started_at
                rate = state.rate or 1.0
                self._ramp_from = self._phase_rate if self._phase_rate is not None else rate / 10
                self._phase_rate = rate
                start = state.started_at or time.time()
                if self._next is None or self._next > start:
                    self._next = start
            due = self._next
            assert due is not None
            if state.plan_ends_at and due >= state.plan_ends_at - 0.001:  # (float sums of gaps)
                return None
            now = time.time()
            if due > now:
                gevent.sleep(due - now)
            self._next = due + self._gap(self._rate_at(due))
            return due

    def _rate_at(self, t: float) -> float:
        rate = self._state.rate or 1.0
        if self._ramp == "none" or not self._step_s or self._phase_start is None:
            return rate
        frac = min(1.0, max(0.0, (t - self._phase_start) / self._step_s))
        start = self._ramp_from
        return start + (rate - start) * frac if self._ramp == "linear" else start * (rate / start) ** frac

    def _gap(self, rate: float) -> float:
        if self._arrival == "constant":
            return 1.0 / rate
        if self._arrival == "gamma":
            return self._rng.gammavariate(self._burstiness, 1.0 / (rate * self._burstiness))
        return self._rng.expovariate(rate)


class TraceArrivals:
    """Hands out the trace's rows in order at their due times (one waiter at a time), like `Arrivals`."""

    def __init__(self, state: LoadState, rows: tuple[TraceRow, ...], speed: float) -> None:
        self._state = state
        self._rows = rows
        self._speed = speed
        self._next = 0
        self._lock = Semaphore()

    def wait_row(self) -> tuple[float, TraceRow] | None:
        """Block until the next row is due; (its scheduled unix time, the row), or None once all are sent."""
        with self._lock:
            if self._next >= len(self._rows):
                return None
            row = self._rows[self._next]
            self._next += 1
            due = (self._state.started_at or time.time()) + row.offset_s / self._speed
            now = time.time()
            if due > now:
                gevent.sleep(due - now)
            return due, row
