"""The three wire protocols: request parsing, SSE framing, non-stream and error bodies.

One class per protocol, and the only place its JSON shapes are written. An
instance frames one response: `preamble()` (message_start / role chunk /
response.created), `token(i)` for output token i (block transitions included),
`end()`, `error_event()`, `malformed()` and `body()` for non-stream requests.
Token events are built from precomputed byte templates because they are the
simulator's hot path; the other events go through `json.dumps`.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenload.tokens import synth_prompt

_WORDS = synth_prompt(509, seed=7).split()
_UNICODE_WORDS = ["naïve", "café", "über", "日本語", "данные", "λόγος", "façade", "smörgåsbord", "中文", "emoji"]


def _json_str(text: str) -> bytes:
    """`text` JSON-escaped without the surrounding quotes, as UTF-8."""
    return json.dumps(text, ensure_ascii=False)[1:-1].encode()


_ASCII_TABLES = ([_json_str(w) for w in _WORDS], [_json_str(" " + w) for w in _WORDS])
_UNICODE_TABLES = ([_json_str(w) for w in _UNICODE_WORDS], [_json_str(" " + w) for w in _UNICODE_WORDS])


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class BadRequest(Exception):
    """The body is not a valid request for the protocol: 400 with this message."""


@dataclass
class Plan:
    """What the engine decided for one request, shared by all framers."""

    request_id: str
    model: str
    input_tokens: int
    n_out: int
    n_think: int
    stopped_early: bool
    include_usage: bool = True
    unicode: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    offset: int = 0
    cache_read: int = 0  # of input_tokens, read from the prefix cache
    cache_creation: int = 0  # of input_tokens, written to it (Anthropic reports it)

    def words(self, start: int, stop: int) -> str:
        """Decoded text of output tokens [start, stop)."""
        table = _UNICODE_WORDS if self.unicode else _WORDS
        return " ".join(table[(self.offset + i) % len(table)] for i in range(start, stop))


@dataclass
class Parsed:
    """The fields of a request body the simulator acts on."""

    model: str
    texts: list[str]
    stream: bool
    max_tokens: int
    thinking: bool
    thinking_budget: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_usage: bool = True
    cacheable: int | None = None  # leading texts that may be cached: None = all (automatic caching)


class SSE:
    """SSE event encoder with the framing variants a fault plan may ask for."""

    def __init__(self, eol: bytes = b"\n", space: bool = True, multiline: bool = False, comments: bool = False) -> None:
        sep = b": " if space else b":"
        self.eol = eol
        self._event = b"event" + sep
        self._data = b"data" + sep
        self._end = eol + eol
        self._multiline = multiline
        self._comment = b": keepalive" + eol if comments else b""
        self._pad = 0

    def pad_next(self, n: int) -> None:
        """Pad the next event's JSON with `n` trailing spaces (valid JSON, one huge event)."""
        self._pad = n

    def event(self, name: bytes | None, data: bytes) -> bytes:
        if self._pad:
            data, self._pad = data + b" " * self._pad, 0
        return self._frame(name, data)

    def template(self, name: bytes | None, *parts: bytes) -> list[bytes]:
        """The event around `parts` joined by holes, split at the holes, so a token is one join.

        `event(name, p0 + x + p1)` equals `t0 + x + t1` as long as `p0` holds the
        comma a multiline split cuts at (every token layout starts with one) and
        no pad is pending; padding is the first event's only, never a token's.
        """
        return self._frame(name, b"\0".join(parts)).split(b"\0")

    def _frame(self, name: bytes | None, data: bytes) -> bytes:
        if self._multiline and b"," in data:
            head, _, tail = data.partition(b",")
            data = head + b"," + self.eol + self._data + tail
        head = self._comment + (self._event + name + self.eol if name else b"")
        return head + self._data + data + self._end


