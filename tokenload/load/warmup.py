"""The run-level warm-up: the first requests of a run are sent but kept out of the statistics.

A cold channel (connections to open, caches to fill, autoscaling to wake) makes
the first requests slower than the rest; vLLM's bench and GuideLLM discard
them. A request is warm-up (`phase = "warmup"` in the records; the others are
`"measure"`) when it is one of its load process's first `[load] warmup_requests`
or is sent within the run's first `[load] warmup_s` seconds (counted from the
first step's start on the shape's clock, the same in every process), and the
analysis drops warm-up rows when it loads a run; a search also marks each probe's first
`[load] probe_warmup_s` seconds, and after a step down (a failing level, then a
lower one) every request sent until the higher level's requests still in flight
in this process have finished: until they drain, the channel still holds the
higher load (its queue, its busy slots), and a request sent then would judge
the lower level by the higher one's congestion. Closed-loop users send nothing
while the drain lasts (`draining`: such requests would only be spent as
warm-up), and the probe's `probe_warmup_s` then counts from the drain's end. (`[load] step_warmup_s` is the
analysis' per-step exclusion by time, applied when it computes each step.)
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from tokenload.load.control import LoadState

Phase = Literal["warmup", "measure"]
WARMUP: Phase = "warmup"
MEASURE: Phase = "measure"
DRAIN_POLL_S = 0.05  # how often a user held by a step down's drain looks again


class Warmup:
    """Marks this process's warm-up requests (one per process): its first `requests`, any sent in the
    run's first `seconds` (the run's start is `state.run_started_at`, set by the first step), any sent
    in each step's first `step_seconds` (a search's probes: the users of a new level are still starting),
    and, with `drain` (a search), any sent while a request of a higher level is still in flight."""

    def __init__(self, requests: int, seconds: float = 0.0, state: LoadState | None = None,
                 step_seconds: float = 0.0, drain: bool = False) -> None:
        self._left = requests
        self._seconds = seconds
        self._state = state
        self._step_seconds = step_seconds
        self._drain = drain
        self._flying: Counter[float] = Counter()  # requests in flight by the load level they were sent at
        self._drained: tuple[int, float] = (0, 0.0)  # (step, wall time) a step down's drain ended

    def _level(self) -> float:
        state = self._state
        if state is None:
            return 0.0
        return float(state.rate if state.rate is not None else state.users)

    def phase(self) -> Phase:
        if self._left > 0:
            self._left -= 1
            return WARMUP
        state = self._state
        if state is None:
            return MEASURE
        now = time.time()
        if self._seconds and state.run_started_at and now < state.run_started_at + self._seconds:
            return WARMUP
        step, drained_at = self._drained
        began = max(state.started_at, drained_at if step == state.step else 0.0)
        if self._step_seconds and began and now < began + self._step_seconds:
            return WARMUP
        return WARMUP if self.draining() else MEASURE

    def draining(self) -> bool:
        """A request sent at a higher level than the current one is still in flight in this process."""
        if not self._drain:
            return False
        level = self._level()
        return any(sent_at > level for sent_at in self._flying)

    def sent(self) -> float:
        """A request goes out now: returns its level, to hand back to `finished` when it ends."""
        level = self._level()
        if self._drain:
            self._flying[level] += 1
        return level

    def finished(self, level: float) -> None:
        if self._drain:
            was = self.draining()
            self._flying[level] -= 1
            if self._flying[level] <= 0:
                del self._flying[level]
            if was and not self.draining() and self._state is not None:
                self._drained = (self._state.step, time.time())
