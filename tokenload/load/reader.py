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
greenlet's own read loop (`tokenload.load.transport`).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
import sys
import time
from typing import Any

from gevent import get_hub, getcurrent
from gevent.monkey import get_original
from geventhttpclient._parser import HTTPResponseParser

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
# A kernel stamp further back than this is taken for a clock step, not a late read.
_PLAUSIBLE_S = 60.0


def stamp_arrivals(raw: socket.socket) -> None:
    """Have the kernel stamp what `raw` receives from now on (`recv_stamped`); once per connection."""
    if _SO_TIMESTAMPNS is not None:
        with contextlib.suppress(OSError):
            raw.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)


def recv_stamped(raw: socket.socket) -> tuple[bytes, float]:
    """One read of what has arrived on non-blocking `raw`, and when its newest byte arrived (`perf_counter`).

    Raises `BlockingIOError` when nothing has. The kernel's stamp when there is a
    plausible one, else now.
    """
    data, ancillary, _, _ = raw.recvmsg(READ_SIZE, _CMSG)
    now = _perf()
    if ancillary and ancillary[0][1] == _SO_TIMESTAMPNS:
        seconds, nanos = _TIMESPEC(ancillary[0][2])
        kernel = seconds + nanos * 1e-9 + (now - _wall())
        if now - _PLAUSIBLE_S < kernel < now:
            return data, kernel
    return data, now


class HubReader:
    """Feeds one response body into its session from the hub; `run` waits for the end in the caller's greenlet."""

    __slots__ = ("buffered_at", "error", "greenlet", "hub", "last", "raw", "response", "session", "waiting", "watcher")

    def __init__(self, response: Any, session: StreamSession, buffered_at: float | None = None) -> None:
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

    def run(self) -> None:
        """Feed the body until it ends; raises what ended it otherwise (a reset, a parse error, a deadline).

        Bytes the header read already buffered go out first, stamped `buffered_at` (when
        the read that brought them arrived) or now.
        """
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
        self.waiting = True
        self.watcher.start(self._read)
        try:
            self.hub.switch()
        finally:
            self.waiting = False
            self.watcher.stop()
        if self.error is not None:
            raise self.error
        self.session.on_end(self.last)  # the stamp of the read that completed the body

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
        except BlockingIOError:  # a spurious wake-up
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