def _texts(obj: Any) -> list[str]:
    """Every prompt string inside a message content value (str, blocks, nested tool results)."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, list):
        return [t for item in obj for t in _texts(item)]
    if isinstance(obj, dict):
        return _texts(obj.get("text")) + _texts(obj.get("content"))
    return []


def _breakpoint(objs: list[Any]) -> int:
    """How many leading texts (in `_texts` order) end at the last `cache_control` breakpoint; 0 without one."""
    n = last = 0

    def walk(obj: Any) -> None:
        nonlocal n, last
        if isinstance(obj, str):
            n += 1
        elif isinstance(obj, list):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            walk(obj.get("text"))
            walk(obj.get("content"))
            if obj.get("cache_control"):
                last = n

    walk(objs)
    return last


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{key}: expected a non-negative integer")
    return value


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: Field required")
    return model


class Framer:
    """Shared shape of the three framers; subclasses own every JSON layout.

    The class attributes say how the vendor's server answers around the stream; the defaults are OpenAI's,
    which most servers and relays copy.
    """

    name: ClassVar[str]  # the protocol's name (`tokenload.protocolspec.SPECS`)
    stop_reasons: ClassVar[tuple[str, str]]  # (early stop, hit max_tokens)
    auth_error: ClassVar[tuple[str, str | None]] = ("Incorrect API key provided.", "invalid_api_key")  # message, code
    overloaded: ClassVar[tuple[int, str]] = (503, "The server is overloaded, please try again later.")
    anthropic_headers: ClassVar[bool] = False  # rate limits as anthropic-ratelimit-*, no retry-after-ms

    @classmethod
    def model_missing(cls, model: str) -> tuple[str, str | None, str | None]:
        """The 404 for a model the server does not serve: its message, the error's `param` and `code`."""
        return f"The model `{model}` does not exist", "model", "model_not_found"

    def __init__(self, plan: Plan, sse: SSE, no_usage: bool = False) -> None:
        self.plan = plan
        self.sse = sse
        self.no_usage = no_usage
        self._first, self._rest = _UNICODE_TABLES if plan.unicode else _ASCII_TABLES

    def _word(self, i: int, block_start: int) -> bytes:
        table = self._first if i == block_start else self._rest
        return table[(self.plan.offset + i) % len(table)]

    @property
    def stop_reason(self) -> str:
        return self.stop_reasons[0] if self.plan.stopped_early else self.stop_reasons[1]

    @classmethod
    def parse(cls, body: dict[str, Any], default_max_tokens: int) -> Parsed:
        raise NotImplementedError

    @classmethod
    def error_body(cls, status: int, message: str, request_id: str, **extra: str | None) -> bytes:
        raise NotImplementedError

    def preamble(self) -> bytes:
        raise NotImplementedError

    def token(self, i: int) -> bytes:
        raise NotImplementedError

    def end(self) -> bytes:
        raise NotImplementedError

    def error_event(self) -> bytes:
        raise NotImplementedError

    def malformed(self) -> bytes:
        """A data line whose JSON is cut short, as a broken proxy would write it."""
        return self.sse.event(None, b'{"type":"content_block_delta","index":0,"delta":{"type":"te')

    def body(self) -> dict[str, Any]:
        raise NotImplementedError


_ANTHROPIC_ERRORS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 529: "overloaded_error",
}


