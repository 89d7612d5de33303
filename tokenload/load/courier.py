"""Records over Locust's own messages: workers on machines that share no disk with the master.

A worker whose run directory is not the master's (no shared filesystem: a
container, a pod, another machine) sends its records to the master instead of
writing segments: every flush becomes one batch (the same Arrow bytes a segment
file holds), numbered per worker and run, sent with `runner.send_message` on
the ZeroMQ socket Locust already has. The master's `Receiver` writes each
batch into its run directory as that worker's segment (`<worker>-<seq>.arrow`,
atomically), writes the worker's state file from the state the batch carries,
and acknowledges the batch. A batch stays in the worker's spool until it is
acknowledged and is sent again after `RESEND_S` (a connection Locust had to
reset, a master that was busy), so the master may see it twice: it keeps the
first copy of each (worker, run, seq), which holds the same request ids as any
later copy. The state the master writes says `done` only once every batch up
to the worker's last has arrived, so finalising waits for them exactly as it
waits for a shared directory's flushes.

Which way a worker's records go is decided when the master announces the run
(`series.switch_run`, before the spawn messages): segments where the announced
run is there on disk (this machine's forked workers, or a shared filesystem,
as before), messages otherwise.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from locust.env import Environment
from locust.exception import RPCError
from locust.runners import WorkerRunner
from pyarrow import feather

from tokenload.load import records
from tokenload.load.rundirs import RUN_INFO, read_json
from tokenload.record import RequestRecord

RECORDS_MESSAGE = "tokenload_records"
ACK_MESSAGE = "tokenload_records_ack"
RESEND_S = 10.0  # a batch not acknowledged after this long is sent again (at the next flush)


def segment_bytes(rows: list[RequestRecord]) -> bytes:
    """Rows as the bytes of one segment file (Arrow IPC, uncompressed)."""
    sink = io.BytesIO()
    feather.write_feather(records.table(rows), sink, compression="uncompressed")
    return sink.getvalue()


@dataclass
class _Batch:
    data: bytes
    count: int
    sent_at: float = float("-inf")


class MessageWriter(records.RecordBuffer):
    """A worker's record writer that sends batches to the master; the same interface as `SegmentWriter`."""

    def __init__(self, runner: WorkerRunner, worker: str, run_id: str) -> None:
        super().__init__(worker)
        self.runner = runner
        self.run_id = run_id
        self._spool: dict[int, _Batch] = {}  # sent, not acknowledged yet
        self._state: dict[str, Any] = {}

    def flush(self, state: dict[str, Any], done: bool = False) -> None:
        """Spool the buffered rows as the next batch, then send every batch due, with this process's state."""
        rows = self.take(done)
        if rows is None:
            return
        if rows:
            self._spool[self._seq] = _Batch(segment_bytes(rows), len(rows))
            self._seq += 1
            self.written += len(rows)
        self._state = {**state, "done": done}
        now = time.monotonic()
        due: list[int | None] = [seq for seq, batch in self._spool.items() if now - batch.sent_at >= RESEND_S]
        for seq in due or [None]:  # nothing due: the state alone
            self._send(seq, now)

    def _send(self, seq: int | None, now: float) -> None:
        batch = None if seq is None else self._spool[seq]
        message = {"run_id": self.run_id, "worker": self.worker, "seq": seq, "batches": self._seq,
                   "rows": None if batch is None else batch.data, "count": 0 if batch is None else batch.count,
                   "state": self._state}
        try:
            self.runner.send_message(RECORDS_MESSAGE, message)
        except RPCError as exc:  # the socket's queue is full or broken (Locust resets it): the spool sends it again
            logging.getLogger(__name__).warning("tokenload: records batch %s not sent (%s); kept for a resend",
                                                seq, exc)
            return
        if batch is not None:
            batch.sent_at = now

    def on_ack(self, data: dict[str, Any]) -> None:
        """The master has batch `seq` (or finalised the run: `sealed`, nothing more will count)."""
        if data["run_id"] != self.run_id:
            return
        self._spool.pop(data["seq"], None)
        if data.get("sealed"):
            self.sealed = True


def holds_run(run_dir: Path, run_id: str) -> bool:
    """Whether `run_dir` on this machine is the run `run_id` (the master's own, or on a shared filesystem)."""
    return read_json(run_dir / records.SEGMENTS_DIR / RUN_INFO).get("run_id") == run_id


def writer_for(environment: Environment, worker: str, run_id: str,
               run_dir: Path) -> records.SegmentWriter | MessageWriter:
    """The record writer of a process joining run `run_id`: segments where the run is on disk, else messages."""
    runner = environment.runner
    if isinstance(runner, WorkerRunner) and not holds_run(run_dir, run_id):
        return MessageWriter(runner, worker, run_id)
    return records.SegmentWriter(run_dir, worker)


def follow_acks(environment: Environment) -> None:
    """On a worker: hand the master's acknowledgements to the current writer."""
    def on_ack(environment: Environment, msg: Any, **_: Any) -> None:
        writer = getattr(getattr(environment, "tokenload_process", None), "writer", None)
        if isinstance(writer, MessageWriter):
            writer.on_ack(msg.data)

    assert environment.runner is not None
    environment.runner.register_message(ACK_MESSAGE, on_ack)


class Receiver:
    """On the master: write each worker's batches into the run directory as its segments, and acknowledge them."""

    def __init__(self, environment: Environment) -> None:
        self.environment = environment
        self._have: dict[tuple[str, str], dict[int, int]] = {}  # (run id, worker) -> seq -> records

    def install(self) -> Receiver:
        assert self.environment.runner is not None
        self.environment.runner.register_message(RECORDS_MESSAGE, self.on_records)
        return self

    def run_dir(self, run_id: str) -> Path | None:
        """The directory of run `run_id` of this session (with the web UI every start is a run)."""
        opts = self.environment.parsed_options
        assert opts is not None
        if opts.run_id == run_id:
            return Path(opts.run_dir)
        runs = getattr(getattr(self.environment, "tokenload_series", None), "runs", [])
        return next((run.run_dir for run in runs if run.run_id == run_id), None)

    def on_records(self, environment: Environment, msg: Any, **_: Any) -> None:
        data = msg.data
        run_id, worker, seq = data["run_id"], data["worker"], data["seq"]
        run_dir = self.run_dir(run_id)
        seg = None if run_dir is None else run_dir / records.SEGMENTS_DIR
        have = self._have.setdefault((run_id, worker), {})
        try:
            if seg is None or not seg.is_dir():
                raise FileNotFoundError(run_id)
            if seq is not None and seq not in have:  # a batch sent again is already here: the first copy counts
                records.write_bytes(seg / records.segment_name(worker, seq), data["rows"])
                have[seq] = data["count"]
            complete = len(have) == data["batches"]
            records.write_json(seg / f"{worker}.state.json",
                               {**data["state"], "worker": worker, "records": sum(have.values()),
                                "done": bool(data["state"].get("done")) and complete, "updated_at": time.time(),
                                "by_message": True})
            sealed = False
        except FileNotFoundError:  # finalised (or sealed while this batch was written): its records stay out
            sealed = True
        if seq is not None or sealed:
            assert environment.runner is not None
            environment.runner.send_message(ACK_MESSAGE, {"run_id": run_id, "seq": seq, "sealed": sealed},
                                            client_id=msg.node_id)
