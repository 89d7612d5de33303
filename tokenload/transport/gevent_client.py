"""The load generator's hot-path HTTP client: geventhttpclient, one pool per process.

Chosen by measurement against Locust's own `requests` path and httpx
(`benchmarks/client_overhead.py`; docs/benchmarks.md, "Load-generator client"):
it costs the least CPU per token and adds the least to TTFT.

Reads: plain-HTTP bodies are read inside the event loop by
`tokenload.transport.reader.HubReader` (kernel-stamped reads, the user's greenlet
woken once per request), the first response bytes by `_first_read` with the same
stamp; streams with a display callback, HTTPS and compressed bodies read in their
greenlet, one read per call. First-token and stall timeouts are one libev timer
per stream (`_Deadline`), not a gevent `Timeout` per read.

Sends: one `Transport` (one pool, one SSL context) serves every user of a process.
It writes the request itself on a pooled socket, so t0 is the kernel's stamp of
the request's last byte leaving (plain HTTP, Linux 6.12+; else when the write
returned), and everything before it (a connection from the pool or a new one, the
event loop's turn, a write the server's receive window held back) is the client's
own wait, `send_lag_s`, never the server's TTFT.

Keep-alive: a request written on a socket the server already closed (llama.cpp
closes after each streamed answer though it advertises keep-alive) is written once
more on a fresh connection and counted (`reconnects`); nothing else is retried. A
refused connection once the transport had one is `connection_refused` (the channel
went down, not a wrong address). `Connection: close` keeps a socket out of the
pool; the request asks for `identity` and a compressed answer is decoded anyway.
"""

from __future__ import annotations

import errno
import time
import weakref
import zlib
from collections.abc import Callable, Mapping
from functools import partial
from http.client import HTTPException
from typing import Any
from urllib.parse import urlsplit

from gevent import get_hub
from geventhttpclient.connectionpool import ConnectionPool, SSLConnectionPool
from geventhttpclient.response import HTTPConnectionClosed, HTTPSocketPoolResponse

from tokenload import errors as ek
from tokenload.channel import Channel
from tokenload.failures import classify_exception
from tokenload.protocols.base import PreparedRequest
from tokenload.stream import StreamSession
from tokenload.transport.reader import READ_SIZE, SEND_CMSG, HubReader, recv_stamped, sent_stamps, stamp_arrivals

_perf = time.perf_counter
# A server that compresses although asked not to: decoded, not failed. wbits 32+15 reads gzip and zlib headers.
_DECODED = frozenset({"gzip", "x-gzip", "deflate"})
# A late request counts the streaming responses (`_InFlight.streaming`) at most this often: each count brings every
# response in flight up to date, and a failing level of a thousand users has hundreds of late requests.
COUNT_EVERY_S = 0.1


