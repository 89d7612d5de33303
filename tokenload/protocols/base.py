"""What every protocol adapter does: build a request, read events, classify errors.

An adapter knows one wire format and nothing about HTTP clients or load: it
turns (prompt or `Conversation`, max tokens) into a `PreparedRequest`, and each decoded SSE event
into updates of a `Timeline` (tokens, usage, stop reason, errors). Any HTTP
client can drive it through `tokenload.stream.StreamSession`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenload import errors as ek
from tokenload.channel import Channel
from tokenload.failures import classify_stream_error
from tokenload.measure import Timeline
from tokenload.sse import SSEEvent
from tokenload.tokens import estimate_tokens


@dataclass(frozen=True, slots=True)
class Conversation:
    """What one request sends: an optional system prompt and the message history, ending with the user's turn.

    A single prompt is a conversation of one user message. Each adapter writes it in
    its own wire shape (Messages `system` + `messages`, Chat `messages` with a system
    message, Responses `instructions` + `input` items). `cache_control` asks the
    Anthropic adapter for prompt-cache breakpoints on the system prompt and on the
    last message (so the next turn reads the whole history from the cache); the
    OpenAI APIs cache prefixes automatically and take no marker.
    """

    messages: tuple[tuple[str, str], ...]  # (role "user" | "assistant", text)
    system: str = ""
    cache_control: bool = False

    @classmethod
    def single(cls, prompt: str) -> Conversation:
        return cls((("user", prompt),))

    def texts(self) -> list[str]:
        """Every text sent, in wire order."""
        return ([self.system] if self.system else []) + [text for _, text in self.messages]

    def estimated_tokens(self) -> int:
        """The local estimate of the whole context's tokens (system prompt and history included)."""
        return sum(estimate_tokens(text) for text in self.texts())


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """Everything an HTTP client needs to send one streaming request."""

    url: str
    headers: Mapping[str, str]
    body: bytes


def usage_count(value: Any) -> int | None:
    """A usage count as the wire gave it: a non-negative integer (JSON true/false or a float is none)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def newer(old: int | None, new: Any) -> int | None:
    """A count the stream reports again: the later one wins, except that a 0 never replaces a count.

    Relays (LiteLLM's Anthropic route) send zeros in the first event as placeholders and the real
    counts at the end; a real count never falls back to 0 later in one answer.
    """
    count = usage_count(new)
    if count is None or (count == 0 and old is not None):
        return old
    return count


def stream_id(tl: Timeline, value: Any) -> None:
    """The stream's own id (`msg_...`, `chatcmpl-...`, `resp_...`) names the exchange when no header did."""
    if tl.request_id is None and isinstance(value, str) and value:
        tl.request_id = value


# The C scanner under `json.loads`, called directly: on a string that is exactly one JSON
# value it returns what `json.loads` would, without loads' two regex whitespace scans and
# three Python frames (1.5 of about 2.2 us per token event). Anything else goes to `json.loads`.
_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


class ProtocolAdapter(ABC):
    """One wire format. Subclasses set `name` and implement `body` and `handle`."""

    name: str
    # Keys of string values this adapter reads only as "a non-empty string or not" (token deltas), as they
    # appear on the wire with their opening quote; and keys of numbers it ignores that change per event.
    # `tokenload.deltas` relies on both to count a stream's later deltas without parsing them.
    delta_keys: tuple[bytes, ...] = ()
    ignored_numbers: tuple[bytes, ...] = ()

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._url = channel.url
        self._headers = channel.headers()

    def prepare(self, prompt: str | Conversation, max_tokens: int,
                extra_body: Mapping[str, Any] | None = None) -> PreparedRequest:
        conversation = Conversation.single(prompt) if isinstance(prompt, str) else prompt
        body = self.body(conversation, max_tokens)
        if extra_body:
            body.update(extra_body)
        return PreparedRequest(self._url, self._headers, json.dumps(body).encode())

    @abstractmethod
    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        """The JSON body for one streaming request."""

    def handle(self, event: SSEEvent, t: float, tl: Timeline) -> None:
        """Apply one SSE event to the timeline; malformed JSON is counted, not fatal."""
        data = event.data
        try:
            obj, end = _scan(data, 0)
        except (StopIteration, ValueError):  # the scanner's two ways to say "not JSON here"
            obj, end = None, -1
        if end != len(data):  # not one bare JSON value: `[DONE]`, whitespace around JSON, or malformed
            if data.strip() == "[DONE]":
                self.on_done(tl)
                return
            try:
                obj = json.loads(data)
            except ValueError:
                tl.malformed += 1
                return
        if not isinstance(obj, dict):
            tl.malformed += 1
            return
        try:
            self.on_json(event.event, obj, t, tl)
        except (AttributeError, TypeError, KeyError, IndexError):
            # Valid JSON of the wrong shape (a string where an object belongs): a bad event, not our crash.
            tl.malformed += 1

    def on_done(self, tl: Timeline) -> None:  # noqa: B027 (a hook whose default does nothing)
        """`data: [DONE]`: only OpenAI Chat sends it; elsewhere it is ignored."""

    @abstractmethod
    def on_json(self, event: str, obj: dict[str, Any], t: float, tl: Timeline) -> None:
        """Apply one decoded JSON event."""

    def in_stream_error(self, obj: dict[str, Any], tl: Timeline) -> None:
        tl.fail(*classify_stream_error(obj))

    def finish(self, tl: Timeline) -> None:
        """The body ended: decide whether the stream was complete."""
        if tl.error_kind is not None:
            return
        if tl.t_first_token is None and tl.malformed:
            # Even when a final event (`[DONE]`) came: nothing but malformed events is no answer.
            tl.fail(ek.MALFORMED_STREAM, f"{tl.malformed} malformed events and no token")
        elif not tl.complete:
            tl.fail(ek.DISCONNECTED, "stream ended before its final event")
