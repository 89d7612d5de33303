"""Records over Locust's own channel (a courier from each worker to its master): no shared disk needed.

A worker whose directory does not hold its master's run (`tokenload run
--worker --out B` on another machine, a pod with its own disk) writes its
segments into a local spool, `B/spool/<run id>/segments/` (the same numbered
Arrow IPC files and state file as in a run directory: `records.SegmentWriter`),
and sends each one to the master as a Locust message (`BATCH_MESSAGE`: run id,
worker, segment number, the file's bytes, the worker's state). The master
writes it into its run directory under the same name and acknowledges it
(`ACK_MESSAGE`, to that worker only); the worker then deletes the spooled file.
A batch that came before is known by its worker and number (`Numbers`), and a
record sent again in another batch by its request id among the run's recent
batches (`RecentIds`): the master's memory stays flat however long the run. An acknowledged state frees
every batch it counts as well (the master writes a state only once they all
arrived), so a lost acknowledgement of a batch costs no copy after the end. A
batch without an acknowledgement is sent again after `RESEND_S` (a lost message,
a reconnect), so the master may get one twice: the second copy adds no record.
While nothing is acknowledged (the master unreachable) each batch waits twice as
long before each next copy, up to `RESEND_MAX_S`, and any acknowledgement
brings the wait back to `RESEND_S`: a copy sent into a cut network only waits in
ZeroMQ's queue, so a fixed period would fill memory with one copy per batch
every `RESEND_S`.

The worker's state (records written, lag, `done`) is written into the master's
run directory only once every segment it counts has arrived, so `done` there
means what it means for a worker writing directly: all its records are in, and
the finaliser's wait for every worker's last flush covers these workers too.

Locust stops listening before the end: a headless master stops its receiver
half a second after it sends `quit`, while its workers still drain, and a
worker stops its receiver at that `quit`. So at the end both sides listen on
the socket themselves: the master while it waits for its workers
(`collecting`), a worker until its batches are acknowledged (`settle`, at most
`SETTLE_S`, also after it lost its master: a cut network may heal).

A worker whose `--out` is the master's run directory (a shared filesystem, or
the forked workers of `--processes N`) sees the master's run there and writes
into it directly, as before; nothing goes over the channel.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import gevent
import pyarrow as pa
from locust.env import Environment
from locust.exception import RPCError
from locust.rpc import Message
from pyarrow import feather

from tokenload.load import records, roles
from tokenload.load.messages import ACK_MESSAGE, BATCH_MESSAGE, Ack, Batch
from tokenload.load.rundirs import RUN_INFO, read_json

SPOOL_DIR = "spool"
# A batch the master has not acknowledged after this long is sent again; each further copy waits twice as long as
# the one before, at most RESEND_MAX_S (a 10 s cut: copies at 3 and 9 s, and the next at most 12 s after it heals,
# well within SETTLE_S; any acknowledgement brings the wait back to RESEND_S at once).
RESEND_S = 3.0
RESEND_MAX_S = 12.0
# How long a worker that quits goes on sending what its master has not acknowledged: long enough to ride out a
# network cut of 10 s or so (TCP's retransmissions back off to several seconds meanwhile).
SETTLE_S = 30.0
# A record sent again in a batch of another number (not a copy of a whole batch, which its number names) is looked
# for among the request ids of the run's last RECENT_BATCHES batches only; one from further back is still kept once
# (finalising drops a second copy of a record: `records.merge_segments`).
RECENT_BATCHES = 128


def _due(last: tuple[float, float] | None, now: float) -> tuple[float, float] | None:
    """A send due `now` as (when, wait for its ack), or None; `last` is the previous send's (None: never sent).

    A first send waits `RESEND_S` for its acknowledgement, each copy after it twice as long, at most `RESEND_MAX_S`.
    """
    if last is None:
        return now, RESEND_S
    when, wait = last
    return (now, min(2 * wait, RESEND_MAX_S)) if now - when >= wait else None


def shares_run(run_dir: Path, run_id: str) -> bool:
    """True when `run_dir` holds the master's run `run_id` (a shared or local directory): write into it directly."""
    return read_json(run_dir / records.SEGMENTS_DIR / RUN_INFO).get("run_id") == run_id


