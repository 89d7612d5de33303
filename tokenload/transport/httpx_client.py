"""Single streaming requests over httpx, for `probe` and `doctor`.

Under load the Locust user drives `StreamSession` with its own client; here
clarity and excellent errors matter more than CPU per token, so httpx it is.
"""

from __future__ import annotations

import _socket
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from tokenload import errors as ek
from tokenload.channel import Channel
from tokenload.failures import classify_exception
from tokenload.measure import Timeline
from tokenload.protocols import ProtocolAdapter, adapter_for
from tokenload.protocols.base import Conversation
from tokenload.record import RequestRecord
from tokenload.stream import StreamSession
from tokenload.tokens import estimate_tokens


def timeouts(channel: Channel) -> httpx.Timeout:
    """httpx's per-read timeout: only a safety net behind `_Deadline`, which enforces the real ones."""
    return httpx.Timeout(
        connect=channel.connect_timeout_s,
        read=max(channel.first_token_timeout_s, channel.idle_timeout_s) + 1.0,
        write=channel.connect_timeout_s,
        pool=channel.connect_timeout_s,
    )


class _Deadline:
    """The two stream deadlines httpx cannot express with its one per-read timeout.

    Until the first token: `t0 + first_token_timeout_s` (headers, a preamble and
    pings do not reset it). After it: `idle_timeout_s` past the last token (an
    `event: ping` or `: comment` keepalive is not a token and does not reset it). A
    helper thread shuts the socket down when the deadline passes, which ends the
    blocked read at once; `fired` then tells the reader it was a timeout. The
    socket comes from httpcore's `trace` extension (connect / TLS), or from the
    response's `network_stream` on a reused connection.
    """

    def __init__(self, deadline: float, on_send: Callable[[float, float], None] | None = None) -> None:
        self.deadline = deadline
        self.fired = False
        self.on_send = on_send
        self.connect_started: float | None = None
        self.connect_s = 0.0
        self._stream: Any = None
        self._done = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="tokenload-deadline", daemon=True)
        self._thread.start()

    def trace(self, name: str, info: Mapping[str, Any]) -> None:
        """httpcore trace hook: remember the newest network stream, time the connection, stamp t0.

        t0 is taken when the request body has been written (its last byte handed
        to the kernel), so TTFT excludes the client's own wait; connection setup
        (TCP + TLS, until the headers start going out) is `connect_s` (0 on a
        reused connection, where no connect events fire).
        """
        now = time.perf_counter()
        if name.endswith(("connect_tcp.complete", "start_tls.complete")) and info.get("return_value") is not None:
            self.attach(info["return_value"])
        if name.endswith("connect_tcp.started"):
            self.connect_started = now
        elif name.endswith("send_request_headers.started"):
            self.connect_s = 0.0 if self.connect_started is None else now - self.connect_started
        elif name.endswith("send_request_body.complete") and self.on_send is not None:
            self.on_send(now, self.connect_s)

    def attach(self, stream: Any) -> None:
        with self._cond:
            self._stream = stream

    def move(self, deadline: float) -> None:
        with self._cond:
            self.deadline = deadline
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()
        self._thread.join(1.0)

    def _watch(self) -> None:
        with self._cond:
            while not self._done:
                left = self.deadline - time.perf_counter()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self.fired = True
                self._abort()
                return

    def _abort(self) -> None:
        try:
            sock = self._stream.get_extra_info("socket") if self._stream is not None else None
            if sock is not None:
                # The plain socket call, also for an SSLSocket: the SSL layer then reads a clean EOF.
                _socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except (OSError, AttributeError, ValueError):
            pass  # already closed: the read is over anyway


