"""Protocol adapters and measurement over real HTTP, against scripted streams with known timing.

The fake server (tests/fakeserver.py) plays exact bytes with exact delays, so
TTFT/TPOT/e2e have a known truth; bounds are generous because these machines
are noisy. The official SDKs parse the same streams first, which proves the
fixture speaks the real wire formats.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
import zlib
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from fakeserver import (
    FakeServer,
    Script,
    Write,
    anthropic_stream,
    api_base,
    body_script,
    json_script,
    rechunk,
    sse,
    stream_script,
)

from tokenload import errors as ek
from tokenload.channel import Channel
from tokenload.measure import TOKEN_TEXT, TOKEN_THINKING, Timeline, formula, measure
from tokenload.protocolspec import PROTOCOLS
from tokenload.tokens import estimate_tokens
from tokenload.transport.httpx_client import stream_once

KEY = "sk-test-KEYkey-0123456789abcdef"
PROMPT = "Say hello to the test suite, please."
TOKENS = ["Hel", "lo", ", wö", "rld", " 😀", "!"]


def channel_for(server: FakeServer, protocol: str, **fields: Any) -> Channel:
    return Channel(base_url=api_base(server.url, protocol), protocol=protocol, api_key=KEY, **fields)


def probe(server: FakeServer, protocol: str, *scripts: Script, **fields: Any) -> tuple[dict[str, Any], str]:
    """Play `scripts`, send one request; the record and the streamed text."""
    server.play(*scripts)
    text: list[str] = []
    record = stream_once(channel_for(server, protocol, **fields), PROMPT, 32, on_text=lambda t, kind: text.append(t))
    assert record["error_kind"] != ek.CLIENT_ERROR, record["error_message"]
    return record, "".join(text)


def inject(writes: list[Write], at: int, data: bytes) -> list[Write]:
    return [*writes[:at], (0.0, data), *writes[at:]]


def first_token_index(writes: list[Write]) -> int:
    """Index of the first write that carries a token (the first delayed one in a scripted stream)."""
    return next(i for i, (delay, _) in enumerate(writes) if delay > 0)


def no_delays(writes: list[Write]) -> list[Write]:
    return [(0.0, data) for _, data in writes]


# ---------------------------------------------------------- fixture fidelity


def test_anthropic_sdk_parses_fixture_stream(fake_server: FakeServer) -> None:
    fake_server.play(stream_script("anthropic", TOKENS, thinking=["Let me", " think."]))
    client = anthropic.Anthropic(base_url=fake_server.url + "/api", api_key=KEY, max_retries=0)
    with client.messages.stream(model="claude-test", max_tokens=32, messages=[{"role": "user", "content": PROMPT}]) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == "".join(TOKENS)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Let me think."  # type: ignore[union-attr]
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == ("end_turn", 12, 8)
    assert fake_server.last.path == "/api/v1/messages"
    _, ours = probe(fake_server, "anthropic", stream_script("anthropic", TOKENS, thinking=["Let me", " think."]))
    assert ours == "Let me think." + text


def test_openai_sdk_parses_fixture_chat_stream(fake_server: FakeServer) -> None:
    fake_server.play(stream_script("openai-chat", TOKENS))
    client = openai.OpenAI(base_url=fake_server.url + "/v1", api_key=KEY, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": PROMPT}], stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(TOKENS)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(TOKENS)
    _, ours = probe(fake_server, "openai-chat", stream_script("openai-chat", TOKENS))
    assert ours == text


def test_openai_sdk_parses_fixture_responses_stream(fake_server: FakeServer) -> None:
    fake_server.play(stream_script("openai-responses", TOKENS))
    client = openai.OpenAI(base_url=fake_server.url + "/v1", api_key=KEY, max_retries=0)
    events = list(client.responses.create(model="gpt-test", input=PROMPT, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == "".join(TOKENS)
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output_text == text and final.response.usage.output_tokens == len(TOKENS)  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    _, ours = probe(fake_server, "openai-responses", stream_script("openai-responses", TOKENS))
    assert ours == text


# ----------------------------------------------------------- timing truths


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ttft_tpot_e2e_match_scripted_delays(fake_server: FakeServer, protocol: str) -> None:
    first, per, n = 0.3, 0.06, len(TOKENS)
    record, text = probe(fake_server, protocol, stream_script(protocol, TOKENS, first, per))
    assert record["status"] == "ok" and text == "".join(TOKENS)
    assert 0.27 <= record["ttft_s"] <= first + 1.0
    assert 0.5 * per <= record["tpot_s"] <= per + 0.15
    assert first + (n - 1) * per - 0.02 <= record["e2e_s"] <= first + (n - 1) * per + 1.5
    assert record["ttft_s"] == record["ttft_text_s"]
    assert record["e2e_s"] - record["ttft_s"] == pytest.approx(record["tpot_s"] * (n - 1))
    assert record["chunks"] == n and record["output_tokens"] == n
    assert 0.3 * per <= record["itl_p50_s"] <= per + 0.15
    assert record["itl_max_s"] >= record["itl_p99_s"] >= record["itl_p50_s"]
    assert record["ttfb_s"] < record["ttft_s"]
    assert record["http_status"] == 200 and record["malformed_events"] == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_preamble_role_chunk_and_pings_are_not_tokens(fake_server: FakeServer, protocol: str) -> None:
    """message_start, the role-only chunk, response.created and pings arrive at once; TTFT waits for content."""
    writes = stream_script(protocol, TOKENS[:3], 0.4, 0.01).writes
    i = first_token_index(list(writes))
    ping = sse({"type": "ping"}, "ping") if protocol == "anthropic" else b": ping\n\n"
    writes = [*writes[:i], (0.0, ping), (0.0, b": keepalive\n\n"), *writes[i:]]
    record, _ = probe(fake_server, protocol, Script(writes=writes))
    assert record["status"] == "ok"
    assert record["ttft_s"] - record["ttfb_s"] >= 0.3  # not the first byte, not the first event
    assert record["chunks"] == 3


@pytest.mark.parametrize(
    ("protocol", "kw"),
    [("anthropic", {"thinking": ["Let", " me", " see"]}), ("openai-chat", {"reasoning": ["Let", " me", " see"]})],
)
def test_thinking_deltas_are_tokens_and_ttft_text_comes_later(fake_server: FakeServer, protocol: str, kw: dict[str, Any]) -> None:
    kinds: list[str] = []
    fake_server.play(stream_script(protocol, ["Hi", " there"], 0.1, 0.15, **kw))
    record = stream_once(channel_for(fake_server, protocol), PROMPT, 32, on_text=lambda t, kind: kinds.append(kind))
    assert record["status"] == "ok"
    assert kinds == [TOKEN_THINKING] * 3 + [TOKEN_TEXT] * 2
    assert record["chunks"] == 5 and record["thinking_chunks"] == 3 and record["output_tokens"] == 5
    assert record["ttft_text_s"] - record["ttft_s"] >= 0.35  # three thinking gaps of 0.15 s before the text


@pytest.mark.parametrize(
    ("protocol", "kw", "output", "out_source", "in_source"),
    [
        ("anthropic", {"output_tokens": 40, "input_tokens": 77}, 40, "server", "server"),
        ("anthropic", {"usage": False}, 3, "chunks", "estimate"),
        ("openai-chat", {"output_tokens": 40, "input_tokens": 77}, 40, "server", "server"),
        ("openai-chat", {"include_usage": False}, 3, "chunks", "estimate"),
        ("openai-responses", {"output_tokens": 40, "input_tokens": 77}, 40, "server", "server"),
    ],
    ids=["anthropic-usage", "anthropic-no-usage", "chat-usage", "chat-no-usage", "responses-usage"],
)
def test_token_counts_and_their_source(
    fake_server: FakeServer, protocol: str, kw: dict[str, Any], output: int, out_source: str, in_source: str
) -> None:
    record, _ = probe(fake_server, protocol, stream_script(protocol, ["a", "b", "c"], 0.0, 0.02, **kw))
    assert record["status"] == "ok"
    assert (record["output_tokens"], record["output_tokens_source"]) == (output, out_source)
    assert record["input_tokens_source"] == in_source
    assert record["input_tokens"] == (77 if in_source == "server" else estimate_tokens(PROMPT))
    assert record["chunks"] == 3
    assert record["tpot_s"] == pytest.approx((record["e2e_s"] - record["ttft_s"]) / (output - 1))


@pytest.mark.parametrize(
    ("protocol", "stop"),
    [("anthropic", {"stop_reason": "max_tokens"}), ("openai-chat", {"finish_reason": "length"}), ("openai-responses", {})],
)
def test_stop_reason_recorded(fake_server: FakeServer, protocol: str, stop: dict[str, str]) -> None:
    record, _ = probe(fake_server, protocol, stream_script(protocol, ["a"], **stop))
    assert record["stop_reason"] == (next(iter(stop.values())) if stop else "completed")


# -------------------------------------------------------------------- framing


def _gzip_writes(writes: list[Write]) -> list[Write]:
    comp = zlib.compressobj(wbits=31)
    out = [(delay, comp.compress(data) + comp.flush(zlib.Z_SYNC_FLUSH)) for delay, data in writes]
    return [*out, (0.0, comp.flush())]


FRAMINGS: dict[str, Callable[[list[Write]], Script]] = {
    "one-byte-writes": lambda w: Script(writes=rechunk(w, 1)),
    "crlf": lambda w: Script(writes=[(d, b.replace(b"\n", b"\r\n")) for d, b in w]),
    "cr-only": lambda w: Script(writes=[(d, b.replace(b"\n", b"\r")) for d, b in w]),
    "crlf-3-byte-writes": lambda w: Script(writes=rechunk([(d, b.replace(b"\n", b"\r\n")) for d, b in w], 3)),
    "bom": lambda w: Script(writes=[(0.0, b"\xef\xbb\xbf"), *w]),
    "no-space-after-colon": lambda w: Script(writes=[(d, b.replace(b"data: ", b"data:").replace(b"event: ", b"event:")) for d, b in w]),
    "comments-between-events": lambda w: Script(writes=[(d, b": keepalive\n\n" + b) for d, b in w]),
    "trailing-spaces-in-json": lambda w: Script(writes=[(d, b.replace(b"}\n", b"}   \n")) for d, b in w]),
    "whole-body-one-write": lambda w: Script(writes=[(0.0, b"".join(b for _, b in w))]),
    "no-length-close-delimited": lambda w: Script(writes=w, framing="close"),
    "gzip": lambda w: Script(headers=(("content-type", "text/event-stream"), ("content-encoding", "gzip")), writes=_gzip_writes(w)),
}


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_framing_variants_give_the_same_answer(fake_server: FakeServer, protocol: str, framing: str) -> None:
    writes = no_delays(list(stream_script(protocol, TOKENS).writes))
    record, text = probe(fake_server, protocol, FRAMINGS[framing](writes))
    assert (record["status"], record["error_kind"]) == ("ok", None)
    assert text == "".join(TOKENS)
    assert record["malformed_events"] == 0 and record["chunks"] == len(TOKENS)


# ---------------------------------------------------------- malformed events

BAD_LINE = b"data: {\"type\": \"content_block_delta\", \"delta\": {\"text\n\n"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_malformed_json_line_is_counted_not_fatal(fake_server: FakeServer, protocol: str) -> None:
    writes = list(stream_script(protocol, TOKENS).writes)
    writes = inject(writes, first_token_index(writes) + 1 if any(d for d, _ in writes) else 3, BAD_LINE)
    record, text = probe(fake_server, protocol, Script(writes=inject(writes, 2, b"data: [1, 2]\n\n")))
    assert record["status"] == "ok"
    assert record["malformed_events"] == 2
    assert text == "".join(TOKENS)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("ending", [b"", b"data: [DONE]\n\n"], ids=["eof", "done"])
def test_only_malformed_events_is_malformed_stream(fake_server: FakeServer, protocol: str, ending: bytes) -> None:
    writes = [(0.0, BAD_LINE), (0.0, b"data: not json at all\n\n"), (0.0, b"data:{'single': 'quotes'}\n\n"), (0.0, ending)]
    record, _ = probe(fake_server, protocol, Script(writes=writes))
    assert (record["status"], record["error_kind"]) == ("error", ek.MALFORMED_STREAM)
    assert record["malformed_events"] == 3


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_malformed_shapes_inside_valid_json_are_not_a_crash(fake_server: FakeServer, protocol: str) -> None:
    """Valid JSON with the wrong shapes (a string delta, a list of non-objects) is malformed, not a client_error."""
    junk = [
        {"type": "content_block_delta", "delta": "oops"},
        {"type": "message_start", "message": "x"},
        {"choices": ["x", None]},
        {"choices": [{"delta": "x"}]},
        {"type": "response.completed", "response": "x"},
        {"type": "response.output_text.delta", "delta": 5},
    ]
    writes = list(stream_script(protocol, TOKENS).writes)
    for obj in junk:
        writes = inject(writes, 2, sse(obj))
    record, text = probe(fake_server, protocol, Script(writes=writes))
    assert record["error_kind"] is None
    assert text == "".join(TOKENS)


# ---------------------------------------------------------- in-stream errors


def _anthropic_error(kind: str, message: str) -> bytes:
    return sse({"type": "error", "error": {"type": kind, "message": message}}, "error")


def _responses_failed(code: str, message: str) -> bytes:
    return sse({"type": "response.failed", "sequence_number": 9,
                "response": {"id": "resp_1", "status": "failed", "error": {"code": code, "message": message}}}, "response.failed")


@pytest.mark.parametrize(
    ("protocol", "event", "kind"),
    [
        ("anthropic", _anthropic_error("overloaded_error", "Overloaded"), ek.OVERLOADED),
        ("anthropic", _anthropic_error("api_error", "Internal server error"), ek.SERVER_ERROR),
        ("anthropic", _anthropic_error("rate_limit_error", "Too many requests"), ek.RATE_LIMITED),
        ("openai-chat", sse({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}}), ek.RATE_LIMITED),
        ("openai-chat", sse({"error": {"message": "The server had an error", "type": "server_error", "code": None}}), ek.SERVER_ERROR),
        ("openai-chat", sse({"error": {"message": "Engine overloaded"}}), ek.OVERLOADED),
        ("openai-responses", _responses_failed("server_error", "The model failed"), ek.SERVER_ERROR),
        ("openai-responses", _responses_failed("rate_limit_exceeded", "Quota hit for this minute"), ek.RATE_LIMITED),
        ("openai-responses", sse({"type": "error", "code": "server_error", "message": "Something went wrong", "param": None, "sequence_number": 5}, "error"), ek.SERVER_ERROR),
    ],
    ids=["anthropic-overloaded", "anthropic-api", "anthropic-rate", "chat-rate", "chat-server", "chat-overloaded",
         "responses-failed", "responses-failed-rate", "responses-error"],
)
def test_in_stream_error_events_are_classified(fake_server: FakeServer, protocol: str, event: bytes, kind: str) -> None:
    writes = no_delays(list(stream_script(protocol, TOKENS).writes))
    cut = first_token_index(list(stream_script(protocol, TOKENS, 0.1, 0.1).writes)) + 2  # two tokens, then the error
    record, text = probe(fake_server, protocol, Script(writes=[*writes[:cut], (0.0, event)], ending="complete"))
    assert (record["status"], record["error_kind"]) == ("error", kind)
    assert record["chunks"] == 2 and record["ttft_s"] is not None and text == "".join(TOKENS[:2])
    assert record["error_message"]


# ---------------------------------------------------------------- HTTP errors

HOME_PAGE = b"<!DOCTYPE html><html><head><title>Relay Dashboard</title></head><body>Welcome</body></html>"


def _anthropic_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_011"}


@pytest.mark.parametrize(
    ("script", "kind", "in_message"),
    [
        (json_script(401, _anthropic_body("authentication_error", "invalid x-api-key")), ek.AUTH, "invalid x-api-key"),
        (json_script(403, _anthropic_body("permission_error", "no access")), ek.AUTH, "no access"),
        (json_script(404, _anthropic_body("not_found_error", "model: claude-nope-9")), ek.NOT_FOUND_MODEL, "claude-nope-9"),
        (json_script(404, {"error": {"message": "The model `gpt-nope` does not exist or you do not have access to it.",
                                     "type": "invalid_request_error", "param": None, "code": "model_not_found"}}), ek.NOT_FOUND_MODEL, "gpt-nope"),
        (json_script(400, {"error": {"message": "模型不存在", "type": "invalid_request_error", "code": "model_not_found"}}), ek.NOT_FOUND_MODEL, "模型"),
        (body_script(200, HOME_PAGE), ek.BAD_BASE_URL, "Relay Dashboard"),
        (body_script(200, HOME_PAGE, "text/event-stream"), ek.BAD_BASE_URL, "Relay Dashboard"),
        (body_script(404, b"<html><head><title>404 Not Found</title></head></html>"), ek.BAD_BASE_URL, "404 Not Found"),
        (json_script(404, {"error": "Not Found"}), ek.BAD_BASE_URL, "Not Found"),
        (Script(status=301, headers=(("location", "https://elsewhere/"),), framing="length"), ek.BAD_BASE_URL, ""),
        (json_script(429, _anthropic_body("rate_limit_error", "slow down"), (("retry-after", "7"),)), ek.RATE_LIMITED, "slow down"),
        (json_script(529, _anthropic_body("overloaded_error", "Overloaded")), ek.OVERLOADED, "Overloaded"),
        (body_script(503, b"Service Unavailable", "text/plain"), ek.OVERLOADED, "Service Unavailable"),
        (body_script(500, b"", ""), ek.SERVER_ERROR, "empty"),
        (body_script(502, b"<html><title>502 Bad Gateway</title></html>"), ek.SERVER_ERROR, "502 Bad Gateway"),
        (json_script(400, _anthropic_body("invalid_request_error", "max_tokens: must be at least 1")), ek.BAD_REQUEST, "max_tokens"),
        (json_script(413, _anthropic_body("request_too_large", "Request exceeds the maximum size")), ek.BAD_REQUEST, "maximum size"),
        (json_script(200, {"id": "msg_1", "type": "message", "content": [{"type": "text", "text": "hi"}]}), ek.MALFORMED_STREAM, "not an event stream"),
    ],
    ids=["401", "403", "404-anthropic-model", "404-openai-model", "400-model-code", "html-200", "html-200-as-sse", "html-404",
         "404-json-path", "301", "429", "529", "503", "500-empty", "502-html", "400", "413", "json-200-not-stream"],
)
def test_http_errors_are_classified(fake_server: FakeServer, script: Script, kind: str, in_message: str) -> None:
    record, _ = probe(fake_server, "anthropic", script)
    assert (record["status"], record["error_kind"], record["http_status"]) == ("error", kind, script.status)
    assert in_message in record["error_message"]
    assert record["ttft_s"] is None and record["chunks"] == 0


def test_error_messages_never_carry_the_key(fake_server: FakeServer) -> None:
    """Relays echo the key they rejected, in HTTP bodies and in stream error events alike."""
    body = json_script(401, {"error": {"message": f"Invalid API key: {KEY}", "type": "invalid_request_error"}})
    record, _ = probe(fake_server, "openai-chat", body)
    assert record["error_kind"] == ek.AUTH and KEY not in record["error_message"] and "Invalid API key" in record["error_message"]
    event = sse({"error": {"message": f"key {KEY} suspended", "type": "server_error"}})
    record, _ = probe(fake_server, "openai-chat", Script(writes=[(0.0, event)]))
    assert record["status"] == "error" and KEY not in json.dumps(record)


# ---------------------------------------------------- disconnects and timeouts


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    "ending",
    [{"ending": "drop"}, {"ending": "complete", "framing": "close"}, {"ending": "reset"}],
    ids=["chunked-body-cut", "clean-eof", "tcp-reset"],
)
def test_mid_stream_disconnect_keeps_timings(fake_server: FakeServer, protocol: str, ending: dict[str, Any]) -> None:
    writes = list(stream_script(protocol, TOKENS, 0.05, 0.02).writes)
    cut = first_token_index(writes) + 3
    script = Script(writes=[*writes[:cut], (0.4, b"")], **ending)  # let the client read before the cut
    record, text = probe(fake_server, protocol, script)
    assert (record["status"], record["error_kind"]) == ("error", ek.DISCONNECTED)
    assert record["ttft_s"] is not None and record["e2e_s"] >= record["ttft_s"]
    assert record["chunks"] == 3 and text == "".join(TOKENS[:3])
    assert record["output_tokens_source"] == "chunks"  # message_start's provisional count is not a result


def _preamble(protocol: str) -> list[Write]:
    writes = list(stream_script(protocol, TOKENS, 0.1, 0.1).writes)
    return writes[: first_token_index(writes)]


@pytest.mark.parametrize(
    "script",
    [
        Script(writes=[], ending="hang"),
        Script(writes=_preamble("anthropic"), ending="hang"),
        Script(writes=[(0.0, sse({"type": "ping"}, "ping"))] + [(0.1, b": ping\n\n")] * 40, ending="hang"),
        Script(writes=anthropic_stream(["a"]), headers_delay_s=5.0),
    ],
    ids=["headers-then-silence", "message-start-then-silence", "pings-but-no-token", "slow-headers"],
)
def test_no_first_token_in_time_is_timeout_first_token(fake_server: FakeServer, script: Script) -> None:
    start = time.perf_counter()
    record, _ = probe(fake_server, "anthropic", script, first_token_timeout_s=0.6)
    elapsed = time.perf_counter() - start
    assert (record["status"], record["error_kind"]) == ("error", ek.TIMEOUT_FIRST_TOKEN)
    assert record["ttft_s"] is None
    assert 0.5 <= elapsed < 3.5  # the first-token timeout, not the 60 s idle timeout


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stall_after_tokens_is_timeout_stall(fake_server: FakeServer, protocol: str) -> None:
    writes = list(stream_script(protocol, TOKENS, 0.05, 0.02).writes)
    script = Script(writes=writes[: first_token_index(writes) + 2], ending="hang")
    start = time.perf_counter()
    record, _ = probe(fake_server, protocol, script, idle_timeout_s=0.6)
    assert (record["status"], record["error_kind"]) == ("error", ek.TIMEOUT_STALL)
    assert record["chunks"] == 2 and record["ttft_s"] is not None
    assert time.perf_counter() - start < 3.5


def test_slow_prefill_within_first_token_timeout_is_fine(fake_server: FakeServer) -> None:
    """A first token later than the idle timeout but within the first-token timeout is not an error."""
    record, _ = probe(fake_server, "openai-chat", stream_script("openai-chat", ["a", "b"], 0.8, 0.05), first_token_timeout_s=5.0, idle_timeout_s=0.4)
    assert record["status"] == "ok" and record["ttft_s"] >= 0.75


def test_connection_refused_is_bad_base_url() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: refused
        record = stream_once(Channel(base_url=f"http://127.0.0.1:{port}/api", api_key=KEY), PROMPT, 8)
    assert (record["status"], record["error_kind"]) == ("error", ek.BAD_BASE_URL)
    assert KEY not in json.dumps(record)


# ------------------------------------------------------------- what we send


@pytest.mark.parametrize(
    ("protocol", "base", "path"),
    [
        ("anthropic", "/api", "/api/v1/messages"),
        ("anthropic", "", "/v1/messages"),
        ("openai-chat", "/v1", "/v1/chat/completions"),
        ("openai-chat", "", "/v1/chat/completions"),
        ("openai-responses", "/api/v1", "/api/v1/responses"),
        ("openai-responses", "/openai", "/openai/v1/responses"),
    ],
)
def test_request_url_joining(fake_server: FakeServer, protocol: str, base: str, path: str) -> None:
    fake_server.play(stream_script(protocol, ["a"]))
    record = stream_once(Channel(base_url=fake_server.url + base, protocol=protocol, api_key=KEY), PROMPT, 8)
    assert record["status"] == "ok"
    assert fake_server.last.path == path and fake_server.last.method == "POST"


@pytest.mark.parametrize(
    ("protocol", "creds", "auth_headers"),
    [
        ("anthropic", {"api_key": KEY}, {"x-api-key": KEY}),
        ("anthropic", {"auth_token": KEY}, {"authorization": f"Bearer {KEY}"}),
        ("openai-chat", {"api_key": KEY}, {"authorization": f"Bearer {KEY}"}),
        ("openai-responses", {"api_key": KEY}, {"authorization": f"Bearer {KEY}"}),
    ],
)
def test_request_headers(fake_server: FakeServer, protocol: str, creds: dict[str, str], auth_headers: dict[str, str]) -> None:
    fake_server.play(stream_script(protocol, ["a"]))
    ch = Channel(base_url=fake_server.url + "/api", protocol=protocol, extra_headers={"X-Team": "blue"}, **creds)
    stream_once(ch, PROMPT, 8)
    sent = fake_server.last.headers
    for name, value in auth_headers.items():
        assert sent[name] == value
    for absent in {"x-api-key", "authorization"} - set(auth_headers):
        assert absent not in sent
    assert sent["x-team"] == "blue" and sent["content-type"] == "application/json"
    assert (sent.get("anthropic-version") == "2023-06-01") == (protocol == "anthropic")


@pytest.mark.parametrize(
    ("protocol", "expected"),
    [
        ("anthropic", {"model": "m-1", "max_tokens": 17, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}),
        ("openai-chat", {"model": "m-1", "max_tokens": 17, "stream": True, "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": PROMPT}]}),
        ("openai-responses", {"model": "m-1", "max_output_tokens": 17, "stream": True, "input": PROMPT}),
    ],
)
def test_request_body(fake_server: FakeServer, protocol: str, expected: dict[str, Any]) -> None:
    fake_server.play(stream_script(protocol, ["a"]))
    ch = dataclasses.replace(channel_for(fake_server, protocol), model="m-1")
    stream_once(ch, PROMPT, 17, extra_body={"ignore_eos": True, "min_tokens": 17})
    assert fake_server.last.json() == {**expected, "ignore_eos": True, "min_tokens": 17}


# -------------------------------------------------------- pure measurement


def timeline(first: float | None, gaps: list[float], *, t0: float = 100.0, server_tokens: int | None = None) -> Timeline:
    tl = Timeline(t0=t0)
    tl.t_headers = t0 + 0.05
    t = None if first is None else t0 + first
    for i in range(len(gaps) + 1 if first is not None else 0):
        if i:
            t += gaps[i - 1]  # type: ignore[operator]
        tl.token(t, TOKEN_TEXT)  # type: ignore[arg-type]
    tl.output_tokens = server_tokens
    tl.complete = True
    return tl


def test_measure_tpot_uses_n_minus_one() -> None:
    rec = measure(timeline(0.5, [0.1] * 49))
    assert rec["ttft_s"] == pytest.approx(0.5) and rec["e2e_s"] == pytest.approx(5.4)
    assert rec["tpot_s"] == pytest.approx(0.1)  # 4.9 s over 49 gaps, not 50
    assert (rec["output_tokens"], rec["output_tokens_source"], rec["chunks"]) == (50, "chunks", 50)
    assert rec["ttfb_s"] == pytest.approx(0.05) and rec["status"] == "ok"


def test_measure_tpot_with_server_count_larger_than_chunks() -> None:
    """Relays batch several tokens per chunk: TPOT divides by the server's count, ITL stays per chunk."""
    rec = measure(timeline(1.0, [0.5, 0.5], server_tokens=11))
    assert rec["tpot_s"] == pytest.approx(1.0 / 10)
    assert rec["output_tokens_source"] == "server" and rec["chunks"] == 3
    assert rec["itl_p50_s"] == pytest.approx(0.5)


