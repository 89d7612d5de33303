"""How late this process's threads wake: the margin a test that times an unstamped client takes from the machine.

A latency the client stamps with its own clock (not the kernel's: httpx, `ttft_exact` false) holds the client's
own delays too, and on a busy machine a thread due now runs tens of milliseconds later. `LagProbe` sleeps
`INTERVAL_S` over and over in a thread while the test's exchange runs and keeps the longest oversleep: a bound
on how late the client read its clock at either end, measured where and when the test ran.
"""

from __future__ import annotations

import threading
import time

INTERVAL_S = 0.001


class LagProbe:
    """`with LagProbe() as lag: ...` then `lag.worst`: the longest a wake-up came late meanwhile (seconds)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lagprobe", daemon=True)

    def __enter__(self) -> LagProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            due = time.perf_counter() + INTERVAL_S
            time.sleep(INTERVAL_S)
            self.worst = max(self.worst, time.perf_counter() - due)
