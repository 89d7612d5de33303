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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import feather, ipc

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


# Finalising sorts at most SORT_ROWS records at once (about 150 MB of them): a run up to that many is sorted in one
# piece; a longer one in pieces of that size, each spilled to disk (lz4-compressed Arrow IPC) and then merged by
# start time, so what finalising holds does not grow with the run (benchmarks/long_runs.py).
SORT_ROWS = 262_144
SPILL_BATCH_ROWS = 2_048  # the merge reads each spilled piece this many records at a time
MERGE_FAN_IN = 64  # pieces merged at once; more are first merged into longer pieces, MERGE_FAN_IN at a time
ROW_GROUP_ROWS = 131_072  # requests.parquet's row groups: what a reader of it needs to hold at once
SPILL_DIR = ".merge"  # inside the sealed directory: gone with it


@dataclass
class Merged:
    """What the merge counted on the records' way into requests.parquet."""

    rows: int = 0
    in_flight: int = 0
    finished: int = 0
    finished_ok: int = 0
    per_worker: dict[str, int] = field(default_factory=dict)
    # A record written twice (one request id at one start time: a courier batch that was also written directly,
    # a segment copied by hand) is kept once; ids are a process's random tag and a counter, so nothing else repeats.
    copies: int = 0

    def count(self, chunk: pa.Table) -> None:
        self.rows += chunk.num_rows
        in_flight = chunk.column("in_flight").fill_null(False)
        self.in_flight += int(pc.sum(in_flight).as_py() or 0)
        finished = pc.invert(in_flight)
        self.finished += int(pc.sum(finished).as_py() or 0)
        self.finished_ok += int(pc.sum(pc.and_(finished, pc.equal(chunk.column("status"), "ok")).fill_null(False))
                                .as_py() or 0)
        for entry in pc.value_counts(chunk.column("worker")).to_pylist():
            self.per_worker[entry["values"]] = self.per_worker.get(entry["values"], 0) + entry["counts"]


def _starts(chunk: pa.Table) -> np.ndarray:
    """The records' start times as the merge compares them: a missing one (null, NaN) after every other."""
    starts = chunk.column("started_at").to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    return np.where(np.isnan(starts), np.inf, starts)


def _sort(chunk: pa.Table) -> pa.Table:
    """Records by start time, stably (the order of the old one-piece merge: ties keep their segments' order)."""
    chunk = chunk.combine_chunks()
    return chunk.take(pc.sort_indices(chunk, [("started_at", "ascending")]))


def _without_copies(chunk: pa.Table) -> tuple[pa.Table, int]:
    """A sorted chunk without the second copy of any record (same start, same request id); how many were dropped."""
    starts = chunk.column("started_at").to_numpy(zero_copy_only=False)
    tied = np.zeros(len(starts), dtype=bool)
    same = starts[1:] == starts[:-1]
    tied[1:] |= same
    tied[:-1] |= same
    if not tied.any():
        return chunk, 0
    at = np.flatnonzero(tied)
    seen: set[tuple[float, str]] = set()
    drop = []
    for i, rid in zip(at, chunk.column("request_id").take(pa.array(at)).to_pylist()):
        if (starts[i], rid) in seen:
            drop.append(i)
        seen.add((starts[i], rid))
    if not drop:
        return chunk, 0
    keep = np.ones(len(starts), dtype=bool)
    keep[drop] = False
    return chunk.filter(pa.array(keep)), len(drop)


def _segments(sealed: Path) -> Iterator[pa.Table]:
    for path in sorted(sealed.glob("*.arrow")):
        yield feather.read_table(path).cast(SCHEMA)


def _pieces(tables: Iterator[pa.Table], rows: int) -> Iterator[tuple[pa.Table, bool]]:
    """Consecutive tables joined into sorted pieces of about `rows` records, each with whether it is the last."""
    held: list[pa.Table] = []
    count = 0
    for table in tables:
        if count >= rows:
            yield _sort(pa.concat_tables(held)), False
            held, count = [], 0
        held.append(table)
        count += table.num_rows
    if held:
        yield _sort(pa.concat_tables(held)), True