@pytest.mark.parametrize(("first", "gaps"), [(0.3, []), (None, [])], ids=["one-token", "no-token"])
def test_measure_no_tpot_without_two_tokens(first: float | None, gaps: list[float]) -> None:
    rec = measure(timeline(first, gaps), estimated_input_tokens=9)
    assert rec["tpot_s"] is None and rec["itl_p50_s"] is None and rec["itl_max_s"] is None
    assert (rec["input_tokens"], rec["input_tokens_source"]) == (9, "estimate")


def test_measure_itl_percentiles() -> None:
    gaps = [0.01] * 98 + [0.5, 2.0]
    rec = measure(timeline(0.2, gaps))
    assert rec["itl_p50_s"] == pytest.approx(0.01)
    assert rec["itl_max_s"] == pytest.approx(2.0)
    assert 0.5 <= rec["itl_p99_s"] <= 2.0


def test_measure_ttft_text_after_thinking() -> None:
    tl = Timeline(t0=0.0)
    for t in (0.2, 0.3, 0.4):
        tl.token(t, TOKEN_THINKING)
    tl.token(0.9, TOKEN_TEXT)
    rec = measure(tl)
    assert (rec["ttft_s"], rec["ttft_text_s"], rec["thinking_chunks"]) == (0.2, 0.9, 3)
    assert rec["tpot_s"] == pytest.approx(0.7 / 3)


