"""The load generator's hot-path HTTP client: geventhttpclient, one pool per process.

Chosen by measurement: `python benchmarks/client_overhead.py` (2-core shared dev
machine, simulator in its own process at 50 tokens/s per stream, 200 tokens per
request, each token its own SSE event and socket read; full parsing, `measure()`
record and Locust stats entries per request; client CPU = `process_time()` of the
client process over the measured window; TTFT error = client TTFT minus the
simulator's truth `first_token - arrival`):

              client  streams   tokens  client CPU s  (kernel)  tok/CPU-s  TTFT err p50  TTFT err p99  loop lag p99
            requests       10    2,000          0.15        6%     13,783       1.29 ms       2.08 ms        1.1 ms
    geventhttpclient       10    2,000          0.10        6%     20,064       0.28 ms       0.37 ms        1.1 ms
               httpx       10    2,000          0.16        7%     12,333       0.89 ms       1.26 ms        1.1 ms
            requests      100   20,000          0.70       10%     28,692       1.07 ms       1.69 ms        1.1 ms
    geventhttpclient      100   20,000          0.47        8%     42,893       0.27 ms       0.65 ms        1.1 ms
               httpx      100   20,000          1.32        6%     15,167       2.36 ms       4.20 ms        1.1 ms
            requests      500  100,000          2.59       11%     38,549       1.02 ms       3.11 ms        1.4 ms
    geventhttpclient      500  100,000          1.77       17%     56,382       0.43 ms       1.76 ms        1.1 ms
               httpx      500  100,000         11.06        5%      9,041       2.19 ms      71.41 ms        8.9 ms
    user spawn CPU: LLMUser via Locust's runner 0.045 ms/user (1000 users, shared transport);
    per-user HttpSession 0.055 ms, per-user httpx.Client 21.38 ms

`requests` is Locust's default `HttpUser` path (`HttpSession`, `stream=True`,
`iter_lines`), httpx one shared unlimited `httpx.Client` with `iter_raw`. This
client costs about 1.5x less CPU per token than requests and 6x less than httpx
at 500 streams, and adds the least to TTFT at every level (p50 < 0.5 ms, p99
< 2 ms at 500 streams: inside the 1 ms / 5 ms targets). Tokens per CPU-second
are at 50-56k across runs (the machine is shared; runs vary by about 10%),
just under the 60k target: a process-time profile puts about half of the
per-token CPU in the foundation's SSE decoder + JSON + adapter (`sse.py`,
`protocols/`), the rest in the read path below and the gevent hub. At 10
streams the figure is dominated by the process's fixed idle cost, not tokens.

How it reads: one `recv` per call through the response's parser buffer, so
each SSE event is stamped when its bytes arrive (Locust's FastHttpUser, also
geventhttpclient, iterates in fixed blocks and holds small events back). It
waits on gevent's socket watcher directly instead of through a socket timeout,
which would allocate and start a gevent `Timeout` on every read; first-token
and stall timeouts come from one libev timer per stream (`_Deadline`).

One `Transport` (one connection pool, one SSL context) serves every user of a
process, so spawning a user costs nothing here. POST requests are never retried
by geventhttpclient after a send error, and this module adds no retries: every
failure is recorded as what it was. HTTPS reads go through gevent's SSL socket
and its per-read timeout (the same single read per call; not benchmarked, the
simulator speaks plain HTTP).
"""

from __future__ import annotations

import errno
import socket
import time
from http.client import HTTPException
from typing import Any
from urllib.parse import urlsplit

from gevent import get_hub
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPSocketPoolResponse

from tokenload import errors as ek
from tokenload.channel import Channel
from tokenload.protocols.base import PreparedRequest
from tokenload.stream import StreamSession

_BLOCK = 64 * 1024
_perf = time.perf_counter


class Transport:
    """A shared streaming client for one channel's host (HTTP or HTTPS)."""

    def __init__(self, channel: Channel, concurrency: int = 10_000) -> None:
        parts = urlsplit(channel.url)
        self._path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._idle = channel.idle_timeout_s
        self._first = channel.first_token_timeout_s
        self._plain = parts.scheme != "https"
        self._client = HTTPClient(
            parts.hostname or "127.0.0.1",
            parts.port,
            ssl=parts.scheme == "https",
            concurrency=concurrency,
            connection_timeout=channel.connect_timeout_s,
            # A socket read waits at most this long: it covers the wait for the
            # first token; stalls after it are checked against idle_timeout_s.
            network_timeout=max(channel.first_token_timeout_s, channel.idle_timeout_s),
            block_size=_BLOCK,
        )
        self._base = f"{parts.scheme}://{parts.netloc}"

    def close(self) -> None:
        self._client.close()

    def stream(self, request: PreparedRequest, session: StreamSession) -> None:
        """Send `request` and feed the response into `session` until it ends or fails.

        Never raises for network or HTTP trouble: the session records it. A
        `GreenletExit` (the user is being stopped) propagates after the socket
        is dropped, so the caller can record the stream as in flight.
        """
        response: HTTPSocketPoolResponse | None = None
        guard: _Deadline | None = None
        timeline = session.timeline
        try:
            response = self._client.request("POST", self._path, body=request.body, headers=request.headers)
            session.on_headers(_perf(), response.status_code, {k.lower(): v for k, v in response.items()})
            sock = response._sock
            if sock is not None:
                guard = _Deadline(sock, timeline.t0, self._first, self._idle, timeline)
            read = _read_available if self._plain else _read_available_ssl
            while True:
                chunk = read(response)
                now = _perf()
                if not chunk:
                    session.on_end(now)
                    break
                session.on_data(now, chunk)
                if guard is not None:
                    guard.last = now
        except _Expired as exc:
            session.on_failure(_perf(), exc.kind, exc.message)
        except TimeoutError:
            session.on_failure(_perf(), ek.TIMEOUT_FIRST_TOKEN, "no data within the read timeout")
        except ConnectionRefusedError as exc:
            session.on_failure(_perf(), ek.BAD_BASE_URL, f"cannot connect to {self._base}: {exc.strerror}")
        except socket.gaierror as exc:
            session.on_failure(_perf(), ek.BAD_BASE_URL, f"cannot resolve {self._base}: {exc}")
        except (OSError, HTTPException) as exc:  # resets, broken pipes, truncated or invalid HTTP
            session.on_failure(_perf(), ek.DISCONNECTED, f"{type(exc).__name__}: {exc}")
        finally:
            if guard is not None:
                guard.close()
            if response is not None and not response.message_complete:
                _drop(response)


