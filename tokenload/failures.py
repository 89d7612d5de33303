"""One map from transport failures to error kinds, for every HTTP client tokenload drives.

`probe` and `doctor` read with httpx, the load generator with geventhttpclient;
both hand what went wrong here and get the same `ErrorKind` and a message a
person can act on (like httpx's own `map_httpcore_exceptions`). Three kinds of
failure exist:

- an exception: DNS, refused, unreachable network, TLS, timeouts, resets,
  invalid HTTP (`classify_exception`);
- a response that did not open a stream: an HTTP status with a body, or a 200
  whose body is a JSON error or an HTML page (`classify_http`);
- an error event inside a stream (`classify_error_type`, used by the adapters).

The kind decides what a failure means to a run (`tokenload.errors.ERROR_CLASSES`):
a wrong host, port or network is `bad_base_url` on every path, so the live
misconfiguration stop fires on it; a refused connection once the address has
accepted one (`answered`: the server went down mid-run) is `connection_refused`,
and a server that closed a connection mid-answer, or a relay whose upstream did
(`classify_stream_error`), is `disconnected`: both are load.
"""

from __future__ import annotations

import errno
import json
import re
import socket
import ssl
import zlib
from http.client import HTTPException
from typing import Any
from urllib.parse import urlsplit

import httpx

from tokenload import errors as ek
from tokenload.errors import ErrorKind
from tokenload.protocolspec import SPECS

# `^model: NAME` is the Anthropic API's own 404 message for an unknown model id.
_MODEL_MISSING = re.compile(r"model.*(not[ _]found|does not exist|unknown|invalid|not supported|no such)|"
                            r"(unknown|invalid|unsupported) model|model_not_found|^model: \S", re.IGNORECASE)
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
# How servers say a prompt does not fit the model's context window:
# llama.cpp  `request (4476 tokens) exceeds the available context size (4096 tokens)`, type
#            `exceed_context_size_error`, fields `n_prompt_tokens`, `n_ctx`;
# vLLM       `This model's maximum context length is 4096 tokens. However, you requested 5000 tokens
#            (4000 in the messages, 1000 in the completion)` or `... and your request has 2778 input tokens`;
# OpenAI     code `context_length_exceeded`, `... your messages resulted in 9000 tokens`;
# Anthropic  `prompt is too long: 208656 tokens > 200000 maximum`, or
#            `input length and max_tokens exceed context limit: 197626 + 8192 > 200000`.
_CONTEXT = re.compile(r"context[_ ]length[_ ]exceeded|exceed_context_size|exceeds the available context size|"
                      r"maximum context length|prompt is too long|exceed context limit|context window", re.IGNORECASE)
_CONTEXT_LIMIT = (
    re.compile(r"^context limit (\d+) tokens", re.IGNORECASE),  # this module's own restatement
    re.compile(r"maximum context length is (\d+)", re.IGNORECASE),
    re.compile(r"available context size \((\d+) tokens?\)", re.IGNORECASE),
    re.compile(r"tokens? > (\d+) maximum", re.IGNORECASE),
    re.compile(r"exceed context limit: \d+ \+ \d+ > (\d+)", re.IGNORECASE),
)
_CONTEXT_PROMPT = (
    re.compile(r"request \((\d+) tokens?\) exceeds", re.IGNORECASE),
    re.compile(r"your request has (\d+) input tokens", re.IGNORECASE),
    re.compile(r"your messages resulted in (\d+) tokens", re.IGNORECASE),
    re.compile(r"\((\d+) in the messages", re.IGNORECASE),
    re.compile(r"prompt is too long: (\d+) tokens", re.IGNORECASE),
    re.compile(r"exceed context limit: (\d+) \+", re.IGNORECASE),
)
# Socket errors that mean "this address cannot be reached from here": a wrong host
# or port, or this machine's network is down. No amount of load changes them.
_UNREACHABLE = frozenset({errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN,
                          errno.EADDRNOTAVAIL, errno.EHOSTDOWN})