class Outbox:
    """Worker side: one run's spooled segments, sent to the master until it acknowledges each."""

    def __init__(self, role: roles.Role, run_id: str, writer: records.SegmentWriter) -> None:
        self.role = role
        self.run_id = run_id
        self.writer = writer
        self._sent: dict[int, tuple[float, float]] = {}  # segment number -> (when last sent (monotonic), wait)
        self._state_sent: tuple[float | None, tuple[float, float] | None] = (None, None)  # (updated_at, as _sent)
        self.state_acked: float | None = None

    def _state(self) -> dict[str, Any]:
        return read_json(self.writer.dir / f"{self.writer.worker}.state.json")

    def unacked(self) -> list[Path]:
        return sorted(self.writer.dir.glob(f"{self.writer.worker}-*.arrow"))

    @property
    def settled(self) -> bool:
        """Every batch and the latest state acknowledged (a sealed run takes nothing more: settled too)."""
        return self.writer.sealed or (not self.unacked() and self._state().get("updated_at") == self.state_acked)

    def pump(self) -> None:
        """Send every batch never sent or unacknowledged for its wait (`_due`), and the state when it changed.

        A send that fails (the master's socket is gone) is tried again at the next pump. A sealed run (the
        master finalised it) takes nothing more.
        """
        if self.writer.sealed:
            return
        now = time.monotonic()
        state = self._state()
        try:
            for path in self.unacked():
                seq = int(path.stem.rsplit("-", 1)[1])
                due = _due(self._sent.get(seq), now)
                if due is not None:
                    self._send(seq, path.read_bytes(), state)
                    self._sent[seq] = due
            at, last = self._state_sent
            stamp = state.get("updated_at")
            due = _due(last if stamp == at else None, now)
            if stamp is not None and stamp != self.state_acked and due is not None:
                self._send(None, None, state)
                self._state_sent = (stamp, due)
        except RPCError:
            return

    def _send(self, seq: int | None, data: bytes | None, state: dict[str, Any]) -> None:
        batch: Batch = {"run_id": self.run_id, "worker": self.writer.worker, "seq": seq, "data": data, "state": state}
        self.role.to_master(BATCH_MESSAGE, batch)

    def on_ack(self, data: Ack) -> None:
        """The master got a batch (or the state): free it; the link works, so what is still unacknowledged waits
        `RESEND_S` again (sent at the next pump if that is over)."""
        self._sent = {seq: (when, RESEND_S) for seq, (when, _) in self._sent.items()}
        at, last = self._state_sent
        self._state_sent = (at, None if last is None else (last[0], RESEND_S))
        if data.get("sealed"):
            self.writer.sealed = True
        seq = data["seq"]
        freed = set() if seq is None else {int(seq)}
        if data.get("state_at") is not None:
            self.state_acked = data["state_at"]
            # A state is acknowledged only once every batch it counts has arrived: those are in too, also when
            # their own acknowledgements were lost (the master may finalise and go before it hears them again).
            freed.update(range(int(data.get("segments") or 0)))
        for seq in freed:
            (self.writer.dir / records.segment_name(self.writer.worker, seq)).unlink(missing_ok=True)
            self._sent.pop(seq, None)


def writer_for(environment: Environment, run_id: str, run_dir: Path, spool_root: Path | None,
               worker: str) -> records.SegmentWriter:
    """A worker's record writer for the master's run `run_id`: into `run_dir` if it holds that run, else a spool.

    `spool_root`: the worker's own directory (`--run-dir`); None, a new temporary one.
    """
    if shares_run(run_dir, run_id):
        return records.SegmentWriter(run_dir, worker)
    root = spool_root if spool_root is not None else Path(tempfile.mkdtemp(prefix="tokenload-spool-"))
    writer = records.SegmentWriter(root / SPOOL_DIR / run_id, worker)
    role = roles.of(environment)
    _outboxes(role)[run_id] = Outbox(role, run_id, writer)
    return writer


OUTBOXES: roles.Part[dict[str, Outbox]] = roles.Part("courier outboxes")  # run id -> its outbox, on a worker
INBOX: roles.Part[Inbox] = roles.Part("courier inbox")  # on a master


def _outboxes(role: roles.Role) -> dict[str, Outbox]:
    return role.get(OUTBOXES) or role.put(OUTBOXES, {})


def pump(role: roles.Role) -> None:
    """Worker side, after each flush: send what the master has not acknowledged, for every run of this session."""
    for box in _outboxes(role).values():
        box.pump()


def _on_ack(environment: Environment, msg: Any, **_: Any) -> None:
    data: Ack = msg.data
    box = _outboxes(roles.of(environment)).get(data["run_id"])
    if box is not None:
        box.on_ack(data)


def follow_acks(role: roles.Role) -> None:
    """Worker side: the master's acknowledgements free the spool."""
    role.listen(ACK_MESSAGE, _on_ack)


@contextlib.contextmanager
def _listening(receive: Callable[[], Message], handlers: dict[str, Callable[..., None]],
               environment: Environment) -> Iterator[None]:
    """Take `handlers`' messages from a socket whose Locust listener has stopped (the runner quit), others dropped."""

    def listen() -> None:
        while True:
            try:
                msg = receive()
            except RPCError:
                gevent.sleep(0.1)
                continue
            handler = handlers.get(msg.type)
            if handler is not None:
                handler(environment=environment, msg=msg)

    listener = gevent.spawn(listen)
    try:
        yield
    finally:
        listener.kill()


def settle(environment: Environment, timeout_s: float = SETTLE_S) -> list[str]:
    """Worker side, quitting: send what the master has not acknowledged until it has, or `timeout_s` passed.

    Locust's own receiver stopped at the master's quit, which comes before this worker's last batch; so
    this listens on the socket itself. Returns the spool files still unacknowledged (they stay on disk).
    """
    role = roles.of(environment)
    boxes = list(_outboxes(role).values())
    if not boxes:  # not a worker, or one that writes into its master's run directory itself
        return []
    deadline = time.monotonic() + timeout_s
    with _listening(role.next_message, {ACK_MESSAGE: _on_ack}, environment):
        while not all(box.settled for box in boxes) and time.monotonic() < deadline:
            pump(role)
            gevent.sleep(0.2)
    return [str(path) for box in boxes for path in box.unacked()]