class AnthropicFramer(Framer):
    name = "anthropic"
    stop_reasons = ("end_turn", "max_tokens")
    auth_error = ("invalid x-api-key", None)
    overloaded = (529, "Overloaded")
    anthropic_headers = True

    @classmethod
    def model_missing(cls, model: str) -> tuple[str, str | None, str | None]:
        return f"model: {model}", None, None

    def __init__(self, plan: Plan, sse: SSE, no_usage: bool = False) -> None:
        super().__init__(plan, sse, no_usage)
        self.msg_id = "msg_" + plan.request_id[4:]
        self._text_index = 1 if plan.n_think else 0
        self._think_pre = b'{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"'
        self._text_pre = (
            b'{"type":"content_block_delta","index":%d,"delta":{"type":"text_delta","text":"' % self._text_index
        )
        self._think_event = sse.template(b"content_block_delta", self._think_pre, b'"}}')
        self._text_event = sse.template(b"content_block_delta", self._text_pre, b'"}}')

    @classmethod
    def parse(cls, body: dict[str, Any], default_max_tokens: int) -> Parsed:
        max_tokens = _int(body, "max_tokens", None)
        if max_tokens is None:
            raise BadRequest("max_tokens: Field required")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: Field required")
        thinking = body.get("thinking") or {}
        enabled = isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
        contents = [body.get("system")] + [m.get("content") for m in messages if isinstance(m, dict)]
        return Parsed(
            model=_model(body),
            texts=[t for c in contents for t in _texts(c)],
            stream=bool(body.get("stream", False)),
            max_tokens=max_tokens,
            thinking=enabled,
            thinking_budget=thinking.get("budget_tokens") if enabled else None,
            cacheable=_breakpoint(contents),  # Anthropic caches only up to an explicit breakpoint
        )

    @classmethod
    def error_body(cls, status: int, message: str, request_id: str, **extra: str | None) -> bytes:
        etype = _ANTHROPIC_ERRORS.get(status, "api_error")
        return dumps({"type": "error", "error": {"type": etype, "message": message}, "request_id": request_id})

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None, output_tokens: int) -> dict[str, Any]:
        return {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.plan.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": None,
            "usage": {"input_tokens": self.plan.input_tokens - self.plan.cache_read - self.plan.cache_creation,
                      "cache_creation_input_tokens": self.plan.cache_creation,
                      "cache_read_input_tokens": self.plan.cache_read, "output_tokens": output_tokens},
        }

    def preamble(self) -> bytes:
        start = {"type": "message_start", "message": self._message([], None, 1)}
        return self.sse.event(b"message_start", dumps(start)) + self.sse.event(b"ping", b'{"type": "ping"}')

    def _block_start(self, index: int, block: dict[str, Any]) -> bytes:
        event = {"type": "content_block_start", "index": index, "content_block": block}
        return self.sse.event(b"content_block_start", dumps(event))

    def _block_stop(self, index: int) -> bytes:
        return self.sse.event(b"content_block_stop", b'{"type":"content_block_stop","index":%d}' % index)

    def token(self, i: int) -> bytes:
        n_think = self.plan.n_think
        if i < n_think:
            head = self._block_start(0, {"type": "thinking", "thinking": "", "signature": ""}) if i == 0 else b""
            before, after = self._think_event
            return head + before + self._word(i, 0) + after
        head = b""
        if i == n_think:
            if n_think:
                signature = {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "signature_delta", "signature": "sig_" + self.msg_id}}
                head = self.sse.event(b"content_block_delta", dumps(signature)) + self._block_stop(0)
            head += self._block_start(self._text_index, {"type": "text", "text": ""})
        before, after = self._text_event
        return head + before + self._word(i, n_think) + after

    def end(self) -> bytes:
        delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": None}}
        if not self.no_usage:
            delta["usage"] = {"output_tokens": self.plan.n_out}
        return (
            self._block_stop(self._text_index)
            + self.sse.event(b"message_delta", dumps(delta))
            + self.sse.event(b"message_stop", b'{"type":"message_stop"}')
        )

    def error_event(self) -> bytes:
        body = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
        return self.sse.event(b"error", dumps(body))

    def body(self) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if self.plan.n_think:
            content.append({"type": "thinking", "thinking": self.plan.words(0, self.plan.n_think), "signature": "sig_" + self.msg_id})
        content.append({"type": "text", "text": self.plan.words(self.plan.n_think, self.plan.n_out)})
        return self._message(content, self.stop_reason, self.plan.n_out)


def _openai_error(status: int, message: str, code: str | None, param: str | None) -> bytes:
    etype = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             429: "rate_limit_error" if code != "insufficient_quota" else "insufficient_quota"}.get(status, "server_error")
    return dumps({"error": {"message": message, "type": etype, "param": param, "code": code}})


