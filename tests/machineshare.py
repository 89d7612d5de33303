"""One machine shared by the test workers: a test that measures time against a clock runs alone.

Under pytest-xdist several workers run tests at once. Most tests wait on a clock far
more than they compute and do not mind; a few judge timing itself (a simulated day
compressed into seconds, a saturated client, a deadline) and read wrong when another
worker's Locust takes a core. Those hold the machine exclusively, the others share it:
a readers-writer lock on two files, writer first. A writer takes the gate, then waits
for the running tests to end (their shared locks); readers pass the gate one at a time
on their way in, so none starts while a writer waits or runs.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _lock_files() -> tuple[Path, Path] | None:
    """The gate and the machine lock of this test run; None outside pytest-xdist (one process: nothing to share)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return None
    base = Path(tempfile.gettempdir()) / f"tokenload-tests-{run}"
    return base.with_suffix(".gate"), base.with_suffix(".machine")


@contextmanager
def machine(exclusive: bool) -> Iterator[None]:
    """Hold the machine: alone when `exclusive`, else beside the other shared holders."""
    files = _lock_files()
    if files is None:
        yield
        return
    gate_path, machine_path = files
    with open(gate_path, "a") as gate, open(machine_path, "a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
