"""Drive one streaming exchange with any HTTP client: headers, bytes, end, failure.

The HTTP client (httpx for probe and doctor, the Locust user's client under load)
reads the response and reports what it sees, with `time.perf_counter()` stamps;
the session routes bytes through the shared SSE decoder into the protocol
adapter, or, when no stream opened, keeps the body to classify the error. The
client never interprets the wire format and the adapter never touches sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tokenload import errors as ek
from tokenload.deltas import DeltaShapes
from tokenload.failures import classify_http, looks_like_html
from tokenload.measure import Timeline, measure
from tokenload.protocols.base import ProtocolAdapter
from tokenload.record import RequestRecord
from tokenload.sse import SSEDecoder

_MAX_ERROR_BODY = 64 * 1024
# Response headers that name the exchange on the server's side, first found wins: the vendors' request ids,
# then relays' own call ids (a relay with no request id of its own). Without any, the stream's own id
# (`msg_...`, `chatcmpl-...`, `resp_...`, read by the adapter) names it.
REQUEST_ID_HEADERS = ("request-id", "x-request-id", "x-litellm-call-id")


class StreamSession:
    """One request/response, from the moment it is handed to the client to the end (t0: when it was out)."""

    __slots__ = ("_aligned", "_body", "_content_type", "_decoder", "_estimate", "_max_tokens", "_shapes", "_streaming",
                 "adapter", "timeline")

    def __init__(
        self,
        adapter: ProtocolAdapter,
        t0: float,
        *,
        estimated_input_tokens: int | None = None,
        max_tokens: int | None = None,
        on_text: Callable[[str, str], None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.timeline = Timeline(t0=t0, on_text=on_text)
        self._decoder = SSEDecoder()
        # Deltas counted by shape (tokenload.deltas) only without a display callback, which wants the text.
        self._shapes = DeltaShapes(adapter.delta_keys, adapter.ignored_numbers) if on_text is None else None
        self._streaming = False
        self._aligned = False
        self._body = bytearray()
        self._content_type = ""
        self._estimate = estimated_input_tokens
        self._max_tokens = max_tokens  # as asked: a length stop below it is a truncation

    def on_headers(self, t: float, status: int, headers: Mapping[str, str]) -> None:
        tl = self.timeline
        tl.t_headers = t
        tl.http_status = status
        headers = {k.lower(): v for k, v in headers.items()}  # clients differ in header-name case
        tl.response_headers = headers
        self._content_type = headers.get("content-type", "")
        tl.request_id = next((headers[name] for name in REQUEST_ID_HEADERS if headers.get(name)), None)
        self._streaming = status == 200 and not looks_like_html(self._content_type, b"") and (
            "json" not in self._content_type.lower()
        )

    def on_data(self, t: float, chunk: bytes) -> None:
        if self._aligned and chunk[-2:] == b"\n\n" and b"\r" not in chunk:
            # Whole events without CR, after the first: each is a block between blank lines, in arrival order.
            shapes = self._shapes
            assert shapes is not None
            tl = self.timeline
            for block in chunk.split(b"\n\n")[:-1]:
                kind = shapes.match(block)
                if kind is not None:
                    tl.token(t, kind)
                else:
                    before = shapes.before(tl)
                    self._events(block + b"\n\n", t)
                    shapes.learn(block, before, tl)
            return
        tl = self.timeline
        if tl.t_first_byte is None:
            tl.t_first_byte = t
            if self._streaming and looks_like_html("", chunk):
                self._streaming = False  # an HTML page served as text/plain or event-stream
        if not self._streaming or tl.t_first_event is None:
            # Kept until a stream proves itself: a 200 "event stream" may be a bare JSON error.
            if len(self._body) < _MAX_ERROR_BODY:
                self._body += chunk
            if not self._streaming:
                return
        self._events(chunk, t)
        # The block path needs a proven stream, shapes (no display callback) and the decoder between events.
        self._aligned = self._shapes is not None and tl.t_first_event is not None and self._decoder.idle

    def _events(self, chunk: bytes, t: float) -> None:
        """The full path: SSE decoder, then the adapter for each event completed."""
        tl = self.timeline
        for event in self._decoder.feed(chunk):
            if tl.t_first_event is None:
                tl.t_first_event = t
            self.adapter.handle(event, t, tl)

    def on_end(self, t: float) -> None:
        """The body ended (the server closed it or sent its last chunk)."""
        tl = self.timeline
        tl.t_end = t
        if self._streaming:
            self._decoder.close()
            if tl.t_first_event is None and self._body.lstrip()[:1] == b"{":
                kind, message = classify_http(tl.http_status or 0, "application/json", bytes(self._body))
                if kind != ek.MALFORMED_STREAM:  # a JSON error instead of events
                    tl.fail(kind, message)
            self.adapter.finish(tl)
        else:
            tl.fail(*classify_http(tl.http_status or 0, self._content_type, bytes(self._body)))

    def on_failure(self, t: float, kind: str, message: str) -> None:
        """The transport failed: a timeout, a reset, a refused connection."""
        tl = self.timeline
        tl.t_end = t
        if kind == ek.TIMEOUT_FIRST_TOKEN and tl.t_first_token is not None:
            kind = ek.TIMEOUT_STALL
        tl.fail(kind, message)

    def record(self) -> RequestRecord:
        """The record's per-request fields for this exchange (error messages redacted: servers echo keys)."""
        record = measure(self.timeline, self._estimate, self._max_tokens)
        if record["error_message"]:
            record["error_message"] = self.adapter.channel.redact(record["error_message"])
        return record
