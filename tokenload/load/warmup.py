"""The run-level warm-up: the first requests of a run are sent but kept out of the statistics.

A cold channel (connections to open, caches to fill, autoscaling to wake) makes
the first requests slower than the rest; vLLM's bench and GuideLLM discard
them. Each load process marks as warm-up its first `[load] warmup_requests`
requests and every request it starts within `warmup_s` seconds of the load's
start (`phase = "warmup"` in the records; the others are `"measure"`). The
analysis drops warm-up rows when it loads a run.
"""

from __future__ import annotations

import time
from typing import Literal

from tokenload.load.control import LoadState

Phase = Literal["warmup", "measure"]
WARMUP: Phase = "warmup"
MEASURE: Phase = "measure"


class Warmup:
    """Decides, per request at its start, whether it belongs to the warm-up (one per process)."""

    def __init__(self, requests: int, seconds: float) -> None:
        self._left = requests
        self._seconds = seconds
        self._until: float | None = None

    def phase(self, state: LoadState) -> Phase:
        if self._until is None and state.started_at:  # the first phase's start is the load's start
            self._until = state.started_at + self._seconds
        if self._left > 0:
            self._left -= 1
            return WARMUP
        return WARMUP if self._until is not None and time.time() < self._until else MEASURE
