"""The simulator's HTTP/1.1 server: routing, auth, limits, faults, streaming and the truth file.

A small hand-written HTTP/1.1 server on `asyncio.start_server`: keep-alive,
Content-Length request bodies, chunked streaming responses. Each generation
request becomes a `Sequence` handed to the model's `Engine`; the engine's timer
callbacks call `emit(i)` for every token, which writes straight to the socket
transport (no task switch per token). The handler coroutine just awaits the
sequence's end, writes the truth line and reads the next request.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Any, TextIO

from tokenload.modelsize import size_from_id
from tokenload.protocolspec import SPECS
from tokenload.sim import wire
from tokenload.sim.engine import Engine, RateLimiter, Sequence, Stats, rate_limit_headers, retry_after_header
from tokenload.sim.faults import FaultPlan, markers_in
from tokenload.sim.metrics import Metrics
from tokenload.sim.profile import Profile, load_profile
from tokenload.tokens import estimate_tokens

MAX_BODY = 32 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
            529: "Overloaded"}
# Routes under the base path besides each protocol's endpoint (`ProtocolSpec.route`, whose route is its name).
_ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/messages/count_tokens"): "count_tokens",  # Anthropic's token counter
    **{("GET", spec.root + spec.models_path): "models" for spec in SPECS.values()},
    ("GET", "/health"): "health",
    ("GET", "/metrics"): "metrics",
}
_KEY_HEADERS = tuple(dict.fromkeys(spec.key_header for spec in SPECS.values() if spec.key_header))


def _route(method: str, path: str) -> tuple[str | None, str | None]:
    """(route, model the path names) of a request path under the base path; (None, None) when nothing serves it."""
    route = _ROUTES.get((method, path))
    if route is not None or method != "POST":
        return route, None
    for spec in SPECS.values():
        match = spec.route().match(path)
        if match is not None:
            return spec.name, match.groupdict().get("model")
    return None, None


def _models_protocol(headers: dict[str, str]) -> str:
    """Whose model list a request asks for: the first protocol whose fixed headers it carries (`anthropic-version`),
    else the first that has none."""
    carried = [s.name for s in SPECS.values() if s.headers and all(name in headers for name, _ in s.headers)]
    return (carried or [s.name for s in SPECS.values() if not s.headers])[0]
_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title></head>
<body><h1>{title}</h1><p>This is the tokenload channel simulator's web page, not its API.
The API base URL is <code>{base}</code>.</p></body></html>
"""


@dataclass
class Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes
    arrival: float

    @property
    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        return connection != "close" and (self.version == "HTTP/1.1" or connection == "keep-alive")


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


