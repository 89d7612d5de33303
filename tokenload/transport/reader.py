"""A plain-HTTP streamed body read inside the event loop, each read stamped by the kernel.

Reading a body in its user's greenlet costs two greenlet switches per token (into
the greenlet when the socket is readable, back to the hub to wait again). Here the
socket's read watcher calls `HubReader._read` in the hub itself: libev hands over
every socket that one `epoll_wait` found ready, one after the other, and the
user's greenlet is switched to once, when its stream has ended or failed.

Each read is stamped with the kernel's receive time, not the time Python got to
it: the socket has `SO_TIMESTAMPNS` on, so every `recvmsg` returns when the newest
byte it read arrived (realtime clock, converted to `perf_counter` per read). That
keeps TTFT and the per-token gaps right when the process is saturated and reads
late; what lateness remains is only that tokens which arrived between two reads
of one socket share the later one's stamp. A read without a plausible kernel
stamp (a platform without it, a clock step) is stamped when it was read.

Only the bytes-to-session path runs in the hub, and nothing in it yields: streams
with a display callback (user code), HTTPS and compressed bodies keep their
greenlet's own read loop (`tokenload.transport.gevent_client`).

A chunked body (what streaming servers send) is read by the compiled core,
`tokenload.transport._chunked.ChunkedBody`, where it was built (`pip install` builds
it on Linux when a C compiler is there, and goes on without it otherwise): the
same read, stamp, de-chunking and shape count, with no Python code run per
token. Anything it does not count itself goes to `StreamSession.on_data`, so
both paths give the same record. `TOKENLOAD_PURE_PYTHON=1` turns it off.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import sys
import time
from typing import Any

from gevent import get_hub, getcurrent
from gevent.monkey import get_original
from geventhttpclient._parser import HTTPParseError, HTTPResponseParser

from tokenload.stream import StreamSession

_perf = time.perf_counter
_wall = get_original("time", "time")
# The C parser's own feed: `HTTPResponse.feed` only adds a HEAD-response fix-up (never used here: POST).
_feed = HTTPResponseParser.feed
READ_SIZE = 64 * 1024  # bytes asked for per read (the transport's header and HTTPS reads too)
# Python's socket module does not name it; 35 is Linux's value on every common architecture
# (a wrong one is refused by setsockopt or never matches a control message: reads are then stamped on read).
_SO_TIMESTAMPNS: int | None = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform.startswith("linux") else None)
_CMSG = socket.CMSG_SPACE(16) if _SO_TIMESTAMPNS is not None else 0
_TIMESPEC = struct.Struct("qq").unpack
# The kernel's stamp of a request's last byte leaving for the wire (`SO_TIMESTAMPING`, Linux: 37; the software stamp
# at the device, on loopback the moment the peer's kernel stamps its arrival), reported on the socket's error queue
# with the byte's number since the stamps were turned on (OPT_ID). RX_FILTER keeps reads to their one stamp
# (refused before Linux 6.12: no send stamps then). Asked for per write (`SEND_CMSG`), so only request bytes have one.
_SO_TIMESTAMPING: int | None = getattr(socket, "SO_TIMESTAMPING", 37 if sys.platform.startswith("linux") else None)
_SOF_TX_SOFTWARE, _SOF_SOFTWARE, _SOF_OPT_ID, _SOF_OPT_TSONLY, _SOF_OPT_RX_FILTER = 1 << 1, 1 << 4, 1 << 7, 1 << 11, 1 << 17
SEND_CMSG = [(socket.SOL_SOCKET, _SO_TIMESTAMPING or 0, struct.pack("I", _SOF_TX_SOFTWARE))]
_ERRQUEUE_SPACE = 256
_RECVERR = frozenset({(socket.IPPROTO_IP, 11), (socket.IPPROTO_IPV6, 25)})  # IP_RECVERR, IPV6_RECVERR
_EE_DATA = struct.Struct("12xI").unpack_from  # sock_extended_err.ee_data: the stamped byte's number
# A kernel stamp further back than this is taken for a clock step, not a late read.
_PLAUSIBLE_S = 60.0

_chunked: Any = None
if os.environ.get("TOKENLOAD_PURE_PYTHON") != "1":
    try:
        from tokenload.transport import _chunked  # type: ignore[attr-defined, no-redef]
    except ImportError:  # not built here: the pure-Python path reads every body
        pass
    else:
        _chunked.configure(HTTPParseError)


def compiled() -> bool:
    """Whether chunked bodies are read by the compiled core (`_chunked`), not the pure-Python path."""
    return _chunked is not None


def stamp_arrivals(raw: socket.socket) -> bool:
    """Have the kernel stamp what connected `raw` receives from now on (`recv_stamped`) and, where it can, when
    what it sends leaves (`sent_stamps`); once per connection. True when sends are stamped."""
    if _SO_TIMESTAMPNS is not None:
        with contextlib.suppress(OSError):
            raw.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    if _SO_TIMESTAMPING is None:
        return False
    try:
        raw.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPING,
                       _SOF_SOFTWARE | _SOF_OPT_ID | _SOF_OPT_TSONLY | _SOF_OPT_RX_FILTER)
    except OSError:
        return False
    return True


def recv_stamped(raw: socket.socket) -> tuple[bytes, float]:
    """One read of what has arrived on non-blocking `raw`, and when its newest byte arrived (`perf_counter`).

    Raises `BlockingIOError` when nothing has. The kernel's stamp when there is a
    plausible one, else now.
    """
    data, ancillary, _, _ = raw.recvmsg(READ_SIZE, _CMSG)
    now = _perf()
    shift = now - _wall()  # taken before anything is allocated: a collection here would shift the stamp
    if ancillary and ancillary[0][1] == _SO_TIMESTAMPNS:
        seconds, nanos = _TIMESPEC(ancillary[0][2])
        kernel = seconds + nanos * 1e-9 + shift
        if now - _PLAUSIBLE_S < kernel < now:
            return data, kernel
    return data, now


def sent_stamps(raw: socket.socket) -> dict[int, float]:
    """The kernel's send stamps waiting on `raw`'s error queue, taken off it: {byte number: when it left
    (`perf_counter`)}. Read whenever its socket wakes with nothing to read: a waiting stamp wakes it (an error)."""
    out: dict[int, float] = {}
    while True:
        try:
            _, ancillary, _, _ = raw.recvmsg(0, _ERRQUEUE_SPACE, socket.MSG_ERRQUEUE)
        except OSError:  # BlockingIOError: the queue is empty
            return out
        now = _perf()
        shift = now - _wall()
        kernel = byte = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPING:
                seconds, nanos = _TIMESPEC(payload[:16])
                kernel = seconds + nanos * 1e-9 + shift
            elif (level, kind) in _RECVERR:
                byte = _EE_DATA(payload)[0]
        if kernel is not None and byte is not None and now - _PLAUSIBLE_S < kernel <= now:
            out[byte] = kernel


class HubReader:
    """Feeds one response body into its session from the hub; `run` waits for the end in the caller's greenlet."""

    __slots__ = ("body", "buffered_at", "error", "greenlet", "hub", "last", "raw", "response", "session", "waiting",
                 "watcher")

    def __init__(self, response: Any, session: StreamSession, buffered_at: float | None = None,
                 rest: bytes | None = None) -> None:
        """`rest`: the body bytes that came with the headers, not yet given to the response's parser
        (None: the parser has seen everything read so far)."""
        self.response = response
        self.session = session
        self.hub = get_hub()
        self.greenlet = getcurrent()
        self.raw = response._sock._sock
        self.watcher = response._sock._read_event
        self.waiting = False
        self.error: BaseException | None = None
        self.last = session.timeline.t0
        self.buffered_at = buffered_at
        self.body: Any = None
        shapes = session._shapes
        if _chunked is not None and rest is not None and shapes is not None and _is_chunked(response):
            self.body = _chunked.ChunkedBody(self.raw.fileno(), session, shapes._shapes, shapes._blank, self._finish,
                                             self.last)
            self.body.feed(rest, _perf() if buffered_at is None else buffered_at)
        elif rest:
            _feed(response, rest)

    def run(self) -> None:
        """Feed the body until it ends; raises what ended it otherwise (a reset, a parse error, a deadline).

        Bytes the header read already buffered go out first, stamped `buffered_at` (when
        the read that brought them arrived) or now.
        """
        if self.body is not None:
            self._run_compiled(self.body)
            return
        buf = self.response._body_buffer
        buffered_at = _perf() if self.buffered_at is None else self.buffered_at
        if buf:
            chunk = bytes(buf)
            del buf[:]
            self.last = buffered_at
            self.session.on_data(buffered_at, chunk)
        if self.response.message_complete:
            self.session.on_end(buffered_at)
            return
        self._wait(self._read)
        self.session.on_end(self.last)  # the stamp of the read that completed the body

    def _run_compiled(self, body: Any) -> None:
        """`run` with the compiled core reading (`__init__` fed it the bytes that came with the headers)."""
        try:
            if not body.complete:
                try:
                    self._wait(body)
                finally:  # a deadline or a stopped user: the record keeps every token counted
                    body.flush()
        finally:  # the body holds `_finish`: kept, the pair is a cycle only a full collection frees, per request
            self.body = None
        # The body's end, for the connection pool: the response's own parser never saw the body.
        self.response._on_message_complete()
        self.session.on_end(body.last)

    def _wait(self, callback: Any) -> None:
        """Read with `callback` in the hub until the body ends; raises what ended it otherwise."""
        self.waiting = True
        self.watcher.start(callback)
        try:
            self.hub.switch()
        finally:
            self.waiting = False
            self.watcher.stop()
        if self.error is not None:
            raise self.error

    def flush(self) -> None:
        """Bring the timeline up to date: the compiled core puts its tokens there only when Python reads it."""
        if self.body is not None:
            self.body.flush()

    def cancel(self, exc: BaseException) -> bool:
        """End the stream with `exc` (its deadline passed); False when it is not waiting on its socket."""
        if not self.waiting:
            return False
        self._finish(exc)
        return True

    def _read(self) -> None:
        """The socket is readable: one stamped read, parsed into the session (runs in the hub)."""
        try:
            data, t = recv_stamped(self.raw)
        except BlockingIOError:  # a spurious wake-up, or a late send stamp (an error wakes the watcher until read)
            sent_stamps(self.raw)
            return
        except OSError as exc:
            self._finish(exc)
            return
        if t < self.last:
            t = self.last
        self.last = t
        response = self.response
        try:
            _feed(response, data)  # raises HTTPParseError on invalid chunk framing
            buf = response._body_buffer
            if buf:
                chunk = bytes(buf)
                del buf[:]
                self.session.on_data(t, chunk)
            if response.message_complete:
                self._finish(None)
            elif not data:
                self._finish(ConnectionResetError(errno.ECONNRESET, "connection closed before the end of the body"))
        except Exception as exc:  # delivered to the stream's greenlet, never raised in the hub
            self._finish(exc)

    def _finish(self, error: BaseException | None) -> None:
        """Stop reading and wake the greenlet (after the hub's current round of callbacks)."""
        self.watcher.stop()
        self.error = error
        self.hub.loop.run_callback(self._wake)

    def _wake(self) -> None:
        if self.waiting:
            self.waiting = False
            self.greenlet.switch()


def _is_chunked(response: Any) -> bool:
    """The body comes in HTTP chunks (the response's last transfer coding is `chunked`)."""
    coding = response.get("transfer-encoding")
    return isinstance(coding, str) and coding.rpartition(",")[2].strip().lower() == "chunked"