class OpenAIChatFramer(Framer):
    name = "openai-chat"
    stop_reasons = ("stop", "length")

    def __init__(self, plan: Plan, sse: SSE, no_usage: bool = False) -> None:
        super().__init__(plan, sse, no_usage)
        self.chat_id = "chatcmpl-" + plan.request_id[4:]
        head = b'{"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,"choices":[{"index":0,"delta":{' % (
            self.chat_id.encode(), plan.created, dumps(plan.model))
        self._head = head
        self._think_pre = head + b'"reasoning_content":"'
        self._text_pre = head + b'"content":"'
        self._tail = b'"},"logprobs":null,"finish_reason":null}]}'
        self._think_event = sse.template(None, self._think_pre, self._tail)
        self._text_event = sse.template(None, self._text_pre, self._tail)

    @classmethod
    def parse(cls, body: dict[str, Any], default_max_tokens: int) -> Parsed:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: Field required")
        max_tokens = _int(body, "max_completion_tokens", None)
        max_tokens = _int(body, "max_tokens", max_tokens if max_tokens is not None else default_max_tokens)
        effort = body.get("reasoning_effort")
        options = body.get("stream_options") or {}
        return Parsed(
            model=_model(body),
            texts=[t for m in messages if isinstance(m, dict) for t in _texts(m.get("content"))],
            stream=bool(body.get("stream", False)),
            max_tokens=max_tokens or default_max_tokens,
            thinking=effort not in (None, "none", "minimal"),
            min_tokens=_int(body, "min_tokens", 0) or 0,
            ignore_eos=bool(body.get("ignore_eos", False)),
            include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        )

    @classmethod
    def error_body(cls, status: int, message: str, request_id: str, **extra: str | None) -> bytes:
        return _openai_error(status, message, extra.get("code"), extra.get("param"))

    def preamble(self) -> bytes:
        return self.sse.event(None, self._head + b'"role":"assistant","content":""' + self._tail[1:])

    def token(self, i: int) -> bytes:
        n_think = self.plan.n_think
        if i < n_think:
            before, after = self._think_event
            return before + self._word(i, 0) + after
        before, after = self._text_event
        return before + self._word(i, n_think) + after

    def _usage(self) -> dict[str, Any]:
        n_in, n_out = self.plan.input_tokens, self.plan.n_out
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
                "prompt_tokens_details": {"cached_tokens": self.plan.cache_read},
                "completion_tokens_details": {"reasoning_tokens": self.plan.n_think}}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {"id": self.chat_id, "object": "chat.completion.chunk", "created": self.plan.created,
                 "model": self.plan.model, "choices": choices, **extra}
        return self.sse.event(None, dumps(chunk))

    def end(self) -> bytes:
        out = self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.stop_reason}])
        if self.plan.include_usage and not self.no_usage:
            out += self._chunk([], usage=self._usage())
        return out + self.sse.event(None, b"[DONE]")

    def error_event(self) -> bytes:
        return self.sse.event(None, _openai_error(503, "The server is overloaded, please try again later.", None, None))

    def body(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.plan.words(self.plan.n_think, self.plan.n_out)}
        if self.plan.n_think:
            message["reasoning_content"] = self.plan.words(0, self.plan.n_think)
        return {"id": self.chat_id, "object": "chat.completion", "created": self.plan.created, "model": self.plan.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": self.stop_reason}],
                "usage": self._usage()}


