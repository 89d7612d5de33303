"""No orphans: Locust processes die with whatever started them, and `tokenload run` outlives its Locust.

A load generator that outlives its run keeps loading the channel with nobody
recording (docs/benchmarks.md, "Process lifetime", has the cases measured). The
rules, on both sides of the process tree:

- `tokenload run` starts Locust in its own process group and passes its pid
  (`TOKENLOAD_PARENT_PID`). SIGTERM stops a run exactly like Ctrl-C, and Ctrl-C
  works even when SIGINT was inherited ignored (`&` in a script). On Linux
  it becomes a child subreaper, so forked workers orphaned by a dead master
  are re-parented to it and it can wait for the whole group (`wait_group`)
  before it finalises: every process's last flush is in.
- Every Locust process that tokenload manages watches its parent (the Locust
  master for a forked worker, `tokenload run` otherwise): on Linux the kernel
  signals it when the parent dies (`PR_SET_PDEATHSIG`), and a greenlet that
  polls `os.getppid()` does the same everywhere. Either way the process gets
  Locust's Ctrl-C (KeyboardInterrupt), because a headless shape run installs
  its SIGTERM handler only after the shape ends (until then SIGTERM kills it
  without a flush); a managed process also undoes an inherited "ignore
  SIGINT" (`&` in a script, nohup). A worker also watches its
  master's heartbeats (one a second): none for `MASTER_LOST_S` means the master
  is gone (killed, or the network to it cut).
- A process that lost its parent or master stops at once instead of draining
  (the `on_lost` callback cuts the drain to 0 before Locust's Ctrl-C; a master
  tells its workers the same ahead of its stop): nobody is waiting for a drain,
  and the open streams are cut and kept as records of what they got (a drain
  would let them run to their end with nobody recording).
- Locust's web UI survives a Ctrl-C that comes while the plan runs: Locust
  stops the test and leaves the UI up "indefinitely" (no `--autoquit`), so a
  killed `tokenload run --web` left an orphan holding the port. A managed
  web-UI process therefore stops its UI at its interrupt (`on_interrupt`), and
  Locust then shuts down as after a Ctrl-C at the idle UI.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

PARENT_ENV = "TOKENLOAD_PARENT_PID"
# Sent by the kernel when the parent dies (Linux); handled as Ctrl-C, with the reason recorded.
PARENT_DEATH_SIGNAL = signal.SIGUSR2
MASTER_LOST_S = 5.0  # no heartbeat from the master for this long: it is gone (Locust's own limit is 60 s)
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
LAUNCH_PID = os.getpid()  # set at import, before Locust forks: in a forked worker, its master's pid

log = logging.getLogger(__name__)


def _prctl(option: int, value: int) -> bool:
    """Linux `prctl(option, value)`; False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # The process's own symbols (libc is linked in): no library search, which would run
        # `ldconfig` in a subprocess and yield to gevent in the middle of Locust's `init`.
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


# ------------------------------------------------------------------ the `tokenload run` side


def parent_env() -> dict[str, str]:
    """What a Locust child needs to watch this process."""
    return {PARENT_ENV: str(os.getpid())}