_AUTH_WORDS = re.compile(r"invalid (api[ _-]?)?(key|token)|api[ _-]?key (is )?(invalid|missing|expired)|"
                         r"unauthori[sz]ed|authentication", re.IGNORECASE)
# How relays say their backend (the model server behind them) could not be reached: LiteLLM
# `OpenAIException - Connection error.`, `litellm.APIConnectionError: ...`, nginx/envoy `upstream ...`,
# `no healthy upstream`, `Cannot connect to host ...`, `connection refused`.
_UPSTREAM = re.compile(r"\bupstream\b|api ?connection ?error|connection (error|refused|reset|aborted|timed out)|"
                       r"(could not|cannot|can't|couldn't|failed to|unable to) connect|connect(ion)? ?timeout|"
                       r"econnrefused|no healthy", re.IGNORECASE)
# How relays say, inside a stream that opened with 200, that their upstream connection broke mid-answer: LiteLLM's
# Anthropic and Responses routes `Response payload is not completed: <TransferEncodingError: ...>` (aiohttp), its
# chat route `litellm.APIConnectionError: ... Connection error.`; httpx `incomplete chunked read`, `Server disconnected`.
_CUT = re.compile(r"payload is not completed|transfer ?encoding ?error|incomplete chunked|peer closed connection|"
                  r"server disconnected|remote ?protocol ?error|connection (was )?(closed|lost)", re.IGNORECASE)
# This module's words for a wrong address rather than a wrong page: nothing accepted the connection there.
_UNREACHED = re.compile(r"refused the connection|^DNS lookup of|^cannot reach ")
UNREACHED_FIX = ("check the host and port in --base-url and that the channel is running: no server accepted the "
                 "connection there")
# Gateways say "my upstream failed" with the status alone: 502 Bad Gateway, 504 Gateway Timeout.
_GATEWAY_STATUSES = frozenset({502, 504})
# The fields of an error object that name what went wrong, in any protocol (Anthropic `type`, OpenAI `type`, `code`).
_ERROR_KEYS = tuple(dict.fromkeys(key for spec in SPECS.values() for key in spec.error_keys))
_DNS_WORDS = ("name or service not known", "nodename nor servname", "name resolution", "getaddrinfo",
              "no address associated")
_PLAIN_HTTP_WORDS = ("wrong version number", "record layer failure", "packet length too long", "http request")


# --------------------------------------------------------------------- exceptions


