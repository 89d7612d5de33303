"""A scripted HTTP server for tests: exact bytes, exact delays, real sockets.

Each request is answered by a `Script`: a status, headers and a list of
`(delay_s, bytes)` writes, then an ending (`complete`, `drop` without the last
chunk, `reset` with a TCP RST, or `hang` until the client gives up). Tests thus
control framing down to one byte per write and know the true TTFT/TPOT. The
builders (`anthropic_stream`, `chat_stream`, `responses_stream`) produce streams
faithful enough for the official SDKs to parse (tests prove it).

The server runs an asyncio loop in a daemon thread on 127.0.0.1, port 0, and
records every request it received (`requests`, with the number of the
connection it came on), so tests can assert what the client sent. By default
each answer says `Connection: close` and closes; `connection=` scripts the other
keep-alive behaviours real servers have (see `Connection`), and `tls=` serves
HTTPS, with the TLS handshake held back by `handshake_delay_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenload.protocolspec import SPECS

Write = tuple[float, bytes]
Ending = Literal["complete", "drop", "reset", "hang"]
# How a connection lives after an answer:
# `close`: the answer says `Connection: close`, then the server closes;
# `keep-alive`: HTTP/1.1 keep-alive, further requests are answered on the same connection;
# `keep-alive-then-close` (llama.cpp's server): keep-alive is implied, but a request that comes
#   on the used connection is dropped unanswered (the server closed it after the answer);
# `close-header-only`: the answer says `Connection: close` yet the server keeps serving, so a
#   client that reuses the socket anyway is caught.
Connection = Literal["close", "keep-alive", "keep-alive-then-close", "close-header-only"]


@dataclass(frozen=True)
class Script:
    """How to answer one request. `writes` are (delay before the write, bytes).

    `framing`: `chunked` (each write one HTTP chunk; `drop` then leaves the body
    incomplete, as a dying proxy does), `close` (no length, the body ends when the
    connection closes) or `length` (Content-Length of all writes).
    """

    status: int = 200
    headers: Sequence[tuple[str, str]] = (("content-type", "text/event-stream"),)
    writes: Sequence[Write] = ()
    ending: Ending = "complete"
    framing: Literal["chunked", "close", "length"] = "chunked"
    headers_delay_s: float = 0.0

    def body(self) -> bytes:
        return b"".join(data for _, data in self.writes)


@dataclass(frozen=True)
class Received:
    """One request as the server saw it."""

    method: str
    path: str  # without the query string
    query: str
    headers: dict[str, str]  # names lowercased
    body: bytes
    connection: int = 0  # which accepted connection (1, 2, ...) carried it
    # When each write of the answer went out, (perf_counter before, after): the head, then each non-empty write.
    # A test compares a client's stamps with them, so a server slowed by a busy machine is not a client's error.
    written: list[tuple[float, float]] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)


Router = Callable[[Received], Script]

# --------------------------------------------------------------------- SSE text


def sse(data: Any, event: str | None = None, eol: str = "\n") -> bytes:
    """One SSE event; `data` is JSON-encoded unless it is already a str."""
    text = data if isinstance(data, str) else json.dumps(data)
    lines = ([f"event: {event}"] if event else []) + [f"data: {line}" for line in text.split("\n")]
    return (eol.join(lines) + eol + eol).encode()


def rechunk(writes: Iterable[Write], size: int) -> list[Write]:
    """The same bytes as `writes`, in writes of at most `size` bytes (delays kept on the first piece)."""
    out: list[Write] = []
    for delay, data in writes:
        for i in range(0, max(len(data), 1), size):
            out.append((delay if i == 0 else 0.0, data[i : i + size]))
    return out


def _timed(events: Sequence[bytes], token_at: Sequence[int], first_delay: float, per_token: float) -> list[Write]:
    """Writes for `events`: the events listed in `token_at` are delayed like tokens, others go at once."""
    writes: list[Write] = []
    seen_token = False
    for i, event in enumerate(events):
        delay = 0.0
        if i in token_at:
            delay = per_token if seen_token else first_delay
            seen_token = True
        writes.append((delay, event))
    return writes


def anthropic_stream(
    tokens: Sequence[str],
    first_delay: float = 0.0,
    per_token: float = 0.0,
    *,
    thinking: Sequence[str] = (),
    input_tokens: int = 12,
    output_tokens: int | None = None,
    usage: bool = True,
    ping: bool = True,
    model: str = "claude-test",
    stop_reason: str = "end_turn",
    message_id: str = "msg_fake01",
    start_usage: dict[str, int] | None = None,
    delta_usage: dict[str, int] | None = None,
) -> list[Write]:
    """Anthropic Messages stream: message_start, optional thinking block, text block, message_delta, stop.

    Thinking deltas are tokens (timed like text); the signature delta is not.
    `output_tokens` is the usage count reported in message_delta (default: all deltas).
    `start_usage` replaces message_start's usage; `delta_usage` adds keys to message_delta's
    (a relay such as LiteLLM sends zeros first and the real input and cache counts at the end).
    """
    n_out = len(tokens) + len(thinking) if output_tokens is None else output_tokens
    if start_usage is None:
        start_usage = {"input_tokens": input_tokens, "output_tokens": 1} if usage else {}
    events = [
        sse(
            {
                "type": "message_start",
                "message": {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": start_usage,
                },
            },
            "message_start",
        )
    ]
    token_at: list[int] = []
    index = 0
    if thinking:
        events.append(
            sse({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}, "content_block_start")
        )
        for piece in thinking:
            token_at.append(len(events))
            events.append(
                sse({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": piece}}, "content_block_delta")
            )
        events.append(
            sse({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "c2lnbmF0dXJl"}}, "content_block_delta")
        )
        events.append(sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        index = 1
    events.append(sse({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}, "content_block_start"))
    if ping:
        events.append(sse({"type": "ping"}, "ping"))
    for piece in tokens:
        token_at.append(len(events))
        events.append(
            sse({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}}, "content_block_delta")
        )
    events.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
    events.append(
        sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": n_out, **(delta_usage or {})} if usage else {},
            },
            "message_delta",
        )
    )
    events.append(sse({"type": "message_stop"}, "message_stop"))
    return _timed(events, token_at, first_delay, per_token)


def _chat_chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None, model: str = "gpt-test",
                completion_id: str = "chatcmpl-fake01") -> bytes:
    return sse(
        {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage,
        }
    )


def chat_stream(
    tokens: Sequence[str],
    first_delay: float = 0.0,
    per_token: float = 0.0,
    *,
    reasoning: Sequence[str] = (),
    role_chunk: bool = True,
    include_usage: bool = True,
    input_tokens: int = 12,
    output_tokens: int | None = None,
    model: str = "gpt-test",
    finish_reason: str = "stop",
    done: bool = True,
    completion_id: str = "chatcmpl-fake01",
) -> list[Write]:
    """OpenAI Chat Completions stream: role-only chunk at once, content chunks, finish chunk, usage chunk, [DONE]."""
    n_out = len(tokens) + len(reasoning) if output_tokens is None else output_tokens
    chunk = functools.partial(_chat_chunk, model=model, completion_id=completion_id)

    def choice(delta: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

    events: list[bytes] = []
    if role_chunk:
        events.append(chunk(choice({"role": "assistant", "content": ""})))
    token_at: list[int] = []
    for piece in reasoning:
        token_at.append(len(events))
        events.append(chunk(choice({"reasoning_content": piece})))
    for piece in tokens:
        token_at.append(len(events))
        events.append(chunk(choice({"content": piece})))
    events.append(chunk(choice({}, finish_reason)))
    if include_usage:
        usage = {"prompt_tokens": input_tokens, "completion_tokens": n_out, "total_tokens": input_tokens + n_out}
        events.append(chunk([], usage))
    if done:
        events.append(sse("[DONE]"))
    return _timed(events, token_at, first_delay, per_token)


def responses_stream(
    tokens: Sequence[str],
    first_delay: float = 0.0,
    per_token: float = 0.0,
    *,
    input_tokens: int = 12,
    output_tokens: int | None = None,
    model: str = "gpt-test",
    response_id: str = "resp_fake01",
    incomplete: str | None = None,
) -> list[Write]:
    """OpenAI Responses stream: created, in_progress, item/part added, text deltas, done events, completed
    (or, with `incomplete` = a reason such as `max_output_tokens`, `response.incomplete`)."""
    n_out = len(tokens) if output_tokens is None else output_tokens
    text = "".join(tokens)
    seq = iter(range(10_000))

    def response(status: str, output: list[Any], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "response",
            "created_at": 1700000000,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if status == "incomplete" else None,
            "instructions": None,
            "max_output_tokens": None,
            "model": model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage,
            "metadata": {},
        }

    def ev(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    part_done = {"type": "output_text", "text": text, "annotations": []}
    item = {"id": "msg_fake01", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    item_done = {**item, "status": "completed", "content": [part_done]}
    where = {"item_id": "msg_fake01", "output_index": 0, "content_index": 0}
    usage = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + n_out,
    }
    events = [
        ev("response.created", response=response("in_progress", [], None)),
        ev("response.in_progress", response=response("in_progress", [], None)),
        ev("response.output_item.added", output_index=0, item=item),
        ev("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []}),
    ]
    token_at: list[int] = []
    for piece in tokens:
        token_at.append(len(events))
        events.append(ev("response.output_text.delta", **where, delta=piece, logprobs=[]))
    events += [
        ev("response.output_text.done", **where, text=text, logprobs=[]),
        ev("response.content_part.done", **where, part=part_done),
        ev("response.output_item.done", output_index=0, item=item_done),
        ev("response.incomplete", response=response("incomplete", [item_done], usage)) if incomplete else
        ev("response.completed", response=response("completed", [item_done], usage)),
    ]
    return _timed(events, token_at, first_delay, per_token)


@dataclass(frozen=True)
class FakeWire:
    """The fake's side of one protocol: its stream builder, the id its streams carry (the record's
    server_request_id) and the builder's keyword for it, and the builder's keywords for an answer stopped at
    its output limit."""

    build: Callable[..., list[Write]]
    stream_id: str
    id_keyword: str
    for_length: dict[str, Any]


# One row per `tokenload.protocolspec.SPECS` row (tests/test_protocolspec.py checks).
WIRES: dict[str, FakeWire] = {
    "anthropic": FakeWire(anthropic_stream, "msg_fake01", "message_id", {"stop_reason": "max_tokens"}),
    "openai-chat": FakeWire(chat_stream, "chatcmpl-fake01", "completion_id", {"finish_reason": "length"}),
    "openai-responses": FakeWire(responses_stream, "resp_fake01", "response_id", {"incomplete": "max_output_tokens"}),
}


def api_base(url: str, protocol: str, prefix: str = "/api") -> str:
    """A base URL for `protocol` on the server at `url` as its users write one: ending in the API root where the
    protocol's SDKs expect it there (`OPENAI_BASE_URL=.../v1`), else in `prefix` (a relay's path)."""
    spec = SPECS[protocol]
    return url + (spec.root if spec.root_in_base else prefix)


def stream_script(protocol: str, tokens: Sequence[str], first_delay: float = 0.0, per_token: float = 0.0, **kw: Any) -> Script:
    """A 200 event-stream answer in `protocol`'s wire format."""
    return Script(writes=WIRES[protocol].build(tokens, first_delay, per_token, **kw))


