"""Every fault is produced on the wire as described and recorded in the truth file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simfixtures import RawResponse, anthropic_body, chat_body, parse_sse, raw_request, read_truth, responses_body

from tokenload.sim import serve_in_thread

MESSAGES, CHAT, RESPONSES = "/v1/messages", "/v1/chat/completions", "/v1/responses"


def _send(sim: Any, marker: str, path: str = MESSAGES, n: int = 8, **extra: Any) -> tuple[RawResponse, dict[str, Any]]:
    body = {MESSAGES: anthropic_body, CHAT: chat_body, RESPONSES: responses_body}[path](f"fault test {marker}", n, **extra)
    response = raw_request(sim.base_url, path, body)
    return response, read_truth(sim.truth_path)[response.headers["x-request-id"]]


def _texts(response: RawResponse) -> list[str]:
    return [e["delta"]["text"] for e in response.json_events() if e.get("delta", {}).get("type") == "text_delta"]


@pytest.mark.parametrize("kind,ended", [("disconnect", "eof"), ("reset", "reset")])
def test_mid_stream_disconnect_fin_and_rst(fast_sim: Any, kind: str, ended: str) -> None:
    response, truth = _send(fast_sim, f"[[fault:{kind} after=3]]")
    assert response.ended == ended
    if kind == "disconnect":
        assert len(_texts(response)) == 3
    assert truth["fault"] == f"{kind} after=3" and truth["outcome"] == kind and truth["output_tokens"] == 3


def test_stall_pauses_then_continues(fast_sim: Any) -> None:
    response, truth = _send(fast_sim, "[[fault:stall after=2 seconds=0.4]]", n=5)
    times = response.token_times()
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) == 5 and response.ended == "complete"
    assert gaps[1] >= 0.35 and max(gaps[:1] + gaps[2:]) < 0.2
    assert truth["fault"] == "stall after=2 seconds=0.4" and truth["output_tokens"] == 5


def test_stall_before_the_first_token_delays_ttft(fast_sim: Any) -> None:
    response, _ = _send(fast_sim, "[[fault:stall after=0 seconds=0.3]]", n=3)
    assert response.ttft() >= 0.25 and len(response.token_times()) == 3


@pytest.mark.parametrize("path,signature", [
    (MESSAGES, '"type":"overloaded_error"'), (CHAT, '"error":{'), (RESPONSES, '"type":"response.failed"')])
def test_in_stream_error_event(fast_sim: Any, path: str, signature: str) -> None:
    response, truth = _send(fast_sim, "[[fault:error_event after=2]]", path)
    events = parse_sse(response.body)
    assert response.ended == "complete" and signature in events[-1][1]
    if path == MESSAGES:
        assert events[-1][0] == "error"
    assert truth["outcome"] == "error_event" and truth["output_tokens"] == 2


def test_malformed_json_event(fast_sim: Any) -> None:
    response, truth = _send(fast_sim, "[[fault:malformed after=1]]")
    bad = []
    for _, data in parse_sse(response.body):
        try:
            json.loads(data)
        except ValueError:
            bad.append(data)
    assert len(bad) == 1 and response.ended == "complete"
    assert truth["fault"] == "malformed after=1"


def test_chunked_body_without_final_chunk(fast_sim: Any) -> None:
    response, truth = _send(fast_sim, "[[fault:no_final_chunk]]")
    assert response.ended == "eof" and b"message_stop" in response.body
    assert truth["outcome"] == "no_final_chunk"


@pytest.mark.parametrize("marker,status,has_body", [
    ("status code=529", 529, True), ("status code=500", 500, True), ("status code=503 body=empty", 503, False),
    ("status code=429", 429, True)])
def test_http_errors_with_and_without_body(fast_sim: Any, marker: str, status: int, has_body: bool) -> None:
    response, truth = _send(fast_sim, f"[[fault:{marker}]]")
    assert response.status == status and truth["status"] == status and truth["fault"].startswith("status")
    if has_body:
        assert json.loads(response.body)["type"] == "error"
    else:
        assert response.body == b""
    assert ("retry-after" in response.headers) == (status == 429)


def test_html_page_instead_of_stream(fast_sim: Any) -> None:
    response, truth = _send(fast_sim, "[[fault:html]]", CHAT)
    assert response.status == 200 and response.headers["content-type"].startswith("text/html")
    assert b"<html>" in response.body and truth["fault"] == "html code=200"


def test_json_body_when_a_stream_was_asked(fast_sim: Any) -> None:
    response, truth = _send(fast_sim, "[[fault:json_body]]", CHAT, n=4)
    assert response.headers["content-type"] == "application/json"
    assert json.loads(response.body)["usage"]["completion_tokens"] == 4
    assert truth["fault"] == "json_body" and truth["output_tokens"] == 4


def test_slow_headers_and_headers_then_silence(fast_sim: Any) -> None:
    slow, truth = _send(fast_sim, "[[fault:slow_headers seconds=0.4]]")
    assert slow.t_headers - slow.t_sent >= 0.35 and len(_texts(slow)) == 8
    assert truth["fault"] == "slow_headers seconds=0.4"
    silent, truth = _send(fast_sim, "[[fault:silence seconds=0.4]]")
    assert silent.t_headers - silent.t_sent < 0.2
    assert silent.ended == "eof" and silent.body == b"" and silent.chunks == []
    assert truth["fault"] == "silence seconds=0.4"


@pytest.mark.parametrize("path", [MESSAGES, CHAT, RESPONSES])
def test_missing_usage(fast_sim: Any, path: str) -> None:
    response, truth = _send(fast_sim, "[[fault:no_usage]]", path)
    events = response.json_events()
    final = events[-1]
    assert response.ended == "complete" and truth["fault"] == "no_usage"
    if path == MESSAGES:
        assert "usage" not in next(e for e in events if e["type"] == "message_delta")
    elif path == CHAT:
        assert all("usage" not in e for e in events)
    else:
        assert final["type"] == "response.completed" and final["response"]["usage"] is None


@pytest.mark.parametrize("marker,wire_check", [
    ("crlf", lambda b: b"\r\n\r\n" in b),
    ("cr", lambda b: b"\r\r" in b and b"\n" not in b),
    ("nospace", lambda b: b"data:{" in b and b"data: " not in b),
    ("bom", lambda b: b.startswith(b"\xef\xbb\xbf")),
    ("multiline", lambda b: b"\ndata: " in b.replace(b"\n\ndata", b"")),
    ("comments", lambda b: b": keepalive\n" in b),
    ("unicode", lambda b: max(b) >= 0x80),
    ("pad bytes=100000", lambda b: b" " * 100000 in b),
])
def test_framing_variants_decode_to_the_same_events(fast_sim: Any, marker: str, wire_check: Any) -> None:
    plain, _ = _send(fast_sim, "[[fault:no_usage]]")
    varied, truth = _send(fast_sim, f"[[fault:{marker}]] [[fault:no_usage]]")
    assert wire_check(varied.body)
    assert [e["type"] for e in varied.json_events()] == [e["type"] for e in plain.json_events()]
    assert len(_texts(varied)) == 8 and truth["fault"] == f"{marker}; no_usage"


def test_openai_done_without_space_and_one_byte_per_write(fast_sim: Any) -> None:
    response, truth = _send(fast_sim, "[[fault:nospace]] [[fault:split]] [[fault:unicode]]", CHAT)
    assert response.body.endswith(b"data:[DONE]\n\n")
    assert {len(data) for _, data in response.chunks} == {1}
    assert parse_sse(response.body)[-1] == (None, "[DONE]")
    contents = [e["choices"][0]["delta"].get("content") for e in response.json_events() if e["choices"]]
    assert sum(1 for c in contents if c) == 8 and truth["fault"] == "nospace; split bytes=1; unicode"


def test_faults_by_profile_rate(tmp_path: Path) -> None:
    with serve_in_thread("fast", truth_path=tmp_path / "t.jsonl", faults={"disconnect after=1": 1.0, "crlf": 0.0}) as sim:
        responses = [raw_request(sim.base_url, CHAT, chat_body(f"rate {i}", 5)) for i in range(3)]
        unstreamed = raw_request(sim.base_url, CHAT, chat_body("non-stream", 5, stream=False))
    assert all(r.ended == "eof" for r in responses)
    truth = read_truth(tmp_path / "t.jsonl")
    assert [truth[r.headers["x-request-id"]]["fault"] for r in responses] == ["disconnect after=1"] * 3
    assert truth[unstreamed.headers["x-request-id"]]["fault"] is None


def test_bad_marker_is_a_400(fast_sim: Any) -> None:
    response, truth = _send(fast_sim, "[[fault:explode]]")
    assert response.status == 400 and "unknown fault" in json.loads(response.body)["error"]["message"]
    assert truth["error"] == "bad_request"
