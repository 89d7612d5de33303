"""Scheduler-lag probe: proof that the load generator itself was not the bottleneck.

All users of a Locust process share one gevent loop. When that loop is busy
(parsing, recording, too many users for one core), everything it does waits its
turn: requests go out late (a closed loop then offers less load than planned),
tokens that arrive between two late reads of one stream share the later read's
time, and HTTPS streams, stamped when read, carry the whole wait in TTFT and
TPOT (plain-HTTP reads carry the kernel's arrival time: `tokenload.transport.reader`).
The probe sleeps a fixed interval over and over and records how late it wakes,
and how busy the process's core was over each `BUSY_WINDOW_S`. Both go into
manifest.json; a high lag p99 or a core kept busy is a loud warning that the
numbers describe the client, not the channel. Lag alone under-reports: the loop
reads every ready socket in one pass, so its lag is bounded by what one pass
reads while the process already has no CPU left (docs/benchmarks.md).

A stall is one wake-up at least `STALL_S` late: the loop did not run for that
long, so every request due meanwhile went out late at once (hundreds of users
spawned together, a garbage collection, a long flush). Plain-HTTP timings keep
the kernel's stamps and each request's wait is its `send_lag_s`, not its TTFT;
the stalls (when, how long, and the garbage collector's share of it, timed by
`gc.callbacks`) go into manifest.json (`scheduler_lag.stalls`) and a note, so a
verdict can say the client, not the server, was late.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections import deque
from typing import Any

import gevent
import numpy as np

from tokenload.transport.reader import compiled

INTERVAL_S = 0.05
# Above this p99 lag the client adds more error than the TTFT resolution users care about.
WARN_P99_S = 0.020
HEALTHY_OK_SHARE = 0.5
# A process that kept its core this busy for this long had nothing left for the streams it read.
BUSY_CPU = 0.9
BUSY_WINDOW_S = 5.0
_KEEP = 100_000  # samples kept (about 80 minutes at 50 ms); older ones are dropped
# A wake-up this late is a stall: the loop stood still for two probe intervals or more.
STALL_S = 0.1
STARTUP_S = 5.0  # a stall within this long of the process's start is called a start-up stall
# Lag is the client's bottleneck only when it persists: this many wake-ups later than WARN_P99_S after start-up.
# Early in a run one stall is the p99 of the few samples there are (a 716 ms start-up stall read "p99 545 ms"
# live in a run whose final p99 was 11 ms).
MIN_LATE_WAKEUPS = 5
_KEEP_STALLS = 10  # the longest stalls kept per process (all are counted)


def freeze_heap(*_: Any, **__: Any) -> None:
    """Move every object alive now out of the collector's sight (`gc.freeze()`): set-up and the spawned users.

    A full collection walks every tracked object the process holds, however long-lived (2,000
    users and their connections are about 130,000), and stands the event loop still meanwhile
    (docs/benchmarks.md, "Pauses of the client"). Frozen objects are
    still freed when their last reference goes (a stream's objects form no cycle: none waits
    for the collector); a collection then walks only what was made since. Called at the end of
    the process's set-up and whenever spawning completes; `TOKENLOAD_GC_FREEZE=0` turns it off
    (for measuring).
    """
    if os.environ.get("TOKENLOAD_GC_FREEZE") != "0":
        gc.freeze()


class LagProbe:
    """A greenlet that measures event-loop wake-up lateness."""

    def __init__(self) -> None:
        self._samples: list[float] = []
        self._greenlet: gevent.Greenlet | None = None
        self._cpu0 = time.process_time()
        self._wall0 = time.monotonic()
        self._window: deque[tuple[float, float]] = deque()  # (wall, cpu) over the last BUSY_WINDOW_S
        self._busiest = 0.0  # the highest CPU share of one core over any BUSY_WINDOW_S so far
        self._started = time.time()
        self.stalls = 0
        self.startup_stalls = 0  # of them, within STARTUP_S of the start
        self.late_wakeups = 0  # wake-ups later than WARN_P99_S after STARTUP_S
        self._stalls: list[dict[str, Any]] = []  # the longest, at most _KEEP_STALLS
        self.gc_s = 0.0  # time spent in garbage collection since start (gc.callbacks)
        self._gc_began: float | None = None

    def start(self) -> None:
        if self._greenlet is None:
            gc.callbacks.append(self._on_gc)
            self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        if self._greenlet is not None:
            gc.callbacks.remove(self._on_gc)
            self._greenlet.kill(block=False)
            self._greenlet = None

    def _on_gc(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self.gc_s += time.perf_counter() - self._gc_began
            self._gc_began = None

    def _run(self) -> None:
        samples = self._samples
        while True:
            due = time.perf_counter() + INTERVAL_S
            gc_before = self.gc_s
            gevent.sleep(INTERVAL_S)
            late = max(0.0, time.perf_counter() - due)
            samples.append(late)
            if len(samples) > _KEEP:
                del samples[: _KEEP // 10]
            if late >= STALL_S:
                self.stall(time.time() - late, late, self.gc_s - gc_before)
            if late > WARN_P99_S and time.time() - self._started >= STARTUP_S:
                self.late_wakeups += 1
            self._track_cpu(time.monotonic(), time.process_time())

    def stall(self, at: float, lag_s: float, gc_s: float) -> None:
        """Count a stall that began at `at` (unix s) and lasted `lag_s`, `gc_s` of it in garbage collection."""
        self.stalls += 1
        self.startup_stalls += at - self._started < STARTUP_S
        cause = "garbage collection" if gc_s >= lag_s / 2 else "the event loop was busy"
        self._stalls.append({"at": round(at, 3), "after_start_s": round(at - self._started, 3),
                             "lag_s": round(lag_s, 4), "gc_s": round(gc_s, 4), "cause": cause})
        self._stalls.sort(key=lambda st: -st["lag_s"])
        del self._stalls[_KEEP_STALLS:]

    def _track_cpu(self, wall: float, cpu: float) -> None:
        window = self._window
        window.append((wall, cpu))
        while wall - window[0][0] >= BUSY_WINDOW_S:
            wall0, cpu0 = window.popleft()
            self._busiest = max(self._busiest, (cpu - cpu0) / (wall - wall0))

    def stats(self) -> dict[str, Any]:
        """Lag percentiles (seconds), the process's CPU use and its body reader, JSON-ready."""
        wall = max(1e-9, time.monotonic() - self._wall0)
        cpu = time.process_time() - self._cpu0
        out: dict[str, Any] = {"samples": len(self._samples), "cpu_s": round(cpu, 3), "cpu_util": round(cpu / wall, 3),
                               "cpu_busiest": round(self._busiest, 3), "reader": "compiled" if compiled() else "pure",
                               "stalls": self.stalls, "startup_stalls": self.startup_stalls,
                               "longest_stalls": list(self._stalls), "gc_s": round(self.gc_s, 3),
                               "late_wakeups": self.late_wakeups}
        if self._samples:
            arr = np.asarray(self._samples)
            p50, p99 = np.percentile(arr, (50, 99))
            out.update(lag_p50_s=float(p50), lag_p99_s=float(p99), lag_max_s=float(arr.max()))
        return out


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under `taskset` or a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS): every core counts
        return os.cpu_count() or 1