class StreamSequence(Sequence):
    """A streaming response: every token is written to the transport as it is emitted."""

    __slots__ = ("transport", "framer", "faults", "done", "outcome", "keep_alive", "preamble_sent",
                 "_special", "_prefix", "_split", "_cut_at", "_malformed_at", "_send")

    def __init__(self, n_input: int, n_out: int, transport: asyncio.WriteTransport, framer: wire.Framer,
                 faults: FaultPlan) -> None:
        stall_at = faults.after("stall")
        super().__init__(n_input, n_out, stall_at, faults.num("stall", "seconds") if stall_at >= 0 else 0.0)
        self.transport = transport
        self.framer = framer
        self.faults = faults
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.outcome = "ok"
        self.keep_alive = True
        self.preamble_sent = False
        cut = faults.action if faults.action in ("disconnect", "reset", "error_event") else None
        self._cut_at = faults.after(cut) if cut else -1
        self._malformed_at = faults.after("malformed")
        self._special = {0, n_out - 1, self._cut_at, self._malformed_at} - {-1}
        self._prefix = b"\xef\xbb\xbf" if faults.has("bom") else b""
        self._split = int(faults.num("split", "bytes")) if faults.has("split") else 0
        self._send = self._send_split if self._split > 0 else self._send_chunk

    def _send_chunk(self, data: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def _send_split(self, data: bytes) -> None:
        step = self._split
        for k in range(0, len(data), step):
            self.transport.write(_chunk(data[k:k + step]))

    def send_preamble(self) -> None:
        preamble = self._prefix + self.framer.preamble()
        if preamble:  # an empty chunk would end the chunked body: a protocol with nothing to say before its tokens
            self._send(preamble)
        self._prefix = b""
        self.preamble_sent = True

    def emit(self, i: int) -> bool:
        if self.transport.is_closing():
            self.outcome = "client_closed"
            self.keep_alive = False
            return False
        if i in self._special:
            return self._emit_special(i)
        self._send(self.framer.token(i))
        self.last_token = time.time()
        return True

    def _emit_special(self, i: int) -> bool:
        if i == 0 and not self.preamble_sent:
            self.send_preamble()
        if i == self._cut_at:
            self._cut(self.faults.action or "")
            return False
        data = self.framer.malformed() if i == self._malformed_at else b""
        self._send(data + self.framer.token(i))
        self.last_token = time.time()
        if i == 0:
            self.first_token = self.last_token
        return True

    def _cut(self, action: str) -> None:
        """End the stream early the way the fault says: FIN, RST or an in-stream error."""
        self.outcome = action
        self._ended()
        if action == "error_event":
            self._send(self.framer.error_event())
            self.transport.write(b"0\r\n\r\n")
            return
        self.keep_alive = False
        if action == "reset":
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
        else:
            self.transport.close()

    def finish(self) -> None:
        no_final_chunk = self.faults.has("no_final_chunk")
        if no_final_chunk:
            self.outcome = "no_final_chunk"
            self.keep_alive = False
        self._ended()
        self._send(self.framer.end())
        if no_final_chunk:
            self.transport.close()
        else:
            self.transport.write(b"0\r\n\r\n")
        self.done.set_result(self.keep_alive)

    def drop(self) -> None:
        self._ended()
        if not self.done.done():
            self.done.set_result(self.keep_alive)


class BodySequence(Sequence):
    """A non-stream request: generation is simulated the same way, the body is written at the end."""

    __slots__ = ("transport", "done", "outcome")

    def __init__(self, n_input: int, n_out: int, transport: asyncio.WriteTransport) -> None:
        super().__init__(n_input, n_out)
        self.transport = transport
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.outcome = "ok"

    def emit(self, i: int) -> bool:
        if self.transport.is_closing():
            self.outcome = "client_closed"
            return False
        self.last_token = time.time()
        if i == 0:
            self.first_token = self.last_token
        return True

    def finish(self) -> None:
        self._ended()
        self.done.set_result(True)

    def drop(self) -> None:
        self._ended()
        self.done.set_result(False)


class SimServer:
    """The simulated channel. `await start()` returns the base URL; `await close()` stops it."""

    def __init__(self, profile: Profile | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, models: list[str] | None = None, truth_path: str | Path | None = None,
                 prefix: str = "/api", sock: socket.socket | None = None) -> None:
        self.profile = profile or load_profile("default")
        self.host = host
        self.port = port
        self._api_key = api_key
        self.models = list(models or self.profile.models)
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
        self.truth_path = Path(truth_path) if truth_path else None
        self._sock = sock
        self.stats = Stats()
        self.metrics = Metrics()
        self.rng = Random(self.profile.seed)
        self.limiter = RateLimiter(self.profile.rate_limit_rpm, self.profile.rate_limit_tpm)
        self.in_flight = 0
        self.engines: dict[str, Engine] = {}
        self._server: asyncio.Server | None = None
        self._truth: TextIO | None = None
        self._connections: dict[asyncio.StreamWriter, asyncio.Task[None]] = {}
        self.base_url = ""

    async def start(self) -> str:
        self.engines = {
            m: Engine(self.profile, m, self.stats, Random(f"{self.profile.seed}:{m}"), self.metrics.itl_observer(m))
            for m in self.models
        }
        if self.truth_path:
            self._truth = self.truth_path.open("a", encoding="utf-8", buffering=1)
        if self._sock is not None:
            self._server = await asyncio.start_server(self._connection, sock=self._sock, limit=1 << 16)
        else:
            self._server = await asyncio.start_server(self._connection, self.host, self.port, limit=1 << 16)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.port = port
        self.base_url = f"http://{host}:{port}{self.prefix}"
        return self.base_url

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer, task in list(self._connections.items()):
            writer.transport.abort()
            task.cancel()
        await asyncio.gather(*self._connections.values(), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self._truth is not None:
            self._truth.close()
            self._truth = None

    # -- HTTP plumbing -----------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[writer] = task
        try:
            while True:
                request = await self._read_request(reader, writer)
                if request is None or not await self._dispatch(request, writer) or not request.keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # close() cancels open connections; ending quietly keeps asyncio's
            # start_server callback from logging every one of them as an error.
            pass
        finally:
            self._connections.pop(writer, None)
            if not writer.transport.is_closing():
                writer.close()

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:
            self._plain(writer, 431, b"request headers too large\n", keep=False)
            return None
        arrival = time.time()
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            self._plain(writer, 400, b"malformed request line\n", keep=False)
            return None
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._plain(writer, 411, b"send a Content-Length request body\n", keep=False)
            return None
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            self._plain(writer, 400, b"bad Content-Length\n", keep=False)
            return None
        if length > MAX_BODY:
            self._plain(writer, 413, b"request body too large\n", keep=False)
            return None
        body = await reader.readexactly(length) if length else b""
        return Request(method.upper(), target.split("?", 1)[0], version, headers, body, arrival)

    def _plain(self, writer: asyncio.StreamWriter, status: int, body: bytes, keep: bool = True,
               content_type: str = "text/plain; charset=utf-8", headers: Iterable[tuple[str, str]] = ()) -> None:
        head = [("content-type", content_type), ("content-length", str(len(body)))]
        if not keep:
            head.append(("connection", "close"))
        writer.write(_head(status, head + list(headers)) + body)

    def _html(self, writer: asyncio.StreamWriter, status: int, request: Request,
              headers: Iterable[tuple[str, str]] = ()) -> None:
        title = "Simulated LLM channel" if status == 200 else "404 Not Found"
        page = _HTML.format(title=title, base=self.base_url).encode()
        self._plain(writer, status, page, request.keep_alive, "text/html; charset=utf-8", headers)

    async def _dispatch(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False closes the connection."""
        route, path_model = None, None
        if request.path.startswith(self.prefix + "/"):
            route, path_model = _route(request.method, request.path[len(self.prefix):].rstrip("/") or "/")
        elif (request.method, request.path) == ("GET", "/metrics"):  # at the root too, where vLLM serves it
            route = "metrics"
        if route is None:
            root = request.path.rstrip("/") in ("", self.prefix)
            self._write_truth(_record(wire.new_request_id(), request, None) | {"status": 200 if root else 404, "error": "html"})
            self._html(writer, 200 if root else 404, request)
            return True
        if route == "health":
            self._plain(writer, 200, b'{"status":"ok"}', request.keep_alive, "application/json")
            return True
        if route == "metrics":
            gauges = {m: (e.running, len(e.waiting)) for m, e in self.engines.items()}
            text = self.metrics.render(gauges, self.stats).encode()
            self._plain(writer, 200, text, request.keep_alive, "text/plain; version=0.0.4; charset=utf-8")
            return True
        return await Generation(self, request, writer, route, path_model).run()

    def authorized(self, headers: dict[str, str]) -> bool:
        if self._api_key is None:
            return True
        given = [headers.get(name, "") for name in _KEY_HEADERS]
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given.append(auth[7:])
        return any(secrets.compare_digest(g.encode(), self._api_key.encode()) for g in given)

    def _write_truth(self, record: dict[str, Any]) -> None:
        if self._truth is not None:
            self._truth.write(json.dumps(record, separators=(",", ":")) + "\n")


def _record(request_id: str, request: Request, protocol: str | None) -> dict[str, Any]:
    """A truth line with every contract key present; handlers fill in what they learn."""
    return {
        "request_id": request_id, "path": request.path, "protocol": protocol, "model": None,
        "status": None, "arrival": request.arrival, "admitted": None, "first_token": None, "last_token": None,
        "input_tokens": None, "output_tokens": 0, "fault": None, "queue_s": None, "error": None,
        "cached_tokens": None, "cache_creation_tokens": None,
    }


class Generation:
    """One API request from routing to the truth line; every early answer goes through `_error`."""

    def __init__(self, server: SimServer, request: Request, writer: asyncio.StreamWriter, route: str,
                 path_model: str | None = None) -> None:
        self.server = server
        self.request = request
        self.writer = writer
        self.route = route
        self.path_model = path_model  # the model a protocol names in its path instead of its body
        self.request_id = wire.new_request_id()
        self.proto: type[wire.Framer] = (
            wire.PROTOCOLS[route] if route in wire.PROTOCOLS else wire.AnthropicFramer if route == "count_tokens"
            else wire.PROTOCOLS[_models_protocol(request.headers)])
        self.record = _record(self.request_id, request, self.proto.name)
        self.rate_headers: list[tuple[str, str]] = []  # set once the rate limiter has seen the request

    @property
    def _id_headers(self) -> list[tuple[str, str]]:
        return [("x-request-id", self.request_id), ("request-id", self.request_id), *self.rate_headers]

    def _error(self, status: int, message: str, *, headers: Iterable[tuple[str, str]] = (), error: str,
               body: bool = True, **extra: str | None) -> bool:
        self.record.update(status=status, error=error)
        self.server._write_truth(self.record)
        payload = self.proto.error_body(status, message, self.request_id, **extra) if body else b""
        self.server._plain(self.writer, status, payload, self.request.keep_alive, "application/json",
                           self._id_headers + list(headers))
        return True

    def _json(self, payload: dict[str, Any]) -> None:
        self.server._plain(self.writer, 200, wire.dumps(payload), self.request.keep_alive, "application/json",
                           self._id_headers)

    async def run(self) -> bool:
        server, request = self.server, self.request
        if not server.authorized(request.headers):
            message, code = self.proto.auth_error
            return self._error(401, message, error="auth", code=code)
        if self.route == "models":
            data = [{"id": m, "object": "model", "type": "model", "display_name": m, "created": 0,
                     "created_at": "2025-01-01T00:00:00Z", "owned_by": "tokenload-sim"} for m in server.models]
            self._json({"object": "list", "data": data, "has_more": False,
                        "first_id": server.models[0], "last_id": server.models[-1]})
            return True
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return self._error(400, "The request body is not valid JSON.", error="bad_request")
        if self.path_model is not None:
            body = {**body, "model": self.path_model}
        try:
            parsed = self.proto.parse(body if self.route != "count_tokens" else {"max_tokens": 1, **body},
                                      server.profile.default_max_tokens)
        except wire.BadRequest as exc:
            return self._error(400, str(exc), error="bad_request")
        self.record["model"] = parsed.model
        if parsed.model not in server.engines:
            message, param, code = self.proto.model_missing(parsed.model)
            return self._error(404, message, error="not_found_model", param=param, code=code)
        n_in = sum(estimate_tokens(t) for t in parsed.texts)
        self.record["input_tokens"] = n_in
        if self.route == "count_tokens":
            self.record["status"] = 200
            server._write_truth(self.record)
            self._json({"input_tokens": n_in})
            return True
        profile = server.profile
        if not 1 <= parsed.max_tokens <= profile.max_output_tokens:
            return self._error(400, f"max_tokens: must be between 1 and {profile.max_output_tokens}, got {parsed.max_tokens}",
                               error="bad_request", param="max_tokens")
        if profile.max_concurrency and server.in_flight >= profile.max_concurrency:
            return self._rate_limited(1.0, "concurrency")
        wait = server.limiter.check(n_in + parsed.max_tokens)
        self.rate_headers = rate_limit_headers(server.limiter.state(), self.proto.anthropic_headers)
        if wait is not None:
            return self._rate_limited(wait, "rate")
        return await self._generate(parsed, n_in, body)

    def _rate_limited(self, wait: float, what: str) -> bool:
        headers = [("retry-after", retry_after_header(wait))]
        if not self.proto.anthropic_headers:  # the OpenAI SDK reads the finer form first
            headers.append(("retry-after-ms", f"{wait * 1000:.0f}"))
        message = ("Number of concurrent connections has exceeded your rate limit." if what == "concurrency"
                   else "This request would exceed your organization's rate limit. Please try again later.")
        return self._error(429, message, headers=headers, error="rate_limited", code="rate_limit_exceeded")

    def _plan_output(self, parsed: wire.Parsed) -> tuple[int, int, bool]:
        """Output length (max_tokens or an early stop), thinking tokens, and whether it stopped early."""
        p, rng = self.server.profile, self.server.rng
        n_out, early = parsed.max_tokens, False
        floor = max(1, min(parsed.min_tokens, parsed.max_tokens))
        if not parsed.ignore_eos and p.eos_probability and rng.random() < p.eos_probability:
            if p.eos_distribution == "uniform":
                draw = rng.uniform(floor, parsed.max_tokens)
            elif p.eos_distribution == "exponential":
                draw = rng.expovariate(1 / p.eos_mean_tokens)
            else:
                draw = rng.lognormvariate(0, p.eos_sigma) * p.eos_mean_tokens
            n_out = min(max(round(draw), floor), parsed.max_tokens)
            early = n_out < parsed.max_tokens
        n_think = 0
        if parsed.thinking and n_out > 1:
            budget = parsed.thinking_budget if isinstance(parsed.thinking_budget, int) else p.thinking_tokens
            n_think = max(0, min(p.thinking_tokens, budget, n_out - 1))
        return n_out, n_think, early

    async def _generate(self, parsed: wire.Parsed, n_in: int, body: dict[str, Any]) -> bool:
        server, request, writer = self.server, self.request, self.writer
        n_out, n_think, early = self._plan_output(parsed)
        rates = server.profile.faults if parsed.stream else {}
        try:
            faults = FaultPlan.build(markers_in(parsed.texts), rates, server.rng, n_out)
        except ValueError as exc:
            return self._error(400, f"fault marker: {exc}", error="bad_request")
        engine = server.engines[parsed.model]
        cache_read, cache_written = engine.cache.use(parsed.texts[:parsed.cacheable])
        plan = wire.Plan(self.request_id, parsed.model, n_in, n_out, n_think, early,
                         include_usage=parsed.include_usage,
                         unicode=faults.has("unicode"), offset=server.rng.randrange(1 << 16),
                         cache_read=cache_read, cache_creation=cache_written)
        self.record.update(fault=faults.describe(), planned_output_tokens=n_out, thinking_tokens=n_think,
                           max_tokens=parsed.max_tokens, stream=parsed.stream, cached_tokens=cache_read,
                           cache_creation_tokens=cache_written, model_size_b=size_from_id(parsed.model),
                           model_scale=engine.model_scale)
        action = faults.action
        if action == "status":
            code = int(faults.num("status", "code"))
            headers = [("retry-after", "1")] if code == 429 else []
            return self._error(code, "Injected fault", headers=headers, error="fault",
                               body=faults.specs["status"]["body"] == "json")
        if action == "html":
            self.record.update(status=int(faults.num("html", "code")), error="fault")
            server._write_truth(self.record)
            self.server._html(writer, int(faults.num("html", "code")), request, self._id_headers)
            return True
        if faults.has("slow_headers"):
            await asyncio.sleep(faults.num("slow_headers", "seconds"))
        if engine.profile.max_queue and len(engine.waiting) >= engine.profile.max_queue:
            status, message = self.proto.overloaded
            return self._error(status, message, error="overloaded")
        sse = wire.SSE(b"\r\n" if faults.has("crlf") else b"\r" if faults.has("cr") else b"\n",
                       space=not faults.has("nospace"), multiline=faults.has("multiline"), comments=faults.has("comments"))
        if faults.has("pad"):
            sse.pad_next(int(faults.num("pad", "bytes")))
        framer = self.proto(plan, sse, no_usage=faults.has("no_usage"))
        self.record["status"] = 200
        if not parsed.stream or action == "json_body":
            return await self._run_body(engine, framer)
        seq = StreamSequence(n_in, n_out, writer.transport, framer, faults)
        seq.n_cached = cache_read
        writer.write(_head(200, [("content-type", "text/event-stream; charset=utf-8"), ("cache-control", "no-cache"),
                                 ("transfer-encoding", "chunked"), *self._id_headers]))
        if action == "silence":
            await asyncio.sleep(faults.num("silence", "seconds"))
            self.record.update(error="fault")
            server._write_truth(self.record)
            writer.transport.close()
            return False
        if server.profile.preamble == "arrival":
            seq.send_preamble()
        seq.on_end = lambda: self._ended(seq, parsed.model)
        keep = await self._run(engine, seq)
        return keep and request.keep_alive

    async def _run(self, engine: Engine, seq: StreamSequence | BodySequence) -> bool:
        """Submit to the engine and wait for the end; the sequence's on_end hook records it."""
        server = self.server
        server.in_flight += 1
        try:
            engine.submit(seq)
            return await seq.done
        finally:
            server.in_flight -= 1

    def _ended(self, seq: StreamSequence | BodySequence, model: str) -> None:
        """Truth line and metrics of a generation, written before its last bytes go out."""
        self.record.update(admitted=seq.admitted, first_token=seq.first_token, last_token=seq.last_token,
                           output_tokens=seq.emitted, replica=seq.replica, outcome=seq.outcome,
                           queue_s=None if seq.admitted is None else seq.admitted - seq.arrival)
        metrics = self.server.metrics
        metrics.prompt_tokens[model] += seq.n_input
        metrics.generation_tokens[model] += seq.emitted
        if seq.admitted is not None:
            metrics.observe("vllm:request_queue_time_seconds", model, seq.admitted - seq.arrival)
        if seq.first_token is not None and seq.last_token is not None:
            metrics.observe("vllm:time_to_first_token_seconds", model, seq.first_token - self.request.arrival)
            metrics.observe("vllm:e2e_request_latency_seconds", model, seq.last_token - self.request.arrival)
            if seq.emitted > 1:
                tpot = (seq.last_token - seq.first_token) / (seq.emitted - 1)
                metrics.observe("vllm:time_per_output_token_seconds", model, tpot)
        metrics.requests[(model, "stop" if seq.emitted == seq.n_out else "abort")] += 1
        self.server._write_truth(self.record)

    async def _run_body(self, engine: Engine, framer: wire.Framer) -> bool:
        seq = BodySequence(framer.plan.input_tokens, framer.plan.n_out, self.writer.transport)
        seq.n_cached = framer.plan.cache_read

        def on_end() -> None:
            self._ended(seq, framer.plan.model)
            if seq.outcome == "ok":
                self._json(framer.body())

        seq.on_end = on_end
        keep = await self._run(engine, seq)
        return keep and self.request.keep_alive
