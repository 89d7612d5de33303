"""Crash-safe request records: per-process Arrow segments, merged into requests.parquet.

Every Locust process that runs users (the local runner, or each worker) appends
its records to memory and writes them out as a new Arrow IPC segment at least
once a second (`segments/<worker>-<seq>.arrow`, written to a temporary name
and renamed, so a segment is either whole or absent). A Ctrl-C or a killed
worker therefore loses at most the last second. Next to its segments each
process keeps `<worker>.state.json` (records written so far, scheduler lag,
CPU) and marks it `done` at exit: the merge uses that to wait for remote
workers and to prove no record went missing.

Nothing is finalised inside Locust: the master's `test_stop` fires before the
workers' last records exist (LOCUST-NOTES.md). `merge_segments` runs after all
Locust processes have exited, in `tokenload run` (or in `tokenload analyze`,
for a run whose `tokenload run` was killed).

The rule for late writers: a run is sealed when finalising starts, by renaming
`segments/` to `segments.sealed/` (one atomic rename, also on a shared network
filesystem). A process that flushes after that finds no `segments/` directory:
its write fails, its records are dropped and it stops (`SegmentWriter.sealed`).
So nothing written after a run is finalised ever lands in it; finalising first
waits for every process it knows of to flush and exit, so in a healthy run
nothing is dropped either.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import feather

from tokenload.errors import ConfigError
from tokenload.record import RequestRecord, arrow_schema
from tokenload.rundir import REQUESTS_FILE, SEGMENTS_DIR

# The third `status` beside `ok` and `error`: tokenload cut the request open (the run's end, a step down;
# `in_flight` is true, `cut_at` when): no error, no complete answer; the timings it got are kept.
CANCELLED: Final = "cancelled"
SEALED_DIR = "segments.sealed"

# The columns are defined in tokenload.record (RequestRecord): add a column there, not here.
SCHEMA = arrow_schema()
COLUMNS: tuple[str, ...] = tuple(SCHEMA.names)


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def safe_worker_id(raw: str) -> str:
    """A worker id fit for a file name (Locust's client ids hold the host name; a courier batch names its own)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw).lstrip(".") or "_"


def write_segment(path: Path, table: pa.Table) -> None:
    """Write one segment of records atomically (uncompressed Arrow IPC: cheap to write every second)."""
    _atomic_write(path, lambda tmp: feather.write_feather(table, tmp, compression="uncompressed"))


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically: readers never see half a file."""
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8"))


def segment_name(worker: str, seq: int) -> str:
    """The file name of a worker's `seq`-th segment: the merge reads them in this order."""
    return f"{worker}-{seq:06d}.arrow"


def table(rows: list[RequestRecord]) -> pa.Table:
    """Records as an Arrow table with the run directory's schema."""
    return pa.Table.from_pylist(rows, schema=SCHEMA)


class RecordBuffer:
    """One process's records between two flushes, and what every record writer says about itself."""

    def __init__(self, worker: str, closed: bool = False) -> None:
        self.worker = worker
        # Closed once its run is over: the run directory may be finalised (segments gone) after that.
        self.closed = closed
        self.sealed = False  # the run was finalised under this writer: nothing more is written
        self.written = 0
        self._rows: list[RequestRecord] = []
        self._seq = 0  # segments (or batches) made so far: the next one's number

    def append(self, record: RequestRecord) -> None:
        self._rows.append(record)

    @property
    def pending(self) -> int:
        return len(self._rows)

    def take(self, done: bool) -> list[RequestRecord] | None:
        """A flush's rows, or None: a closed writer writes nothing, a sealed one drops them; `done` closes it."""
        if self.closed:
            return None
        self.closed = done
        rows, self._rows = self._rows, []
        return None if self.sealed else rows


class SegmentWriter(RecordBuffer):
    """Buffers one process's records and writes them as numbered Arrow segments."""

    def __init__(self, run_dir: Path | None, worker: str) -> None:
        """`run_dir` None: a worker that learns its run from the master at the first start; writes nothing."""
        super().__init__(worker, closed=run_dir is None)
        self.dir = Path() if run_dir is None else run_dir / SEGMENTS_DIR
        if run_dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        # The first conversion loads pyarrow's kernels (~0.2 s): pay it now, before
        # any user runs, not in the middle of a stream where it would delay timestamps.
        pa.Table.from_pylist([{"request_id": "warm-up"}], schema=SCHEMA)

    def flush(self, state: dict[str, Any], done: bool = False) -> None:
        """Write buffered rows (if any) as a new segment, then this process's state file; `done` closes the writer.

        Once the run is sealed the rows are dropped (`sealed` turns True): they
        arrived after the run was finalised and must not change it.
        """
        rows = self.take(done)
        if rows is None:
            return
        try:
            if rows:
                write_segment(self.dir / segment_name(self.worker, self._seq), table(rows))
                self._seq += 1
                self.written += len(rows)
            write_json(self.dir / f"{self.worker}.state.json",
                       {**state, "worker": self.worker, "records": self.written, "segments": self._seq, "done": done,
                        "updated_at": time.time()})
        except FileNotFoundError:
            if self.dir.is_dir():
                raise
            self.sealed = True


class AsideWriter(SegmentWriter):
    """Records a process sends beside its users' (the error-storm breaker's probes), each written at once as a
    segment of its own under a worker id of its own, whose state is always done (nothing of it is ever pending)."""

    def write(self, record: RequestRecord) -> None:
        self.append(record)
        self.flush({"aside": True}, done=True)
        self.closed = self.sealed  # done for the merge, yet open for the next one until the run is sealed


class SegmentTail:
    """Reads each segment of a run once, as it appears: the records of every process, live.

    Segments are renamed into place whole and never change, so a file read once
    is done. `tokenload run` polls the live directory while the run goes and the
    sealed one just before the merge, so every segment is read exactly once.
    """

    def __init__(self, columns: tuple[str, ...]) -> None:
        self.columns = list(columns)
        self._read: set[str] = set()

    def new_records(self, seg_dir: Path) -> list[dict[str, Any]]:
        """The records of the segments in `seg_dir` not read before (columns `columns`)."""
        rows: list[dict[str, Any]] = []
        for path in sorted(seg_dir.glob("*.arrow")):
            if path.name in self._read:
                continue
            self._read.add(path.name)
            rows += feather.read_table(path, columns=self.columns).to_pylist()
        return rows


def worker_states(seg_dir: Path) -> dict[str, dict[str, Any]]:
    """Every process's latest state file in a segments directory, by worker id."""
    states = {}
    for path in sorted(seg_dir.glob("*.state.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a state file is rewritten atomically; unreadable means not ours
        states[data.get("worker", path.name[: -len(".state.json")])] = data
    return states


def process_lags(states: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each process's scheduler-lag stats from its state, by worker id (an `AsideWriter` runs no users: none)."""
    return {w: s.get("lag", {}) for w, s in states.items() if not s.get("aside")}


def wait_for_workers(run_dir: Path, expected: list[str], timeout_s: float) -> list[str]:
    """Wait until every expected worker marked its state done; return those that did not."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = worker_states(run_dir / SEGMENTS_DIR)
        missing = [w for w in expected if not states.get(w, {}).get("done")]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


def unfinalised(run_dir: Path) -> Path | None:
    """The segments directory of a run that was not finalised (killed, or still running), or None."""
    for name in (SEALED_DIR, SEGMENTS_DIR):  # a sealed one first: a finalise that was itself cut short
        if (run_dir / name).is_dir():
            return run_dir / name
    return None


def seal(run_dir: Path) -> Path:
    """Seal the run against late writers (see the module docstring); returns the sealed directory."""
    sealed = run_dir / SEALED_DIR
    if not sealed.is_dir():
        (run_dir / SEGMENTS_DIR).mkdir(parents=True, exist_ok=True)
        os.replace(run_dir / SEGMENTS_DIR, sealed)
    return sealed


def merge_segments(run_dir: Path, sealed: Path) -> pa.Table:
    """Concatenate every segment of `sealed` into RUN_DIR/requests.parquet; duplicates are an error.

    The sealed directory is removed only after the Parquet file is safely in place.
    """
    tables = [feather.read_table(p) for p in sorted(sealed.glob("*.arrow"))]
    table = pa.concat_tables(tables).cast(SCHEMA) if tables else SCHEMA.empty_table()
    ids = table.column("request_id")
    if len(ids) != len(pc.unique(ids)):
        raise ConfigError(f"{run_dir}: duplicate request_id values across segments; the run directory was reused")
    if len(table):
        table = table.sort_by([("started_at", "ascending")])
    _atomic_write(run_dir / REQUESTS_FILE, lambda tmp: pq.write_table(table, tmp))
    shutil.rmtree(sealed)
    return table