def adopt_orphans() -> None:
    """Become a child subreaper (Linux): a forked worker whose master died becomes our child, so
    `wait_group` can reap it and see when the group is empty. Elsewhere init reaps it."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


_interrupted = False
_on_interrupt: list[Callable[[], None]] = []


def on_interrupt(callback: Callable[[], None]) -> None:
    """Call `callback` at this process's one interrupt, just before Locust gets it (in the signal handler:
    keep it to setting a value or spawning a greenlet)."""
    _on_interrupt.append(callback)


def interrupt_once(signum: int = signal.SIGINT, frame: object = None) -> None:
    """Locust's Ctrl-C (KeyboardInterrupt), once per process.

    A later one would land in the middle of Locust's shutdown and cut the final
    flush short, and they do come: the kernel repeats the parent-death signal
    as each thread of a dying parent exits, and `tokenload run` interrupts the
    whole group. `tokenload run` escalates with SIGKILL, never a second SIGINT.
    """
    global _interrupted
    if not _interrupted:
        _interrupted = True
        for callback in _on_interrupt:
            callback()
        raise KeyboardInterrupt


def take_sigint() -> None:
    """A managed Locust process handles SIGINT once, even when started with it ignored (`&` in a script)."""
    signal.signal(signal.SIGINT, interrupt_once)


@contextlib.contextmanager
def stop_signals_as_interrupt() -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM raise KeyboardInterrupt: `kill PID` stops a run like Ctrl-C, and
    Ctrl-C stops it even when SIGINT was inherited ignored (started with `&` from a script, which would
    otherwise run its whole plan through Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_group(pgid: int, timeout_s: float) -> list[int]:
    """Wait until no process of group `pgid` is left; returns the pids that had to be killed.

    Orphaned workers of a dead master stop by themselves (they watch their
    parent); only what is still there after `timeout_s` is killed.
    """
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            killed = _group_pids(pgid)
            _signal_group(pgid, signal.SIGKILL)
            while _group_alive(pgid) and time.monotonic() < deadline + 5:
                time.sleep(0.05)
            return killed
        time.sleep(0.1)
    return []


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-pgid, os.WNOHANG)[0]:  # reap orphans re-parented to us
            pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(_group_pids(pgid)) or not os.path.isdir("/proc")


def _group_pids(pgid: int) -> list[int]:
    """Live (not zombie) pids of the group, from /proc (empty where there is no /proc)."""
    pids = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    pids.append(int(entry))
    return pids


# ------------------------------------------------------------------ the Locust side


class Lifeline:
    """One Locust process's watch on its parent and (on a worker) its master."""

    def __init__(self, parent_pid: int | None, heartbeat: Callable[[], float | None] | None,
                 on_lost: Callable[[], None] | None = None) -> None:
        """`on_lost` is called once, when the parent or master is found gone, before Locust's Ctrl-C."""
        self.parent_pid = parent_pid
        self.heartbeat = heartbeat
        self.on_lost = on_lost
        self.reason: str | None = None

    def parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def check(self) -> str | None:
        """Why this process must stop now (its parent or master is gone), else None; remembered."""
        if self.reason is None:
            if self.parent_gone():
                self._lost(f"parent process {self.parent_pid} is gone")
            elif self.heartbeat is not None:
                last = self.heartbeat()
                if last and time.time() - last > MASTER_LOST_S:
                    self._lost(f"no heartbeat from the Locust master for {time.time() - last:.0f} s")
        return self.reason

    def _lost(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            if self.on_lost is not None:
                self.on_lost()

    def arm(self) -> None:
        """Start watching: the kernel's parent-death signal where there is one, and a polling greenlet."""
        import gevent

        if self.parent_pid is not None:
            signal.signal(PARENT_DEATH_SIGNAL, self._parent_died)
            _prctl(_PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)
        if self.parent_gone():  # the parent died before the watch was set
            self.check()
            os.kill(os.getpid(), signal.SIGINT)
            return
        gevent.spawn(self._watch)

    def _parent_died(self, signum: int, frame: object) -> None:
        """The kernel's parent-death signal. It can come while the dying parent's other threads still
        exist (`getppid()` unchanged for a moment), so the reason is recorded here, not looked up. A
        process already shutting down on request was not cut off: it just finishes."""
        if not _interrupted:
            self._lost(f"parent process {self.parent_pid} is gone")
            interrupt_once()

    def quiet(self) -> None:
        """Locust is shutting down: later interrupts are ignored (see `interrupt_once`)."""
        global _interrupted
        _interrupted = True

    def _watch(self) -> None:
        import gevent

        while self.check() is None:
            gevent.sleep(POLL_S)
        log.error("tokenload: %s; stopping this Locust process now", self.reason)
        if not _interrupted:
            os.kill(os.getpid(), signal.SIGINT)  # Locust's Ctrl-C: users stopped, `quit` fired, records flushed


def parent_to_watch(forked_worker: bool) -> int | None:
    """The pid a Locust process must not outlive: its master for a forked worker, else `tokenload run`."""
    if forked_worker and os.getpid() != LAUNCH_PID:
        return LAUNCH_PID
    value = os.environ.get(PARENT_ENV, "")
    return int(value) if value.isdigit() else None