class Transport:
    """A shared streaming client for one channel's host (HTTP or HTTPS).

    `count_streams`: keep the responses in flight so that a late request can count the streaming ones (a
    search in a process that sees every stream of its run; a worker sees only its share)."""

    def __init__(self, channel: Channel, concurrency: int = 10_000, count_streams: bool = False) -> None:
        parts = urlsplit(channel.url)
        self._path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._host = parts.netloc.rpartition("@")[2]
        self._idle = channel.idle_timeout_s
        self._first = channel.first_token_timeout_s
        self._connect_timeout = channel.connect_timeout_s
        self._plain = parts.scheme != "https"
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (80 if self._plain else 443)
        pool = ConnectionPool if self._plain else SSLConnectionPool
        self._pool = pool(
            host, port, host, port, size=concurrency, connection_timeout=channel.connect_timeout_s,
            # Only a safety net: `_Deadline` enforces the first-token and stall timeouts.
            network_timeout=max(channel.first_token_timeout_s, channel.idle_timeout_s) + 1.0,
        )
        self._base = f"{parts.scheme}://{parts.netloc}"
        # Sockets that carried a request before: the bytes written on each since its sends were stamped (None: not).
        self._sent: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()
        self._heads: dict[int, tuple[Mapping[str, str], str]] = {}
        self._open = _InFlight() if count_streams else None
        self._answered = False  # a connection to the channel was opened: a refusal now means it went down

    def close(self) -> None:
        self._pool.close()

    def stream(self, request: PreparedRequest, session: StreamSession) -> None:
        """Send `request` and feed the response into `session` until it ends or fails.

        Never raises for network or HTTP trouble: the session records it. A
        `GreenletExit` (the user is being stopped) propagates after the socket
        is dropped, so the caller can record the stream as in flight. The
        response headers stay on `session.timeline.response_headers`.
        """
        response: HTTPSocketPoolResponse | None = None
        arrived: float | None = None
        guard: _Deadline | None = None
        late: _Late | None = None
        timeline = session.timeline
        intended = timeline.t0  # when the user handed the request over; t0 moves to when it was out
        connecting = True
        try:
            data = self._head(request).encode("latin-1") + request.body
            for attempt in (0, 1):
                connecting = True
                started = _perf()
                sock = self._pool.get_socket() if attempt == 0 else _fresh_socket(self._pool)
                connecting = False
                self._answered = True
                reused = sock in self._sent
                if not reused:
                    self._sent[sock] = 0 if self._plain and stamp_arrivals(sock._sock) else None
                ready = _perf()
                timeline.reconnects = attempt
                # The first-token deadline counts from here: a write the server never takes times out too.
                guard = _Deadline(ready, self._first, self._idle, timeline, partial(_cancel_socket_wait, sock),
                                  self._open)
                if timeline.on_late is not None:  # one deadline per request; it syncs the current attempt's reader
                    if late is None:
                        late = _Late(timeline, guard)
                    late.deadline = guard
                sent = self._send(sock, data, retry=reused and attempt == 0,
                                  on_sent=partial(timeline.sent, intended=intended,
                                                  connect_s=0.0 if reused else ready - started))
                if sent is not None:
                    response, arrived, rest = sent
                    break
                guard.close()  # the reused socket was dead: once more, on a fresh one
            assert response is not None and guard is not None
            session.on_headers(_perf() if arrived is None else arrived, response.status_code, dict(response.items()))
            encoding = str(response.get("content-encoding") or "identity").strip().lower()
            if encoding not in _DECODED and encoding != "identity":
                session.on_failure(_perf(), ek.MALFORMED_STREAM,
                                   f"the server compressed the body as {encoding!r} although asked for identity")
                return
            decoder = zlib.decompressobj(zlib.MAX_WBITS | 32) if encoding in _DECODED else None
            if self._plain and timeline.on_text is None and decoder is None and response._sock is not None:
                reader = HubReader(response, session, arrived, rest)
                guard.cancel, guard.sync = reader.cancel, reader.flush
                reader.run()
                return
            if rest:
                response.feed(rest)
            stamp = _perf() if arrived is None else arrived
            while True:
                chunk, stamp = _read_available(response, self._plain, stamp)
                if decoder is not None:
                    chunk = decoder.decompress(chunk) if chunk else decoder.flush()
                if not chunk:
                    session.on_end(stamp)
                    break
                session.on_data(stamp, chunk)
        except _Expired as exc:
            session.on_failure(_perf(), exc.kind, exc.message)
        except (OSError, HTTPException, zlib.error) as exc:  # refused, DNS, resets, TLS, invalid HTTP or gzip
            timeout = self._connect_timeout if connecting else None
            session.on_failure(_perf(), *classify_exception(exc, self._base, connecting=connecting, timeout_s=timeout,
                                                            answered=self._answered))
        finally:
            if guard is not None:
                guard.close()
            if late is not None:
                late.close()
            if response is not None and not response.message_complete:
                _drop(response)

    def _head(self, request: PreparedRequest) -> str:
        """The request line and headers (cached per adapter's header mapping); the body goes right after."""
        headers = request.headers
        cached = self._heads.get(id(headers))
        if cached is None or cached[0] is not headers:
            lines = [f"POST {self._path} HTTP/1.1", f"Host: {self._host}"]
            lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("content-length", "host")]
            if not any(k.lower() == "accept-encoding" for k in headers):
                lines.append("Accept-Encoding: identity")
            cached = (headers, "\r\n".join(lines) + "\r\nContent-Length: ")
            self._heads[id(headers)] = cached
        return f"{cached[1]}{len(request.body)}\r\n\r\n"

    def _send(self, sock: Any, data: bytes, *, retry: bool,
              on_sent: Callable[..., None]) -> tuple[HTTPSocketPoolResponse, float | None, bytes | None] | None:
        """Write the request (`on_sent(t0, stamped=...)`, `_write`) and read the response
        headers; None when a reused socket died unheard.

        Also returns when the bytes that completed the headers arrived (plain HTTP,
        headers in the first read), which is when any body bytes read with them did,
        and those body bytes, not given to the response's parser (None when the
        headers took more than one read: the parser has the body's start then).
        With `retry`, a failure before any response byte (the write failed, or the
        server closed without a byte) returns None so the caller can resend once.
        """
        try:
            awaited = self._write(sock, data, on_sent)
            first, arrived = _first_read(sock, awaited, on_sent) if self._plain else (b"", None)
        except BaseException as exc:
            self._pool.release_socket(sock)
            if retry and isinstance(exc, OSError | HTTPConnectionClosed) and not isinstance(exc, TimeoutError):
                return None
            raise
        # Status digit 1: an interim response; the final headers (and body bytes) came in a later read.
        end = first.find(b"\r\n\r\n") + 4
        in_first = end >= 4 and first[9:10] != b"1"
        head, rest = (first[:end], first[end:]) if in_first else (first, None)
        try:  # the response releases the socket itself when it fails
            response = HTTPSocketPoolResponse(sock, self._pool, block_size=READ_SIZE, method="POST", pre_buffered=head)
        except HTTPConnectionClosed:  # closed before the first byte of the status line
            if retry:
                return None
            raise
        return response, arrived if in_first else None, rest


    def _write(self, sock: Any, data: bytes, on_sent: Callable[..., None]) -> int | None:
        """Write the request and call `on_sent(t0, stamped=...)`: the kernel's stamp of its last byte leaving (True)
        where sends are stamped, else the moment the write returned (False: a pause of this process right after
        the write would be in it).

        Returns the last byte's number when its stamp has not come yet (a shut window holds it back:
        `_first_read` waits for it), else None.
        """
        written = self._sent.get(sock)
        if written is None:
            sock.sendall(data)
            on_sent(_perf(), stamped=False)
            return None
        raw = sock._sock
        view = memoryview(data)
        while view:
            try:
                sent = raw.sendmsg((view,), SEND_CMSG)
            except BlockingIOError:
                sent_stamps(raw)  # a stamp of the part written so far wakes the wait until it is read
                get_hub().wait(sock._write_event)
                continue
            view = view[sent:]
            written += sent
        returned = _perf()
        self._sent[sock] = written
        last = (written - 1) & 0xFFFFFFFF  # the kernel numbers bytes in 32 bits
        stamp = sent_stamps(raw).get(last)
        on_sent(returned if stamp is None else stamp, stamped=stamp is not None)
        return last if stamp is None else None