def advice(processes: int, lagged: int, cores: int) -> str:
    """What helps a client-bound run, given how many processes ran on how many cores.

    With fewer processes than cores, spreading the same users over more
    processes (`--processes auto`) helps. With every core already running a
    process, more processes only share the same cores: each lagging process
    needs at least one more core (its users split in two), or fewer users.
    """
    if processes < cores:
        return (f"Use --processes auto (fewer users per process: this machine has {cores} cores, "
                f"the run used {processes} process{'es' if processes > 1 else ''})")
    more = max(1, lagged)
    return (f"Every one of the {cores} core{'s' if cores > 1 else ''} here already ran a process, so more --processes "
            f"cannot help: give the client at least {more} more core{'s' if more > 1 else ''} (e.g. --worker on "
            "another machine) or run fewer users")


def summarise(per_worker: dict[str, dict[str, Any]], ok_share: float = 1.0, cores: int | None = None) -> dict[str, Any]:
    """Combine workers' probe stats for manifest.json, with a warning when the client was the bottleneck.

    Lag counts against the client only when the responses were healthy (at least
    HEALTHY_OK_SHARE of them succeeded): a run of instant failures lags the loop
    with error handling and start-up, and more processes would not help it; and only
    when it persisted (`MIN_LATE_WAKEUPS` late wake-ups after start-up; stats without
    the count are judged by their p99 alone). The live line and the manifest use this
    one test, so a warning shown live is the one the run ends with.
    `cores`: the cores the run's processes could use (default: this process's).
    """
    healthy = ok_share >= HEALTHY_OK_SHARE
    lagged = {w: s for w, s in per_worker.items() if healthy and s.get("lag_p99_s", 0.0) > WARN_P99_S
              and s.get("late_wakeups", MIN_LATE_WAKEUPS) >= MIN_LATE_WAKEUPS}
    busy = {w: s for w, s in per_worker.items() if healthy and s.get("cpu_busiest", 0.0) >= BUSY_CPU}
    worst = max((s.get("lag_p99_s", 0.0) for s in per_worker.values()), default=0.0)
    bound = {**lagged, **busy}
    summary: dict[str, Any] = {
        "interval_s": INTERVAL_S,
        "warn_p99_s": WARN_P99_S,
        "worst_p99_s": worst,
        "busy_cpu": BUSY_CPU,
        "client_bound": bool(bound),
        "ok_share": ok_share,
        "workers": per_worker,
    }
    stalls = stall_summary(per_worker)
    if stalls:
        summary["stalls"] = stalls
    if bound:
        reasons = []
        if lagged:
            cpu = sum(s.get("cpu_util", 0.0) for s in lagged.values())
            reasons.append(f"scheduler lag p99 {worst * 1000:.0f} ms > {WARN_P99_S * 1000:.0f} ms on "
                           f"{', '.join(sorted(lagged))} (CPU {math.ceil(cpu * 100)}% of a core)")
        if busy:
            busiest = max(s["cpu_busiest"] for s in busy.values())
            reasons.append(f"{', '.join(sorted(busy))} kept a core {math.floor(busiest * 100)}% busy for "
                           f"{BUSY_WINDOW_S:g} s")
        pure = sorted(w for w, s in bound.items() if s.get("reader") == "pure")
        summary["warning"] = (
            f"the load generator was the bottleneck: {'; '.join(reasons)}; its requests went out late (less load "
            f"than planned) and HTTPS timings include its delay. "
            f"{advice(len(per_worker), len(bound), cores or usable_cores())}."
            + (f" {', '.join(pure)} read with the pure-Python reader (installed without a C compiler): install "
               "gcc and reinstall tokenload (pip install -e .) to build the compiled one, about a third less CPU per "
               "token." if pure else "")
        )
    return summary


def stall_summary(per_worker: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The processes' stalls for manifest.json (`scheduler_lag.stalls`): counts, the longest, and a note.

    None when no process stalled (or its stats predate the count).
    """
    count = sum(int(s.get("stalls") or 0) for s in per_worker.values())
    if not count:
        return None
    longest = sorted(({"worker": w, **st} for w, s in per_worker.items() for st in s.get("longest_stalls") or ()),
                     key=lambda st: -st["lag_s"])[:_KEEP_STALLS]
    worst = longest[0]
    when = "at start-up" if worst["after_start_s"] < STARTUP_S else f"{worst['after_start_s']:.0f} s in"
    note = (f"the load generator stood still {count} time{'s' if count > 1 else ''} for {STALL_S * 1000:.0f} ms or "
            f"more (longest {worst['lag_s'] * 1000:.0f} ms {when}, {worst['worker']}: {worst['cause']}); requests due "
            "meanwhile went out late: the client, not the server, was late, and each such wait is in its record's "
            "send_lag_s, not in its TTFT")
    return {"stall_s": STALL_S, "count": count, "at_startup": sum(int(s.get("startup_stalls") or 0) for s in per_worker.values()), "longest": longest, "note": note}