class _Piece:
    """A spilled sorted piece, read SPILL_BATCH_ROWS records at a time; `held` is what is read and not yet merged."""

    def __init__(self, path: Path) -> None:
        self.reader = ipc.open_file(pa.OSFile(str(path)))
        self.next = 0
        self.held: list[pa.RecordBatch] = []
        self.starts = np.empty(0)

    @property
    def more(self) -> bool:
        return self.next < self.reader.num_record_batches

    def read(self) -> None:
        batch = self.reader.get_batch(self.next)
        self.next += 1
        self.held.append(batch)
        self.starts = np.concatenate([self.starts, _starts(pa.Table.from_batches([batch], SCHEMA))])

    def take(self, below: float | None) -> list[pa.RecordBatch]:
        """The held records that start before `below` (None: all of them)."""
        n = len(self.starts) if below is None else int(np.searchsorted(self.starts, below, side="left"))
        self.starts = self.starts[n:]
        out = []
        while n:
            batch = self.held[0]
            if batch.num_rows <= n:
                out.append(self.held.pop(0))
                n -= batch.num_rows
            else:
                out.append(batch.slice(0, n))
                self.held[0] = batch.slice(n)
                n = 0
        return out


def _spill(path: Path, chunks: Iterable[pa.Table]) -> Path:
    options = ipc.IpcWriteOptions(compression="lz4")
    with ipc.new_file(str(path), SCHEMA, options=options) as writer:
        for chunk in chunks:
            writer.write_table(chunk, max_chunksize=SPILL_BATCH_ROWS)
    return path


def _merge(paths: list[Path]) -> Iterator[pa.Table]:
    """The records of sorted spilled pieces in one sorted stream, chunk by chunk.

    Each round takes, from every piece, the records that start before the
    earliest last start any piece with more on disk holds: nothing still on
    disk can start before those. All records of one start time leave in one
    round, in the pieces' order, so ties keep the order of a one-piece sort.
    """
    pieces = [_Piece(p) for p in paths]
    for piece in pieces:
        if piece.more:
            piece.read()
    while True:
        pending = [p for p in pieces if p.more]
        below = min((float(p.starts[-1]) if len(p.starts) else -np.inf for p in pending), default=None)
        parts = [batch for p in pieces for batch in p.take(below)]
        if parts:
            yield _sort(pa.Table.from_batches(parts, SCHEMA))
        if not pending:
            return
        for piece in pending:  # the one that set the bound has nothing left below it, or only records at it
            if not len(piece.starts) or piece.starts[-1] <= cast(float, below):
                piece.read()


def _sorted_chunks(sealed: Path) -> Iterator[pa.Table]:
    """Every record of the sealed segments, sorted by start time, in chunks of bounded size."""
    spill = sealed / SPILL_DIR
    shutil.rmtree(spill, ignore_errors=True)  # left by a finalise that was cut short
    paths: list[Path] = []
    for piece, last in _pieces(_segments(sealed), SORT_ROWS):
        if last and not paths:  # the whole run in one piece
            yield piece
            return
        spill.mkdir(exist_ok=True)
        paths.append(_spill(spill / f"{len(paths):06d}.arrow", [piece]))
    if not paths:
        return
    level = 0
    while len(paths) > MERGE_FAN_IN:  # merge into longer pieces first: at most MERGE_FAN_IN are read at once
        level += 1
        paths = [_spill(spill / f"{level}-{i:06d}.arrow", _merge(paths[i:i + MERGE_FAN_IN]))
                 for i in range(0, len(paths), MERGE_FAN_IN)]
    yield from _merge(paths)


def merge_segments(run_dir: Path, sealed: Path) -> Merged:
    """Merge every segment of `sealed` into RUN_DIR/requests.parquet, sorted by start time, row group by row group.

    The records are never all in memory (see SORT_ROWS). The sealed directory is
    removed only after the Parquet file is safely in place.
    """
    merged = Merged()

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, SCHEMA) as writer:
            held: list[pa.Table] = []
            count = 0
            for chunk in _sorted_chunks(sealed):
                chunk, copies = _without_copies(chunk)
                merged.copies += copies
                merged.count(chunk)
                held.append(chunk)
                count += chunk.num_rows
                if count >= ROW_GROUP_ROWS:
                    rows = pa.concat_tables(held)
                    whole = count - count % ROW_GROUP_ROWS
                    writer.write_table(rows.slice(0, whole), row_group_size=ROW_GROUP_ROWS)
                    held, count = [rows.slice(whole)], count - whole
            if count or not merged.rows:
                writer.write_table(pa.concat_tables(held) if held else SCHEMA.empty_table())

    _atomic_write(run_dir / REQUESTS_FILE, write)
    shutil.rmtree(sealed)
    return merged
