"""What every protocol adapter does: build a request, read events, classify errors.

An adapter knows one wire format and nothing about HTTP clients or load: it
turns (prompt, max tokens) into a `PreparedRequest`, and each decoded SSE event
into updates of a `Timeline` (tokens, usage, stop reason, errors). Any HTTP
client can drive it through `tokenload.stream.StreamSession`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenload import errors as ek
from tokenload.channel import Channel
from tokenload.measure import Timeline
from tokenload.sse import SSEEvent


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """Everything an HTTP client needs to send one streaming request."""

    url: str
    headers: Mapping[str, str]
    body: bytes


# `^model: NAME` is the Anthropic API's own 404 message for an unknown model id.
_MODEL_MISSING = re.compile(r"model.*(not[ _]found|does not exist|unknown|invalid|not supported|no such)|"
                            r"(unknown|invalid|unsupported) model|model_not_found|^model: \S", re.I)
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.I | re.S)
# The C scanner under `json.loads`, called directly: on a string that is exactly one JSON
# value it returns what `json.loads` would, without loads' two regex whitespace scans and
# three Python frames (1.5 of about 2.2 us per token event). Anything else goes to `json.loads`.
_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def looks_like_html(content_type: str, body: bytes) -> bool:
    head = body.lstrip()[:64].lower()
    return "html" in content_type.lower() or head.startswith((b"<!doctype html", b"<html"))


def body_message(body: bytes, content_type: str = "") -> str:
    """A short human message from an error body: the API's message, an HTML title, or text."""
    if looks_like_html(content_type, body):
        title = _TITLE.search(body)
        text = title.group(1).decode("utf-8", "replace").strip() if title else "an HTML page"
        return f"HTML page: {text[:120]}"
    try:
        obj = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:200] or "(empty body)"
    return error_message(obj) or json.dumps(obj)[:200]


def error_message(obj: Any) -> str | None:
    """The message of an Anthropic or OpenAI error object, wherever it nests."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = err.get("message")
            if isinstance(msg, str):
                return msg
        elif isinstance(err, str):
            return err
        response = obj.get("response")
        if isinstance(response, dict):
            return error_message(response)
    return None


def error_type(obj: Any) -> str:
    """The type/code of an Anthropic or OpenAI error object ('' when absent).

    Responses' `response.failed` nests the error under `response.error`; its code
    (e.g. `rate_limit_exceeded`) says more than the event type.
    """
    if isinstance(obj, dict):
        response = obj.get("response")
        if "error" not in obj and isinstance(response, dict) and isinstance(response.get("error"), dict):
            return error_type(response)
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return " ".join(str(err.get(k) or "") for k in ("type", "code")).strip()
    return ""


def classify_error_type(type_text: str, message: str) -> str:
    """Map an error event's type/code and message to SPEC.md's error_kind."""
    t = type_text.lower()
    if _MODEL_MISSING.search(message) or "model_not_found" in t:
        return ek.NOT_FOUND_MODEL
    if "auth" in t or "permission" in t or "invalid_api_key" in t:
        return ek.AUTH
    if "rate_limit" in t or "rate limit" in message.lower():
        return ek.RATE_LIMITED
    if "overloaded" in t or "overloaded" in message.lower():
        return ek.OVERLOADED
    if "not_found" in t:
        return ek.BAD_BASE_URL
    if "invalid_request" in t or "request_too_large" in t:
        return ek.BAD_REQUEST
    return ek.OVERLOADED if not t else ek.SERVER_ERROR


def _body_error_type(body: bytes) -> str:
    try:
        return error_type(json.loads(body))
    except ValueError:
        return ""


def classify_http(status: int, content_type: str, body: bytes) -> tuple[str, str]:
    """(error_kind, message) for a response that did not open a stream."""
    message = body_message(body, content_type)
    html = looks_like_html(content_type, body)
    model_missing = bool(_MODEL_MISSING.search(message)) or "model_not_found" in _body_error_type(body)
    if status in (401, 403):
        return ek.AUTH, message
    if status == 429:
        return ek.RATE_LIMITED, message
    if status in (503, 529):
        return ek.OVERLOADED, message
    if status >= 500:
        return ek.SERVER_ERROR, message
    if html or 300 <= status < 400:
        return ek.BAD_BASE_URL, message
    if status in (400, 404, 422) and model_missing:
        return ek.NOT_FOUND_MODEL, message
    if status == 404:
        return ek.BAD_BASE_URL, message
    if status >= 400:
        return ek.BAD_REQUEST, message
    return ek.MALFORMED_STREAM, f"HTTP {status} {content_type or 'without content-type'}, not an event stream: {message}"


class ProtocolAdapter(ABC):
    """One wire format. Subclasses set `name` and implement `body` and `handle`."""

    name: str

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._url = channel.url
        self._headers = channel.headers()

    def prepare(self, prompt: str, max_tokens: int, extra_body: Mapping[str, Any] | None = None) -> PreparedRequest:
        body = self.body(prompt, max_tokens)
        if extra_body:
            body.update(extra_body)
        return PreparedRequest(self._url, self._headers, json.dumps(body).encode())

    @abstractmethod
    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
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
        message = error_message(obj) or "error event in stream"
        tl.fail(classify_error_type(error_type(obj), message), message)

    def finish(self, tl: Timeline) -> None:
        """The body ended: decide whether the stream was complete."""
        if tl.error_kind is not None:
            return
        if tl.t_first_token is None and tl.malformed:
            # Even when a final event (`[DONE]`) came: nothing but malformed events is no answer.
            tl.fail(ek.MALFORMED_STREAM, f"{tl.malformed} malformed events and no token")
        elif not tl.complete:
            tl.fail(ek.DISCONNECTED, "stream ended before its final event")