@pytest.mark.parametrize(
    ("ttft", "tpot", "n", "simple"),
    [(0.5, 0.1, 50, 5.5), (1.5, 0.3, 40, 13.5)],
    ids=["brief-example-1", "brief-example-2"],
)
def test_formula_brief_examples(ttft: float, tpot: float, n: int, simple: float) -> None:
    exact = ttft + tpot * (n - 1)
    check = formula(ttft, tpot, n, exact)
    assert check is not None
    assert check["predicted_simple_s"] == pytest.approx(simple)
    assert check["predicted_exact_s"] == pytest.approx(exact)
    assert check["error_exact_pct"] == pytest.approx(0.0)
    assert check["error_simple_pct"] == pytest.approx(100 * tpot / exact)  # the simple form over-predicts by one TPOT


@pytest.mark.parametrize("args", [(None, 0.1, 5, 1.0), (0.5, None, 5, 1.0), (0.5, 0.1, 5, None), (0.5, 0.1, 5, 0.0)])
def test_formula_undefined_without_inputs(args: tuple[Any, ...]) -> None:
    assert formula(*args) is None


def test_gzip_helper_really_compresses() -> None:
    """Guard for the gzip framing case: the body must not be plain SSE."""
    writes = _gzip_writes([(0.0, b"data: x\n\n")])
    body = b"".join(b for _, b in writes)
    assert b"data" not in body and gzip.decompress(body) == b"data: x\n\n"