def json_script(status: int, obj: Any, headers: Sequence[tuple[str, str]] = ()) -> Script:
    """A JSON (error) body, as APIs send for HTTP errors."""
    return Script(status=status, headers=(("content-type", "application/json"), *headers), writes=[(0.0, json.dumps(obj).encode())], framing="length")


def body_script(status: int, body: bytes, content_type: str = "text/html; charset=utf-8") -> Script:
    """Any other body (an HTML page, an empty 500)."""
    headers = (("content-type", content_type),) if content_type else ()
    return Script(status=status, headers=headers, writes=[(0.0, body)] if body else [], framing="length")


# ----------------------------------------------------------------------- server

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 529: "Overloaded"}


class FakeServer:
    """Scripted HTTP/1.1 server on 127.0.0.1 in a background thread.

    `play(*scripts)` answers the next requests in order (the last one repeats);
    `route(fn)` answers each request with `fn(received)`. `requests` lists what
    arrived. `reset()` clears both and releases any hanging response.
    """

    def __init__(self, *, tls: ssl.SSLContext | None = None, handshake_delay_s: float = 0.0, port: int = 0) -> None:
        self.requests: list[Received] = []
        self.connection: Connection = "close"
        # True: each write's delay counts from the previous write's due time, not from when it went out, so
        # the event loop's late wake-ups do not add up over a stream (a TPOT exact to the loop's lateness).
        self.absolute_times = False
        self.connections = 0  # accepted so far
        self.dropped = 0  # requests `keep-alive-then-close` left unanswered
        self._tls = tls
        self._handshake_delay_s = handshake_delay_s
        self._scripts: list[Script] = []
        self._router: Router | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._release: asyncio.Event | None = None
        self._server: asyncio.base_events.Server | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started, port), name="fakeserver", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("fake server did not start")
        assert self._server is not None
        self.port: int = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    # ---------------------------------------------------------------- control

    def play(self, *scripts: Script) -> FakeServer:
        with self._lock:
            self._scripts = list(scripts)
            self._router = None
        return self

    def route(self, router: Router) -> FakeServer:
        with self._lock:
            self._router = router
            self._scripts = []
        return self

    def reset(self) -> None:
        with self._lock:
            self.requests = []
            self._scripts = []
            self._router = None
            self.connection = "close"
            self.connections = 0
            self.dropped = 0
        self._loop.call_soon_threadsafe(self._new_release)

    def close(self) -> None:
        """Stop serving: the port refuses connections from now on (again: nothing more)."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def last(self) -> Received:
        """The most recent request (fails the test if none arrived)."""
        assert self.requests, "the fake server received no request"
        return self.requests[-1]

    # --------------------------------------------------------------- internals

    def _new_release(self) -> None:
        if self._release is not None:
            self._release.set()
        self._release = asyncio.Event()

    def _run(self, started: threading.Event, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        self._new_release()
        if self._tls is not None and self._handshake_delay_s:
            # Held inside the handshake (the SNI callback runs in it), so the client's TLS
            # setup takes that long. It blocks this loop: a TLS server takes one client at a time.
            self._tls.sni_callback = lambda *_: time.sleep(self._handshake_delay_s)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", port, ssl=self._tls))
        started.set()
        self._loop.run_forever()
        # Stopped: end the open exchanges (hanging or sleeping ones) before closing the loop.
        self._server.close()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    def _script_for(self, received: Received) -> Script:
        with self._lock:
            self.requests.append(received)
            if self._router is not None:
                return self._router(received)
            if not self._scripts:
                return body_script(500, b"fake server: no script", "text/plain")
            return self._scripts.pop(0) if len(self._scripts) > 1 else self._scripts[0]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        release = self._release
        with self._lock:
            self.connections += 1
            number = self.connections
        try:
            answered = 0
            while True:
                received = await self._read_request(reader, number)
                if received is None:
                    return
                if answered and self.connection == "keep-alive-then-close":
                    with self._lock:
                        self.dropped += 1
                    return  # the server had closed this connection after its answer: no byte back
                script = self._script_for(received)
                await self._answer(script, reader, writer, release, received.written)
                answered += 1
                if self.connection == "close" or script.ending != "complete" or script.framing == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ssl.SSLError):
            pass  # the client left or sent garbage: nothing to answer
        finally:
            if not writer.is_closing():
                writer.close()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader, connection: int = 0) -> Received | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None  # the client closed an idle connection
            raise
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length") or 0)
        body = await reader.readexactly(length) if length else b""
        path, _, query = target.partition("?")
        return Received(method, path, query, headers, body, connection)

    async def _answer(self, script: Script, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      release: asyncio.Event | None, written: list[tuple[float, float]]) -> None:
        if script.headers_delay_s:
            await asyncio.sleep(script.headers_delay_s)
        head = [f"HTTP/1.1 {script.status} {_REASONS.get(script.status, 'Status')}"]
        head += [f"{k}: {v}" for k, v in script.headers]
        if script.framing == "chunked":
            head.append("transfer-encoding: chunked")
        elif script.framing == "length":
            head.append(f"content-length: {len(script.body())}")
        if self.connection in ("close", "close-header-only"):
            head.append("connection: close")
        _write(writer, ("\r\n".join(head) + "\r\n\r\n").encode("latin-1"), written)
        await writer.drain()
        due = self._loop.time()
        for delay, data in script.writes:
            due += delay
            if delay:
                await asyncio.sleep(max(0.0, due - self._loop.time()) if self.absolute_times else delay)
            if not data:
                continue
            _write(writer, b"%x\r\n%s\r\n" % (len(data), data) if script.framing == "chunked" else data, written)
            await writer.drain()
        if script.ending == "complete":
            if script.framing == "chunked":
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        elif script.ending == "reset":
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        elif script.ending == "hang":
            # Hold the connection open, silent, until the client leaves or the test ends.
            waiters = [asyncio.ensure_future(reader.read(1))]
            if release is not None:
                waiters.append(asyncio.ensure_future(release.wait()))
            _, pending = await asyncio.wait(waiters, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
        # "drop": just close, leaving a chunked body without its last chunk.


def _write(writer: asyncio.StreamWriter, data: bytes, written: list[tuple[float, float]]) -> None:
    before = time.perf_counter()
    writer.write(data)  # an empty send buffer: the bytes go to the kernel now
    written.append((before, time.perf_counter()))


def server_arguments(doc: str) -> argparse.Namespace:
    """The command line of a timed server run as its own process (stampserver, loopserver): where its truth goes
    at SIGTERM, its first token's delay, the gap between tokens, how many, which protocol."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--truth", required=True, help="JSON lines written here at SIGTERM")
    parser.add_argument("--ttft-s", type=float, default=0.2)
    parser.add_argument("--tpot-s", type=float, default=0.01)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--protocol", choices=("anthropic", "openai-chat"), default="anthropic")
    return parser.parse_args()