class OpenAIResponsesFramer(Framer):
    name = "openai-responses"
    # The contract ends every stream with response.completed, also at the token limit.
    stop_reasons = ("completed", "completed")

    def __init__(self, plan: Plan, sse: SSE, no_usage: bool = False) -> None:
        super().__init__(plan, sse, no_usage)
        self.resp_id = "resp_" + plan.request_id[4:]
        self.msg_item = "msg_" + plan.request_id[4:]
        self.rs_item = "rs_" + plan.request_id[4:]
        self._msg_index = 1 if plan.n_think else 0
        self.seq = 0
        self._think_pre = (b',"item_id":"%s","output_index":0,"content_index":0,"delta":"' % self.rs_item.encode())
        self._text_pre = (b',"item_id":"%s","output_index":%d,"content_index":0,"delta":"'
                          % (self.msg_item.encode(), self._msg_index))
        self._think_event = self._delta_template(b"response.reasoning_text.delta", self._think_pre)
        self._text_event = self._delta_template(b"response.output_text.delta", self._text_pre)

    @classmethod
    def parse(cls, body: dict[str, Any], default_max_tokens: int) -> Parsed:
        if "input" not in body:
            raise BadRequest("input: Field required")
        reasoning = body.get("reasoning") or {}
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        return Parsed(
            model=_model(body),
            texts=_texts(body.get("instructions")) + _texts(body.get("input")),
            stream=bool(body.get("stream", False)),
            max_tokens=_int(body, "max_output_tokens", default_max_tokens) or default_max_tokens,
            thinking=effort not in (None, "none", "minimal"),
        )

    @classmethod
    def error_body(cls, status: int, message: str, request_id: str, **extra: str | None) -> bytes:
        return _openai_error(status, message, extra.get("code"), extra.get("param"))

    def _event(self, etype: str, **fields: Any) -> bytes:
        event = {"type": etype, "sequence_number": self.seq, **fields}
        self.seq += 1
        return self.sse.event(etype.encode(), dumps(event))

    def _reasoning_item(self, status: str) -> dict[str, Any]:
        text = self.plan.words(0, self.plan.n_think) if status == "completed" else ""
        return {"id": self.rs_item, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message_item(self, status: str) -> dict[str, Any]:
        content = [self._text_part()] if status == "completed" else []
        return {"id": self.msg_item, "type": "message", "status": status, "role": "assistant", "content": content}

    def _text_part(self, text: str | None = None) -> dict[str, Any]:
        if text is None:
            text = self.plan.words(self.plan.n_think, self.plan.n_out)
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        output = []
        if status != "in_progress":
            output = ([self._reasoning_item("completed")] if self.plan.n_think else []) + [self._message_item("completed")]
        response: dict[str, Any] = {
            "id": self.resp_id, "object": "response", "created_at": self.plan.created, "status": status,
            "model": self.plan.model, "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "error": None, "incomplete_details": None, "usage": None, **extra,
        }
        if status == "completed" and not self.no_usage:
            n_in, n_out = self.plan.input_tokens, self.plan.n_out
            response["usage"] = {
                "input_tokens": n_in, "input_tokens_details": {"cached_tokens": self.plan.cache_read},
                "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": self.plan.n_think},
                "total_tokens": n_in + n_out,
            }
        return response

    def preamble(self) -> bytes:
        in_progress = self._response("in_progress")
        return (self._event("response.created", response=in_progress)
                + self._event("response.in_progress", response=in_progress))

    def _delta_template(self, etype: bytes, pre: bytes) -> tuple[bytes, bytes, bytes]:
        """A delta event split around its two varying fields: sequence number and word."""
        head, mid, tail = self.sse.template(etype, b'{"type":"' + etype + b'","sequence_number":', pre, b'","logprobs":[]}')
        return head, mid, tail

    def _delta(self, template: tuple[bytes, bytes, bytes], word: bytes) -> bytes:
        head, mid, tail = template
        seq = self.seq
        self.seq = seq + 1
        return b"%b%d%b%b%b" % (head, seq, mid, word, tail)

    def token(self, i: int) -> bytes:
        n_think = self.plan.n_think
        if i < n_think:
            head = b""
            if i == 0:
                head = self._event("response.output_item.added", output_index=0, item=self._reasoning_item("in_progress"))
            return head + self._delta(self._think_event, self._word(i, 0))
        head = b""
        if i == n_think:
            if n_think:
                head = (self._event("response.reasoning_text.done", item_id=self.rs_item, output_index=0, content_index=0,
                                    text=self.plan.words(0, n_think))
                        + self._event("response.output_item.done", output_index=0, item=self._reasoning_item("completed")))
            head += (self._event("response.output_item.added", output_index=self._msg_index, item=self._message_item("in_progress"))
                     + self._event("response.content_part.added", item_id=self.msg_item, output_index=self._msg_index,
                                   content_index=0, part=self._text_part("")))
        return head + self._delta(self._text_event, self._word(i, n_think))

    def end(self) -> bytes:
        text = self.plan.words(self.plan.n_think, self.plan.n_out)
        where = {"item_id": self.msg_item, "output_index": self._msg_index, "content_index": 0}
        return (
            self._event("response.output_text.done", **where, text=text, logprobs=[])
            + self._event("response.content_part.done", **where, part=self._text_part(text))
            + self._event("response.output_item.done", output_index=self._msg_index, item=self._message_item("completed"))
            + self._event("response.completed", response=self._response("completed"))
        )

    def error_event(self) -> bytes:
        error = {"code": "server_error", "message": "The server is overloaded, please try again later."}
        return self._event("response.failed", response=self._response("failed", error=error) | {"output": []})

    def body(self) -> dict[str, Any]:
        return self._response("completed")


PROTOCOLS: dict[str, type[Framer]] = {p.name: p for p in (AnthropicFramer, OpenAIChatFramer, OpenAIResponsesFramer)}


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)
