"""The run-level warm-up: the first requests of a run are sent but kept out of the statistics.

A cold channel (connections to open, caches to fill, autoscaling to wake) makes
the first requests slower than the rest; vLLM's bench and GuideLLM discard
them. A request is warm-up (`phase = "warmup"` in the records; the others are
`"measure"`) when it is one of its load process's first `[load] warmup_requests`
or is sent within the run's first `[load] warmup_s` seconds (counted from the
first step's start on the shape's clock, the same in every process), and the
analysis drops warm-up rows when it loads a run; a search also marks each probe's first
`[load] probe_warmup_s` seconds. At a closed-loop step up, only what is sent before the
level is whole is warm-up: the first request of each user the probe started (it meets
fewer than the level's requests in flight, and opens its connection) and anything sent
while those users are still starting (at `spawn_rate`); a user already running that sends
again after that sends among the level's other requests, as in the level's steady state,
and is measured. After a step down (a failing level, then a lower one)
the requests sent at the higher level are still on the channel (its
queue, its busy slots): a request sent among them would judge the lower level
by the higher one's congestion. Closed-loop users therefore send nothing while
this process has a higher level's request in flight and as many requests in
flight as its share of the level's users (`draining`): each waits until the
backlog is below the level, so every request of the probe is sent among at
most the level's requests, as in the level's steady state, and none is spent
as warm-up. Open-loop arrivals cannot wait: a request sent while a higher
rate's request is still in flight is warm-up. (`[load] step_warmup_s` is the
analysis' per-step exclusion by time, applied when it computes each step.)
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Literal

from tokenload.load.state import LoadState

Phase = Literal["warmup", "measure"]
WARMUP: Phase = "warmup"
MEASURE: Phase = "measure"
DRAIN_POLL_S = 0.05  # how often a user held by a step down's drain looks again


class Warmup:
    """Marks this process's warm-up requests (one per process): its first `requests`, any sent in the
    run's first `seconds` (the run's start is `state.run_started_at`, set by the first step), any sent
    in each step's first `step_seconds` (a search's probes: the users of a new level are still starting, the
    streams a step down cut are still being freed on the channel),
    and, with `drain` (a search), any sent while a step down's backlog is still in flight (`draining`)."""

    def __init__(self, requests: int, seconds: float = 0.0, state: LoadState | None = None,
                 step_seconds: float = 0.0, drain: bool = False, spawn_rate: float = 0.0) -> None:
        self._left = requests
        self._seconds = seconds
        self._state = state
        self._step_seconds = step_seconds
        self.drain = drain
        self._spawn_rate = spawn_rate
        self._flying: Counter[float] = Counter()  # requests in flight by the load level they were sent at

    def _level(self) -> float:
        state = self._state
        if state is None:
            return 0.0
        return float(state.rate if state.rate is not None else state.users)

    def phase(self, first: bool = True) -> Phase:
        """The phase of a request sent now (`first`: its user's first request)."""
        if self._left > 0:
            self._left -= 1
            return WARMUP
        state = self._state
        if state is None:
            return MEASURE
        now = time.time()
        if self._seconds and state.run_started_at and now < state.run_started_at + self._seconds:
            return WARMUP
        if self._step_seconds and state.started_at and now < state.started_at + self._step_seconds + state.spread_s \
                and (first or not self._level_whole(state, now)):
            return WARMUP
        return WARMUP if self.draining() else MEASURE

    def _level_whole(self, state: LoadState, now: float) -> bool:
        """A closed-loop step up (`LoadState.rose_from`) whose new users have all started by `now` (they start
        at the phase's `spawn_rate`, or the scenario's, and send their first requests over its `spread_s`)."""
        rate = state.spawn_rate or self._spawn_rate
        if not rate or state.rose_from >= state.users:
            return False
        return now >= state.started_at + (state.users - state.rose_from) / rate + state.spread_s

    def draining(self) -> bool:
        """A step down's backlog is in flight: a higher level's request, and (closed loop) as many requests
        as this process's share of the level's users, so one more would exceed the level."""
        state = self._state
        if not self.drain or state is None:
            return False
        level = self._level()
        if not any(sent_at > level for sent_at in self._flying):
            return False
        return state.rate is not None or sum(self._flying.values()) >= level / max(1, state.pacer.workers)

    def sent(self) -> float:
        """A request goes out now: returns its level, to hand back to `finished` when it ends."""
        level = self._level()
        if self.drain:
            self._flying[level] += 1
        return level

    def finished(self, level: float) -> None:
        if self.drain:
            self._flying[level] -= 1
            if self._flying[level] <= 0:
                del self._flying[level]