def stream_once(
    channel: Channel,
    prompt: str | Conversation,
    max_tokens: int,
    *,
    extra_body: Mapping[str, Any] | None = None,
    on_text: Callable[[str, str], None] | None = None,
    client: httpx.Client | None = None,
    answered: bool = False,
) -> RequestRecord:
    """Send one streaming request and return its record (never raises for HTTP trouble).

    `answered`: the channel answered before, so a refused connection means it went down (`stream_exchange`)."""
    return stream_exchange(channel, prompt, max_tokens, extra_body=extra_body, on_text=on_text, client=client,
                           answered=answered)[0]


def stream_exchange(
    channel: Channel,
    prompt: str | Conversation,
    max_tokens: int,
    *,
    extra_body: Mapping[str, Any] | None = None,
    on_text: Callable[[str, str], None] | None = None,
    client: httpx.Client | None = None,
    adapter: ProtocolAdapter | None = None,
    answered: bool = False,
) -> tuple[RequestRecord, Timeline]:
    """`stream_once`, plus the raw timeline: `doctor` reads its chunk arrival times to spot buffering proxies.

    `adapter`: the channel's protocol adapter, for a caller that watches the events (doctor reads the model
    the response names). `answered`: the channel answered before (the error-storm breaker's probe), so a
    refused connection means it went down (`tokenload.failures.classify_exception`)."""
    adapter = adapter or adapter_for(channel)
    request = adapter.prepare(prompt, max_tokens, extra_body)
    own = client is None
    http = client or httpx.Client(timeout=timeouts(channel), follow_redirects=False)
    t0 = time.perf_counter()
    estimate = estimate_tokens(prompt) if isinstance(prompt, str) else prompt.estimated_tokens()
    session = StreamSession(adapter, t0, estimated_input_tokens=estimate, max_tokens=max_tokens, on_text=on_text)
    tl = session.timeline

    def sending(sent: float, connect_s: float) -> None:
        tl.sent(sent, t0, connect_s)
        deadline.move(sent + channel.first_token_timeout_s)

    deadline = _Deadline(tl.t0 + channel.connect_timeout_s + channel.first_token_timeout_s, sending)

    def timed_out(now: float) -> None:
        if tl.t_first_token is None:
            session.on_failure(now, ek.TIMEOUT_FIRST_TOKEN, f"no token within {channel.first_token_timeout_s:g} s")
        else:
            session.on_failure(now, ek.TIMEOUT_STALL, f"no token for {channel.idle_timeout_s:g} s after a token")

    try:
        with http.stream(
            "POST",
            request.url,
            headers=request.headers,
            content=request.body,
            timeout=timeouts(channel),
            extensions={"trace": deadline.trace},
        ) as response:
            session.on_headers(time.perf_counter(), response.status_code, response.headers)
            if response.extensions.get("network_stream") is not None:
                deadline.attach(response.extensions["network_stream"])
            # iter_bytes, not iter_raw: relays may gzip the event stream.
            last_token: float | None = None
            for chunk in response.iter_bytes():
                now = time.perf_counter()
                if deadline.fired:
                    break
                session.on_data(now, chunk)
                if tl.t_last_token != last_token:  # the stall deadline counts from tokens, not pings
                    last_token = tl.t_last_token
                    deadline.move(now + channel.idle_timeout_s)
            if deadline.fired:
                timed_out(time.perf_counter())
            else:
                session.on_end(time.perf_counter())
    except httpx.HTTPError as exc:
        now = time.perf_counter()
        if deadline.fired:
            timed_out(now)
        else:
            session.on_failure(now, *classify_exception(exc, channel.base_url, timeout_s=_timeout_of(exc, channel),
                                                        answered=answered))
    finally:
        deadline.stop()
        if own:
            http.close()
    record = session.record()
    record.update({"protocol": channel.protocol, "model": channel.model, "max_tokens": max_tokens})
    return record, session.timeline


def _timeout_of(exc: httpx.HTTPError, channel: Channel) -> float | None:
    """The timeout that expired, for the message: connect or read."""
    if isinstance(exc, httpx.ConnectTimeout):
        return channel.connect_timeout_s
    if isinstance(exc, httpx.TimeoutException):
        return timeouts(channel).read
    return None