class Numbers:
    """The batch numbers one worker's batches arrived with, in constant memory: every one below `low`, the few above."""

    def __init__(self) -> None:
        self.low = 0  # the first number not arrived
        self.above: set[int] = set()  # arrived out of order, above `low`

    def __contains__(self, seq: int) -> bool:
        return seq < self.low or seq in self.above

    def add(self, seq: int) -> None:
        if seq >= self.low:
            self.above.add(seq)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1


class RecentIds:
    """The request ids of a run's last `batches` batches written."""

    def __init__(self, batches: int = RECENT_BATCHES) -> None:
        self.batches = batches
        self._order: deque[list[str]] = deque()
        self._ids: set[str] = set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, ids: Iterable[str]) -> None:
        """A batch's ids, none of them held already."""
        batch = list(ids)
        self._order.append(batch)
        self._ids.update(batch)
        while len(self._order) > self.batches:
            self._ids.difference_update(self._order.popleft())


class Inbox:
    """Master side: workers' batches into the run directory, each batch and each recent request id once, each batch
    acknowledged."""

    def __init__(self, role: roles.Role, run_dir_of: Callable[[str], Path | None]) -> None:
        self.role = role
        self.run_dir_of = run_dir_of
        self._ids: dict[str, RecentIds] = {}  # run id -> request ids of its recent batches
        self._segments: dict[tuple[str, str], Numbers] = {}  # (run id, worker) -> segment numbers received
        # (run id, worker) -> batches written, duplicate records dropped, messages and Arrow bytes received
        self._counts: dict[tuple[str, str], dict[str, int]] = {}

    def on_batch(self, environment: Environment, msg: Any, **_: Any) -> None:
        data: Batch = msg.data
        run_id, worker = data["run_id"], records.safe_worker_id(data["worker"])
        seq = None if data["seq"] is None else int(data["seq"])
        run_dir = self.run_dir_of(run_id)
        seg = None if run_dir is None else run_dir / records.SEGMENTS_DIR
        if seg is None or not seg.is_dir():  # finalised (or unknown): nothing may change it any more
            self._ids.pop(run_id, None)
            sealed: Ack = {"run_id": run_id, "seq": seq, "sealed": True}
            self.role.to_workers(ACK_MESSAGE, sealed, client_id=msg.node_id)
            return
        key = (run_id, worker)
        got = self._segments.setdefault(key, Numbers())
        counts = self._counts.setdefault(key, {"batches": 0, "duplicate_records": 0, "messages": 0, "bytes": 0})
        counts["messages"] += 1
        batch = data["data"]  # None: the state alone
        counts["bytes"] += len(batch or b"")
        if seq is not None and batch is not None and seq not in got:
            counts["batches"] += 1
            counts["duplicate_records"] += self._write(seg, run_id, worker, seq, batch)
            got.add(seq)
        elif seq is not None and batch is not None:
            counts["duplicate_records"] += feather.read_table(pa.BufferReader(batch)).num_rows
        state = data["state"]
        state_at, segments = None, 0
        if state and got.low >= int(state.get("segments", 0)):
            records.write_json(seg / f"{worker}.state.json", {**state, "worker": worker, "courier": dict(counts)})
            state_at, segments = state.get("updated_at"), int(state.get("segments", 0))
        ack: Ack = {"run_id": run_id, "seq": seq, "state_at": state_at, "segments": segments}
        self.role.to_workers(ACK_MESSAGE, ack, client_id=msg.node_id)

    def _write(self, seg: Path, run_id: str, worker: str, seq: int, data: bytes) -> int:
        """Write a batch's records not among the run's recent ones; returns how many were."""
        table = feather.read_table(pa.BufferReader(data))
        seen = self._ids.setdefault(run_id, RecentIds())
        new = table.filter(pa.array([rid not in seen for rid in table.column("request_id").to_pylist()]))
        if new.num_rows:
            records.write_segment(seg / records.segment_name(worker, seq), new)
            seen.add(new.column("request_id").to_pylist())
        return table.num_rows - new.num_rows


def receive(environment: Environment, run_dir_of: Callable[[str], Path | None]) -> None:
    """Master side: take the workers' batches; `run_dir_of` maps a run id of this session to its run directory."""
    role = roles.of(environment)
    inbox = role.put(INBOX, Inbox(role, run_dir_of))
    role.listen(BATCH_MESSAGE, inbox.on_batch)


@contextlib.contextmanager
def collecting(environment: Environment) -> Iterator[None]:
    """Master side, after Locust quit (its receiver stopped): go on taking the batches of workers still draining.

    A headless master sends its workers `quit` and stops listening half a second later, while they still
    drain their users; their last batches come after that.
    """
    role = roles.of(environment)
    inbox = role.get(INBOX)
    if inbox is None:  # not a master
        yield
        return
    with _listening(role.next_message, {BATCH_MESSAGE: inbox.on_batch}, environment):
        yield
