"""Deltas counted by shape (tokenload.deltas) give exactly the record the full parse gives.

Each stream is fed twice through a real `StreamSession` and protocol adapter: once
as the load generator reads it (no display callback: shapes on), once with a
display callback (every event through the SSE decoder and JSON). The two records
must be equal field for field, for delta values that are valid, empty, escaped,
non-ASCII, and malformed in every way a JSON string can be.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from tokenload.channel import Channel
from tokenload.deltas import DeltaShapes
from tokenload.measure import Timeline
from tokenload.protocols import adapter_for
from tokenload.stream import StreamSession

# Raw bytes placed between the quotes of a delta's string value.
VALID = [b"Hello", b" ", b'\\"quoted\\"', b"\\\\", b"\\n", b"\\u00e9", "é".encode(), "😀".encode(),
         b"\\ud83d\\ude00", b"a/b", b"\\/", b"tab\\there", b"x" * 300]
EMPTY = [b""]
MALFORMED = [b"\\x", b"\\u12", b"bad\x01control", b'a"b', b"ends\\", b"\\u12G4"]


def _chat(value: bytes, key: bytes = b"content") -> bytes:
    return (b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","created":1,"model":"m","choices":'
            b'[{"index":0,"delta":{"' + key + b'":"' + value + b'"},"logprobs":null,"finish_reason":null}]}\n\n')


def _anthropic(value: bytes, kind: bytes = b"text") -> bytes:
    return (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"'
            + kind + b'_delta","' + kind + b'":"' + value + b'"}}\n\n')


_SEQ = iter(range(10_000))


def _responses(value: bytes) -> bytes:
    return (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":'
            + str(next(_SEQ)).encode() + b',"item_id":"msg_1","output_index":0,"content_index":0,"delta":"'
            + value + b'"}\n\n')


STREAMS: dict[str, tuple[bytes, Callable[[bytes], bytes], bytes]] = {
    "openai-chat": (
        _chat(b"", b"role"),
        _chat,
        b'data: {"id":"chatcmpl-7","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
        b'data: {"id":"chatcmpl-7","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":40}}\n\n'
        b"data: [DONE]\n\n",
    ),
    "anthropic": (
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":5}}}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n',
        _anthropic,
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
        b'"usage":{"output_tokens":40}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n',
    ),
    "openai-responses": (
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
        _responses,
        b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
        b'{"input_tokens":5,"output_tokens":40}}}\n\n',
    ),
}


def _record(protocol: str, chunks: list[bytes], *, display: bool) -> tuple[dict[str, Any], StreamSession]:
    adapter = adapter_for(Channel(base_url="http://127.0.0.1:9/v1", protocol=protocol, api_key="sk-test-0123456789"))
    session = StreamSession(adapter, 0.0, on_text=(lambda text, kind: None) if display else None)
    session.on_headers(0.001, 200, {"content-type": "text/event-stream"})
    for i, chunk in enumerate(chunks):
        session.on_data(0.01 * (i + 1), chunk)
    session.on_end(0.01 * (len(chunks) + 1))
    record = dict(session.record())
    del record["started_at"]  # wall clock when the session was made
    return record, session


@pytest.mark.parametrize("protocol", sorted(STREAMS))
@pytest.mark.parametrize("seed", range(6))
def test_shapes_give_the_full_parse_record(protocol: str, seed: int) -> None:
    start, delta, end = STREAMS[protocol]
    rng = random.Random(seed)
    values = [rng.choice(VALID) for _ in range(30)] + rng.sample(EMPTY + MALFORMED, 4) + VALID
    rng.shuffle(values)
    events = [delta(v) for v in values]
    # Mostly one event per read (the load generator's case), some reads with several, one split mid-event.
    chunks = [start]
    i = 0
    while i < len(events):
        take = rng.choice((1, 1, 1, 2, 3))
        chunks.append(b"".join(events[i : i + take]))
        i += take
    cut = len(chunks) // 2
    chunks[cut : cut + 1] = [chunks[cut][:17], chunks[cut][17:]]
    chunks.append(end)
    fast, session = _record(protocol, chunks, display=False)
    full, _ = _record(protocol, chunks, display=True)
    assert fast == full
    assert session._shapes is not None and session._shapes.match(delta(b"learned")[:-2]) is not None  # shapes were used
    assert fast["malformed_events"] > 0 and fast["chunks"] > 30


def test_a_value_that_is_not_a_plain_json_string_takes_the_full_path() -> None:
    shapes = DeltaShapes((b'"content":"',))
    learned = _chat(b"Hello")[:-2]
    tl = Timeline(t0=0.0)
    before = shapes.before(tl)
    tl.token(1.0, "text")
    shapes.learn(learned, before, tl)
    assert shapes.match(_chat(b"again")[:-2]) == "text"
    for value in EMPTY + MALFORMED:
        assert shapes.match(_chat(value)[:-2]) is None, value
    # A different stream (another id) or another field changed: not this shape.
    assert shapes.match(_chat(b"x")[:-2].replace(b"chatcmpl-7", b"chatcmpl-8")) is None
    assert shapes.match(_chat(b"x")[:-2].replace(b'"finish_reason":null', b'"finish_reason":"stop"')) is None


def test_an_event_that_did_more_than_one_token_is_not_learned() -> None:
    """A delta that also carried a stop reason (or usage) must go through the full parse every time."""
    shapes = DeltaShapes((b'"content":"',))
    tl = Timeline(t0=0.0)
    before = shapes.before(tl)
    tl.token(1.0, "text")
    tl.stop_reason = "stop"
    event = json.dumps({"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]}).encode()
    shapes.learn(b"data: " + event, before, tl)
    assert shapes.match(b"data: " + event) is None
