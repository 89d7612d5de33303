"""One machine shared by the test workers: a test that measures time against a clock runs alone.

Under pytest-xdist several workers run tests at once. Most tests wait on a clock far
more than they compute and do not mind; a few judge timing itself (a simulated day
compressed into seconds, a saturated client, a deadline) and read wrong when another
worker's Locust takes a core. Those hold the machine exclusively, the others share it:
a readers-writer lock on two files, writer first. A writer takes the gate, then waits
for the running tests to end (their shared locks); readers pass the gate one at a time
on their way in, so none starts while a writer waits or runs.

A light test (the fast tier's: short, no Locust run) that finds the gate taken runs anyway,
one at a time (a third file, the lane): an alone test leaves most of the second core idle,
and one short neighbour at a time uses it without taking a core from it for long.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Literal


def _lock_files() -> tuple[Path, Path, Path] | None:
    """The gate, the machine lock and the light lane of this test run; None outside pytest-xdist (one process:
    nothing to share)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return None
    base = Path(tempfile.gettempdir()) / f"tokenload-tests-{run}"
    return base.with_suffix(".gate"), base.with_suffix(".machine"), base.with_suffix(".lane")


Hold = Literal["alone", "shared", "light"]
GATE_TRIES = 5  # a light test's tries at the gate (readers hold it for a moment on their way in) before the lane


@contextmanager
def machine(hold: Hold) -> Iterator[None]:
    """Hold the machine: alone, beside the other shared holders, or (light) in the lane while it is taken."""
    files = _lock_files()
    if files is None:
        yield
        return
    gate_path, machine_path, lane_path = files
    with open(gate_path, "a") as gate, open(machine_path, "a") as held, open(lane_path, "a") as lane:
        alone = hold == "alone"
        if not _enter(gate, held, alone, wait=hold != "light"):  # an alone test holds or waits for the gate
            fcntl.flock(lane, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lane, fcntl.LOCK_UN)
            return
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


def _enter(gate: IO[str], held: IO[str], alone: bool, wait: bool) -> bool:
    """Pass the gate to hold the machine, alone (keeping the gate) or shared; without `wait`, give up (False)
    when the gate stays taken for `GATE_TRIES` tries."""
    for _ in range(1 if wait else GATE_TRIES):
        try:
            fcntl.flock(gate, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        return True
    return False
