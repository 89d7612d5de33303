"""The load generator's hot-path HTTP client: geventhttpclient, one pool per process.

To be confirmed by `benchmarks/client_overhead.py` (not written yet): LOCUST-NOTES.md
measured requests at about 48k tokens per client CPU-second and httpx far lower,
both under the 60k target. This client reads with one `recv` per call, so each
SSE event is stamped when its bytes arrive; Locust's FastHttpUser (also
geventhttpclient) iterates in fixed blocks, which holds small events back until
a block fills and inflates TTFT.

One `Transport` (one connection pool, one SSL context) serves every user of a
process, so spawning a user costs nothing here. POST requests are never retried
by geventhttpclient after a send error, and this module adds no retries: every
failure is recorded as what it was.
"""

from __future__ import annotations

import errno
import socket
import time
from http.client import HTTPException
from urllib.parse import urlsplit

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
        try:
            response = self._client.request("POST", self._path, body=request.body, headers=request.headers)
            session.on_headers(_perf(), response.status_code, {k.lower(): v for k, v in response.items()})
            last = _perf()
            while True:
                chunk = _read_available(response)
                now = _perf()
                if not chunk:
                    session.on_end(now)
                    break
                if session.timeline.t_first_token is not None and now - last > self._idle:
                    session.on_failure(now, ek.TIMEOUT_STALL, f"no data for {now - last:.1f} s")
                    break
                session.on_data(now, chunk)
                last = now
        except TimeoutError:
            session.on_failure(_perf(), ek.TIMEOUT_FIRST_TOKEN, "no data within the read timeout")
        except ConnectionRefusedError as exc:
            session.on_failure(_perf(), ek.BAD_BASE_URL, f"cannot connect to {self._base}: {exc.strerror}")
        except socket.gaierror as exc:
            session.on_failure(_perf(), ek.BAD_BASE_URL, f"cannot resolve {self._base}: {exc}")
        except (OSError, HTTPException) as exc:  # resets, broken pipes, truncated or invalid HTTP
            session.on_failure(_perf(), ek.DISCONNECTED, f"{type(exc).__name__}: {exc}")
        finally:
            if response is not None and not response.message_complete:
                _drop(response)


def _read_available(response: HTTPSocketPoolResponse) -> bytes:
    """The body bytes that have arrived, waiting for at least one `recv` if none have.

    geventhttpclient's public `read(n)` loops until n bytes arrive, which batches
    small SSE events; this reads exactly once per call. It uses the response's
    parser buffer (`_body_buffer`, `_sock`, `feed`), stable since geventhttpclient 1.x.
    """
    buf = response._body_buffer
    while not buf:
        if response.message_complete:
            return b""
        sock = response._sock
        if sock is None:
            return b""
        data = sock.recv(_BLOCK)
        response.feed(data)  # raises HTTPParseError on invalid chunk framing
        if not data:
            if not response.message_complete:
                raise ConnectionResetError(errno.ECONNRESET, "connection closed before the end of the body")
            return b""
    chunk = bytes(buf)
    del buf[:]
    return chunk


def _drop(response: HTTPSocketPoolResponse) -> None:
    """Close a connection whose response was not read to the end: it cannot be reused."""
    sock, pool = response._sock, response._pool
    response._sock = response._pool = None
    if sock is not None and pool is not None:
        pool.release_socket(sock)