class _Expired(Exception):
    """Thrown into a reading greenlet by its `_Deadline`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class _LoopTimer:
    """One libev timer that re-arms itself until `_fire` is done with it (one per stream: no per-read cost)."""

    __slots__ = ("hub", "timer")

    def __init__(self) -> None:
        self.hub = get_hub()
        self.timer: Any = None

    def _arm(self, delay: float) -> None:
        if self.timer is not None:
            self.timer.close()
        self.timer = self.hub.loop.timer(max(delay, 0.001))
        self.timer.start(self._fire)

    def _fire(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.timer is not None:
            self.timer.close()
            self.timer = None


class _Deadline(_LoopTimer):
    """First-token and stall timeouts for one response, at no cost per read.

    A socket timeout would allocate and start a gevent `Timeout` on every read;
    here one libev timer per stream fires at the earliest possible deadline
    (t0 + first-token timeout, covering the wait for headers too; then the last
    token + idle timeout: keepalive pings and comments are bytes, not tokens),
    re-arms itself if a token came meanwhile, and otherwise ends the stream's
    wait with `_Expired` through `cancel` (False: the reader is busy with data).
    `sync`, when set, brings the timeline up to date first (the compiled reader's tokens). Each is in
    `responses` (its transport's responses in flight, when it counts them) until closed.
    """

    __slots__ = ("cancel", "first", "idle", "responses", "sync", "t0", "timeline")

    def __init__(self, t0: float, first: float, idle: float, timeline: Any,
                 cancel: Callable[[BaseException], bool], responses: _InFlight | None) -> None:
        super().__init__()
        self.t0, self.first, self.idle, self.timeline, self.cancel = t0, first, idle, timeline, cancel
        self.sync: Callable[[], None] | None = None
        self.responses = responses
        if responses is not None:
            responses.deadlines.add(self)
        self._arm(min(first, idle))

    def close(self) -> None:
        super().close()
        if self.responses is not None:
            self.responses.deadlines.discard(self)

    def streaming(self) -> bool:
        """Its response has its first token and has neither ended nor failed yet."""
        if self.sync is not None:
            self.sync()
        tl = self.timeline
        return tl.t_first_token is not None and tl.t_end is None and tl.error_kind is None

    def _fire(self) -> None:
        if self.sync is not None:
            self.sync()
        now = _perf()
        last = self.timeline.t_last_token
        if last is None:
            due, kind, message = self.t0 + self.first, ek.TIMEOUT_FIRST_TOKEN, f"no token within {self.first:g} s"
        else:
            due, kind, message = last + self.idle, ek.TIMEOUT_STALL, f"no token for {now - last:.1f} s"
        if due > now or not self.cancel(_Expired(kind, message)):  # not due yet, or busy with data
            self._arm(min(max(due - now, 0.01), self.idle))


class _InFlight:
    """A transport's responses in flight (their deadlines), which a late request counts (`_Late`)."""

    __slots__ = ("counted_at", "deadlines")

    def __init__(self) -> None:
        self.deadlines: set[_Deadline] = set()
        self.counted_at = float("-inf")

    def streaming(self) -> int | None:
        """How many have their first token and have not ended; None when the last count is under
        `COUNT_EVERY_S` old."""
        now = _perf()
        if now - self.counted_at < COUNT_EVERY_S:
            return None
        self.counted_at = now
        return sum(1 for d in list(self.deadlines) if d.streaming())


class _Late(_LoopTimer):
    """Calls `timeline.on_late(streaming)` once the request is `timeline.late_s` past t0 without a first token
    (`streaming`: how many of the transport's responses were streaming meanwhile, or None: not counted, see
    `_InFlight`), or
    `timeline.on_time()` (when set) once its first token came in time and it has neither failed nor ended.

    Armed before the request is written (t0 moves to when it was out: `Timeline.sent`), it re-arms
    until then and for what is left of the deadline; the compiled reader's tokens are brought up to date
    first (`deadline.sync`), so a token that came in time is never taken for a late one.
    """

    __slots__ = ("deadline", "timeline")

    def __init__(self, timeline: Any, deadline: _Deadline) -> None:
        super().__init__()
        self.timeline, self.deadline = timeline, deadline
        self._arm(timeline.late_s)

    def _fire(self) -> None:
        if self.deadline.sync is not None:
            self.deadline.sync()
        tl = self.timeline
        if tl.error_kind is not None or tl.t_end is not None:
            self.close()
            return
        if tl.t_first_token is not None:
            self.close()
            if tl.on_time is not None and tl.t_first_token - tl.t0 <= tl.late_s:
                tl.on_time()
            return
        left = tl.t0 + tl.late_s - _perf()
        if tl.send_lag_s is None or left >= 0:  # not written yet, or not late yet
            self._arm(tl.late_s if tl.send_lag_s is None else left + 0.001)
            return
        self.close()
        responses = self.deadline.responses
        tl.on_late(None if responses is None else responses.streaming())



def _first_read(sock: Any, awaited: int | None = None,
                on_sent: Callable[..., None] | None = None) -> tuple[bytes, float]:
    """The response's first bytes on a plain socket and when they arrived (kernel stamp).

    Read here rather than by the response's header parser so that body bytes that
    came with the headers (a server that sends both at once) keep their arrival time.
    `awaited`: the request's last byte, whose send stamp had not come when the write
    returned: `on_sent` gets it once it comes, by the time the response does.
    """
    on_stamp = None if awaited is None or on_sent is None else (awaited, on_sent)
    try:
        data, arrived = _recv_plain(sock, on_stamp)
    except ConnectionResetError as exc:
        raise HTTPConnectionClosed("connection closed.") from exc
    if not data:
        raise HTTPConnectionClosed("connection closed.")
    return data, arrived


def _cancel_socket_wait(sock: Any, exc: BaseException) -> bool:
    """Throw `exc` into the greenlet waiting on `sock`; False when none waits (it is busy with data).

    A greenlet waits on the read watcher (headers, body) or, for a large body, the write watcher.
    """
    watcher = sock._read_event
    if watcher.callback is None:
        watcher = sock._write_event
    if watcher.callback is None:
        return False
    get_hub().cancel_wait(watcher, exc)
    return True


def _read_available(response: HTTPSocketPoolResponse, plain: bool, stamp: float) -> tuple[bytes, float]:
    """The body bytes that have arrived, waiting for at least one `recv` if none have, and when: on plain
    HTTP the kernel's arrival stamp of the read that brought them (`stamp` for bytes already buffered),
    on HTTPS the moment they were read.

    geventhttpclient's public `read(n)` loops until n bytes arrive, which batches
    small SSE events; this reads exactly once per call. It uses the response's
    parser buffer (`_body_buffer`, `_sock`, `feed`), stable since geventhttpclient 1.x.
    """
    buf = response._body_buffer
    while not buf:
        if response.message_complete:
            return b"", stamp
        sock = response._sock
        if sock is None:
            return b"", stamp
        # HTTPS reads go through gevent's SSL socket and its own per-read timeout.
        data, stamp = _recv_plain(sock) if plain else (sock.recv(READ_SIZE), _perf())
        response.feed(data)  # raises HTTPParseError on invalid chunk framing
        if not data:
            if not response.message_complete:
                raise ConnectionResetError(errno.ECONNRESET, "connection closed before the end of the body")
            return b"", stamp
    chunk = bytes(buf)
    del buf[:]
    return chunk, stamp


def _recv_plain(sock: Any, on_stamp: tuple[int, Callable[..., None]] | None = None) -> tuple[bytes, float]:
    """One stamped read on the real non-blocking socket (`_sock`, `recv_stamped`), waiting on its
    read watcher (`_read_event`) when nothing is there yet: no per-read gevent `Timeout`.

    A wake-up with nothing to read may be a send stamp (`sent_stamps`): read off, and
    handed to `on_stamp`'s callback when it is the byte that one waits for."""
    raw = sock._sock
    while True:
        try:
            read = recv_stamped(raw)
        except BlockingIOError:
            stamps = sent_stamps(raw)
            if on_stamp is not None and on_stamp[0] in stamps:
                on_stamp[1](stamps[on_stamp[0]], stamped=True)
                on_stamp = None
            get_hub().wait(sock._read_event)
            continue
        if on_stamp is not None:  # the response came first: the stamp is there now, or will never be
            stamp = sent_stamps(raw).get(on_stamp[0])
            if stamp is not None:
                on_stamp[1](stamp, stamped=True)
        return read


def _fresh_socket(pool: ConnectionPool) -> Any:
    """A new connection, past the pool's idle ones: after one died unheard, the others
    (returned by the same server) are likely dead too. Same accounting as `get_socket`."""
    pool._semaphore.acquire()
    try:
        return pool._create_socket()
    except BaseException:
        pool._semaphore.release()
        raise


def _drop(response: HTTPSocketPoolResponse) -> None:
    """Close a connection whose response was not read to the end: it cannot be reused."""
    sock, pool = response._sock, response._pool
    response._sock = response._pool = None
    if sock is not None and pool is not None:
        pool.release_socket(sock)