def classify_exception(exc: BaseException, url: str, *, connecting: bool = False,
                       timeout_s: float | None = None, answered: bool = False) -> tuple[ErrorKind, str]:
    """(error_kind, message) for an exception raised while sending a request or reading its answer.

    `connecting`: the exception came from opening the connection (TCP, TLS);
    httpx says so itself (`ConnectError`, `ConnectTimeout`). A read timeout is
    `timeout_first_token` here; the stream session turns it into `timeout_stall`
    once a token has arrived. A connect timeout is `timeout_first_token` too:
    under load it is the server's accept queue, not the address, that is at
    fault (doctor's base URL check names the firewall case). `answered`: this
    address accepted a connection before, so a refusal now means the server
    went down (`connection_refused`), not that nothing ever listened there.
    """
    host = urlsplit(url).netloc or url
    chain = _causes(exc)
    text = " ".join(str(e) for e in chain).lower()
    connecting = connecting or isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
    seconds = f" within {timeout_s:g} s" if timeout_s is not None else ""
    refused = any(isinstance(cause, ConnectionRefusedError) for cause in chain) or ("refused" in text and connecting)
    if refused and answered:
        return ek.CONNECTION_REFUSED, f"{host} refused the connection after it had accepted earlier ones: it went down"
    for cause in chain:
        if isinstance(cause, socket.gaierror):
            return ek.BAD_BASE_URL, f"DNS lookup of {urlsplit(url).hostname or host} failed: no such host"
        if isinstance(cause, ConnectionRefusedError):
            return ek.BAD_BASE_URL, f"{host} refused the connection: nothing listens on that port"
        if isinstance(cause, OSError) and cause.errno in _UNREACHABLE:
            return ek.BAD_BASE_URL, f"cannot reach {host}: {cause.strerror or cause} (wrong address, or no network)"
    if any(word in text for word in _DNS_WORDS):
        return ek.BAD_BASE_URL, f"DNS lookup of {urlsplit(url).hostname or host} failed: no such host"
    if "refused" in text and connecting:
        return ek.BAD_BASE_URL, f"{host} refused the connection: nothing listens on that port"
    if connecting and "handshake" in text and _is_timeout(chain):
        return ek.TIMEOUT_FIRST_TOKEN, (f"TLS handshake with {host} got no answer{seconds}: the server may speak "
                                        "plain http, not https, or accepts no more connections")
    if connecting and (any(isinstance(e, ssl.SSLError) for e in chain) or "ssl" in text or "certificate" in text):
        if any(word in text for word in _PLAIN_HTTP_WORDS):
            return ek.BAD_BASE_URL, f"TLS handshake with {host} failed: the server speaks plain http, not https"
        return ek.BAD_BASE_URL, f"TLS handshake with {host} failed: {_last_words(chain)}"
    if _is_timeout(chain):
        if connecting:
            return ek.TIMEOUT_FIRST_TOKEN, (f"no connection to {host}{seconds}: the host is down, a firewall "
                                            "drops the packets, or the server accepts no more connections")
        return ek.TIMEOUT_FIRST_TOKEN, f"{host} accepted the connection but sent no response{seconds}"
    if isinstance(exc, httpx.DecodingError) or any(isinstance(e, zlib.error) for e in chain):
        return ek.MALFORMED_STREAM, f"the compressed body could not be decoded: {_last_words(chain)}"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError)) or any(
            isinstance(e, (OSError, HTTPException)) for e in chain):
        return ek.DISCONNECTED, f"{type(exc).__name__}: {_last_words(chain)}"
    return ek.CLIENT_ERROR, f"{type(exc).__name__}: {exc}"


def fix_for(kind: str | None, message: str | None = None) -> str | None:
    """The fix for a failure: its kind's (`tokenload.errors.FIXES`), unless its words say more: a wrong base URL
    that nothing answered at (refused, no such host, no route) needs the address checked, not the home page."""
    if kind == ek.BAD_BASE_URL and message and _UNREACHED.search(message):
        return UNREACHED_FIX
    return ek.FIXES.get(kind or "")


def _is_timeout(chain: list[BaseException]) -> bool:
    return any(isinstance(e, (TimeoutError, socket.timeout, httpx.TimeoutException)) for e in chain)


def _last_words(chain: list[BaseException]) -> str:
    """The most specific non-empty message in an exception chain."""
    return next((str(e) for e in reversed(chain) if str(e)), type(chain[0]).__name__)