class _Expired(Exception):
    """Thrown into a reading greenlet by its `_Deadline`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class _Deadline:
    """First-token and stall timeouts for one response, at no cost per read.

    A socket timeout would allocate and start a gevent `Timeout` on every read;
    here one libev timer per stream fires at the earliest possible deadline
    (t0 + first-token timeout, then last data + idle timeout), re-arms itself
    if data came meanwhile, and otherwise cancels the socket wait with `_Expired`.
    """

    __slots__ = ("sock", "t0", "first", "idle", "timeline", "last", "timer", "hub")

    def __init__(self, sock: Any, t0: float, first: float, idle: float, timeline: Any) -> None:
        self.sock, self.t0, self.first, self.idle, self.timeline = sock, t0, first, idle, timeline
        self.last = t0
        self.hub = get_hub()
        self.timer: Any = None
        self._arm(min(first, idle))

    def _arm(self, delay: float) -> None:
        if self.timer is not None:
            self.timer.close()
        self.timer = self.hub.loop.timer(max(delay, 0.001))
        self.timer.start(self._fire)

    def _fire(self) -> None:
        now = _perf()
        if self.timeline.t_first_token is None:
            due, kind, message = self.t0 + self.first, ek.TIMEOUT_FIRST_TOKEN, f"no token within {self.first:g} s"
        else:
            due, kind, message = self.last + self.idle, ek.TIMEOUT_STALL, f"no data for {now - self.last:.1f} s"
        watcher = self.sock._read_event
        if due > now or watcher.callback is None:  # not due yet, or the greenlet is busy with data
            self._arm(min(max(due - now, 0.01), self.idle))
            return
        self.hub.cancel_wait(watcher, _Expired(kind, message))

    def close(self) -> None:
        if self.timer is not None:
            self.timer.close()
            self.timer = None


def _read_available(response: HTTPSocketPoolResponse) -> bytes:
    """The body bytes that have arrived, waiting for at least one `recv` if none have.

    geventhttpclient's public `read(n)` loops until n bytes arrive, which batches
    small SSE events; this reads exactly once per call. It uses the response's
    parser buffer (`_body_buffer`, `_sock`, `feed`), stable since geventhttpclient 1.x,
    and gevent's socket internals (`_sock`, the real non-blocking socket, and
    `_read_event`, its read watcher) to wait without a per-read `Timeout`.
    """
    buf = response._body_buffer
    while not buf:
        if response.message_complete:
            return b""
        sock = response._sock
        if sock is None:
            return b""
        raw = sock._sock
        while True:
            try:
                data = raw.recv(_BLOCK)
                break
            except BlockingIOError:
                _wait(sock._read_event)
        response.feed(data)  # raises HTTPParseError on invalid chunk framing
        if not data:
            if not response.message_complete:
                raise ConnectionResetError(errno.ECONNRESET, "connection closed before the end of the body")
            return b""
    chunk = bytes(buf)
    del buf[:]
    return chunk


def _read_available_ssl(response: HTTPSocketPoolResponse) -> bytes:
    """HTTPS: the same single read through gevent's SSL socket (its own per-read timeout)."""
    buf = response._body_buffer
    while not buf:
        if response.message_complete:
            return b""
        sock = response._sock
        if sock is None:
            return b""
        data = sock.recv(_BLOCK)
        response.feed(data)
        if not data:
            if not response.message_complete:
                raise ConnectionResetError(errno.ECONNRESET, "connection closed before the end of the body")
            return b""
    chunk = bytes(buf)
    del buf[:]
    return chunk


def _wait(watcher: Any) -> None:
    get_hub().wait(watcher)


def _drop(response: HTTPSocketPoolResponse) -> None:
    """Close a connection whose response was not read to the end: it cannot be reused."""
    sock, pool = response._sock, response._pool
    response._sock = response._pool = None
    if sock is not None and pool is not None:
        pool.release_socket(sock)
