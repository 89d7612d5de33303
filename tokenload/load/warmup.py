"""The run-level warm-up: the first requests of a run are sent but kept out of the statistics.

A cold channel (connections to open, caches to fill, autoscaling to wake) makes
the first requests slower than the rest; vLLM's bench and GuideLLM discard
them. Each load process marks its first `[load] warmup_requests` requests as
warm-up (`phase = "warmup"` in the records; the others are `"measure"`), and the
analysis drops warm-up rows when it loads a run. (`[load] warmup_s` is the
analysis' per-step exclusion by time, applied when it computes each step.)
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["warmup", "measure"]
WARMUP: Phase = "warmup"
MEASURE: Phase = "measure"


class Warmup:
    """Marks this process's first requests as warm-up (one per process)."""

    def __init__(self, requests: int) -> None:
        self._left = requests

    def phase(self) -> Phase:
        if self._left > 0:
            self._left -= 1
            return WARMUP
        return MEASURE