def _causes(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


# ------------------------------------------------------------------ HTTP answers


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
    """The type/code of an error object of any protocol ('' when absent; `ProtocolSpec.error_keys`).

    Responses' `response.failed` nests the error under `response.error`; its code
    (e.g. `rate_limit_exceeded`) says more than the event type.
    """
    if isinstance(obj, dict):
        response = obj.get("response")
        if "error" not in obj and isinstance(response, dict) and isinstance(response.get("error"), dict):
            return error_type(response)
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return " ".join(str(err.get(k) or "") for k in _ERROR_KEYS).strip()
    return ""


def context_length_message(message: str, obj: Any = None) -> str:
    """A context-length refusal restated with the limit and the prompt size when the server gave them."""
    err = obj.get("error") if isinstance(obj, dict) else None
    fields = err if isinstance(err, dict) else {}
    limit = fields.get("n_ctx") if isinstance(fields.get("n_ctx"), int) else _first_int(_CONTEXT_LIMIT, message)
    prompt = (fields.get("n_prompt_tokens") if isinstance(fields.get("n_prompt_tokens"), int)
              else _first_int(_CONTEXT_PROMPT, message))
    said = []
    if limit is not None:
        said.append(f"context limit {limit} tokens")
    if prompt is not None:
        said.append(f"request {prompt} tokens")
    return f"{', '.join(said)}: {message}" if said else message


def context_limit(message: str) -> int | None:
    """The context window (tokens) a context-length refusal names, or None when it names none."""
    return _first_int(_CONTEXT_LIMIT, message)


def upstream_failure(status: int | None, message: str) -> bool:
    """Does this failure say a relay answered but its backend did not?

    A 502/504, or a 5xx or an in-stream error after a 200 whose message names a
    failed connection upstream. The relay itself is up (it answered); only its
    operator can bring the backend back.
    """
    if status in _GATEWAY_STATUSES:
        return True
    return (status is not None and (status >= 500 or status == 200)) and bool(_UPSTREAM.search(message))


def _first_int(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        match = pattern.search(text)
        if match:
            return int(match.group(1))
    return None


def classify_error_type(type_text: str, message: str) -> ErrorKind:
    """Map an error object's type/code and message to an error kind (in-stream errors, JSON error bodies)."""
    t = type_text.lower()
    if _CONTEXT.search(message) or _CONTEXT.search(t):
        return ek.CONTEXT_LENGTH
    if _MODEL_MISSING.search(message) or "model_not_found" in t:
        return ek.NOT_FOUND_MODEL
    if "auth" in t or "permission" in t or "invalid_api_key" in t:
        return ek.AUTH
    if "rate_limit" in t or "rate limit" in message.lower():
        return ek.RATE_LIMITED
    if "overloaded" in t or "overloaded" in message.lower():
        return ek.OVERLOADED
    if _AUTH_WORDS.search(message):
        return ek.AUTH
    if "not_found" in t:
        return ek.BAD_BASE_URL
    if "invalid_request" in t or "request_too_large" in t:
        return ek.BAD_REQUEST
    return ek.OVERLOADED if not t else ek.SERVER_ERROR


def classify_error_object(obj: dict[str, Any]) -> tuple[ErrorKind, str]:
    """(error_kind, message) for an error object: an in-stream error event or a JSON error body."""
    message = error_message(obj) or "error event in stream"
    kind = classify_error_type(error_type(obj), message)
    return kind, context_length_message(message, obj) if kind == ek.CONTEXT_LENGTH else message


def classify_stream_error(obj: dict[str, Any]) -> tuple[ErrorKind, str]:
    """(error_kind, message) for an error event inside a stream that opened with 200.

    A relay whose upstream connection broke mid-answer says so in an error event whose type is a generic
    server error (`api_error`, code 500): the stream was cut (`disconnected`), the server did not refuse it.
    """
    kind, message = classify_error_object(obj)
    if kind in (ek.SERVER_ERROR, ek.OVERLOADED) and (_CUT.search(message) or _UPSTREAM.search(message)):
        return ek.DISCONNECTED, message
    return kind, message


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def classify_http(status: int, content_type: str, body: bytes) -> tuple[ErrorKind, str]:
    """(error_kind, message) for a response that did not open a stream."""
    message = body_message(body, content_type)
    html = looks_like_html(content_type, body)
    obj = _json_body(body)
    type_text = error_type(obj)
    model_missing = bool(_MODEL_MISSING.search(message)) or "model_not_found" in type_text
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
    if status in (400, 413, 422) and (_CONTEXT.search(message) or _CONTEXT.search(type_text)):
        return ek.CONTEXT_LENGTH, context_length_message(message, obj)
    if status in (400, 404, 422) and model_missing:
        return ek.NOT_FOUND_MODEL, message
    if status == 404:
        return ek.BAD_BASE_URL, message
    if status >= 400:
        return ek.BAD_REQUEST, message
    if isinstance(obj, dict) and error_message(obj) is not None and ("error" in obj or obj.get("type") == "error"):
        return classify_error_object(obj)  # relays answer 200 with a JSON error: the body says what went wrong
    return ek.MALFORMED_STREAM, f"HTTP {status} {content_type or 'without content-type'}, not an event stream: {message}"
