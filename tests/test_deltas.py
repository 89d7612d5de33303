"""Deltas counted by shape (tokenload.deltas) give exactly the record the full parse gives.

Each stream is fed twice through a real `StreamSession` and protocol adapter: once
as the load generator reads it (no display callback: shapes on), once with a
display callback (every event through the SSE decoder and JSON). The two records
must be equal field for field, for delta values that are valid, empty, escaped,
non-ASCII, and malformed in every way a JSON string can be.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenload.channel import Channel
from tokenload.deltas import DeltaShapes
from tokenload.measure import Timeline
from tokenload.protocols import adapter_for
from tokenload.stream import StreamSession
from tokenload.transport.reader import compiled as reader_compiled

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
        # as a relay (LiteLLM) sends it: the message id, zeros for usage; the real counts come in message_delta
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_7","usage":'
        b'{"input_tokens":0,"output_tokens":0,"cache_read_input_tokens":0}}}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n',
        _anthropic,
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
        b'"usage":{"input_tokens":5,"cache_read_input_tokens":22,"output_tokens":40}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ),
    "openai-responses": (
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
        b'"response":{"id":"resp_7","usage":null}}\n\n',
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
    assert fast["server_request_id"] in ("chatcmpl-7", "msg_7", "resp_7") and fast["input_tokens"] in (5, 27)


def test_a_stream_whose_first_token_brings_its_id_gives_the_full_parse_record() -> None:
    """No role-only chunk: the first content chunk names the stream, the later ones repeat the id."""
    chunks = [_chat(b"first"), *(_chat(b"more") for _ in range(20)), STREAMS["openai-chat"][2]]
    fast, session = _record("openai-chat", chunks, display=False)
    full, _ = _record("openai-chat", chunks, display=True)
    assert fast == full and fast["server_request_id"] == "chatcmpl-7" and fast["chunks"] == 21
    assert session._shapes is not None and session._shapes.match(_chat(b"x")[:-2]) == "text"


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


# ------------------------------------------------------------------ the compiled core (tokenload.transport._chunked)

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _framed(chunk: bytes, rng: random.Random) -> bytes:
    """One write as a server frames it: an HTTP chunk, some with an extension."""
    return b"%x%s\r\n%s\r\n" % (len(chunk), rng.choice((b"", b"", b";x=1")), chunk)


def _last(rng: random.Random) -> bytes:
    return b"0\r\n" + rng.choice((b"", b"x-trailer: 1\r\n")) + b"\r\n"


def _pieces(wire: bytes, rng: random.Random) -> list[bytes]:
    """`wire` cut where TCP may cut it: anywhere, mostly at the writes' own boundaries."""
    cuts = sorted(rng.sample(range(1, len(wire)), len(wire) // 150))
    return [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)])]


class _Counted(StreamSession):
    """A session that counts the reads handed to Python (`on_data`)."""

    __slots__ = ("python_calls",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.python_calls = 0

    def on_data(self, t: float, chunk: bytes) -> None:
        self.python_calls += 1
        super().on_data(t, chunk)


def _read(protocol: str, pieces: list[bytes], *, compiled: bool) -> tuple[dict[str, Any] | str, int]:
    """Each piece read as one `recvmsg` is, by the compiled core or by the pure path (`HubReader._read`):
    the record, or the error that ended the body; and how many `on_data` calls Python ran."""
    from geventhttpclient.response import HTTPResponse

    from tokenload.transport import reader

    adapter = adapter_for(Channel(base_url="http://127.0.0.1:9/v1", protocol=protocol, api_key="sk-test-0123456789"))
    session = _Counted(adapter, 0.0)
    session.on_headers(0.001, 200, {"content-type": "text/event-stream"})
    parser = HTTPResponse(method="POST")
    parser.feed(_HEAD)
    assert session._shapes is not None
    body = reader._chunked.ChunkedBody(-1, session, session._shapes._shapes, session._shapes._blank,
                                       lambda error: None, 0.0) if compiled else None
    t = 0.0
    try:
        for i, piece in enumerate(pieces):
            t = 0.01 * (i + 1)
            if body is not None:
                body.feed(piece, t)
                done = body.complete
            else:
                parser.feed(piece)
                if parser._body_buffer:
                    chunk = bytes(parser._body_buffer)
                    del parser._body_buffer[:]
                    session.on_data(t, chunk)
                done = parser.message_complete
            if done:
                break
    except Exception as exc:  # what would end the stream: both paths must fail alike
        return type(exc).__name__, session.python_calls
    session.on_end(t)
    record = dict(session.record())
    del record["started_at"]
    return record, session.python_calls


needs_core = pytest.mark.skipif(not reader_compiled(), reason="the compiled core was not built here")


@needs_core
@pytest.mark.parametrize("protocol", sorted(STREAMS))
@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_core_gives_the_pure_path_record(protocol: str, seed: int) -> None:
    start, delta, end = STREAMS[protocol]
    rng = random.Random(seed)
    values = [rng.choice(VALID) for _ in range(60)] + rng.sample(EMPTY + MALFORMED, 4)
    rng.shuffle(values)
    events = [delta(v) for v in values]
    # Seed 3: the server ends the body right after a delta, with no final event.
    chunks = [start, *events[:10], *(b"".join(events[i : i + 2]) for i in range(10, len(events), 2))]
    chunks += [end] if seed != 3 else []
    writes = [_framed(c, rng) for c in chunks] + [_last(rng)]
    # One read per write (the usual case), then the same bytes cut anywhere.
    for pieces in (writes, _pieces(b"".join(writes), rng)):
        fast, python_calls = _read(protocol, pieces, compiled=True)
        pure, _ = _read(protocol, pieces, compiled=False)
        assert fast == pure
        assert isinstance(fast, dict) and fast["chunks"] > 40
        if pieces is writes:  # whole events per read: most were counted in C
            assert python_calls < len(pieces) / 2, python_calls


_INVALID_FRAMING = [
    b"5\nhello\n",  # bare LF
    b"5 \r\nhello\r\n",  # space in the size
    b"g\r\n",  # not hex
    b"\r\n",  # no size
    b"5\r\nhelloXX\r\n",  # data longer than its size
    b"ffffffffffffffffff\r\n",  # size overflow
    b"5;ext\nhello\r\n",  # bare LF after an extension
    b"5;\r\nhello\r\n0\r\n\r\n",  # an extension without a name
    b"5; a=b\r\nhello\r\n0\r\n\r\n",  # a space in an extension
    b'5;a="x"y\r\nhello\r\n0\r\n\r\n',  # text after a quoted value
    b'5;a="\x01"\r\nhello\r\n0\r\n\r\n',  # a control character in a quoted value
    b"5;a=b\x80\r\nhello\r\n0\r\n\r\n",  # a non-token byte in a value
    b"0\r\n\rX",  # CR without LF at the end
    b"0\r\nx: 1\rX",  # a trailer's CR without LF
    b"0\r\nnot a header\r\n\r\n",  # a trailer that is no header line
    b"0\r\nx : 1\r\n\r\n",  # a space before a trailer's colon
    b"0\r\n:x\r\n\r\n",  # a trailer without a name
    b"0\r\nx:\x01\r\n\r\n",  # a control character in a trailer
    b"0\r\nx:1\r\n y\r\n\r\n",  # a folded trailer line
    b"0\r\nx: 1\r\n\r\nJUNK",  # bytes after the end
]
_VALID_FRAMING = [
    b"000A\r\n0123456789\r\n0\r\n\r\n",  # leading zeros
    b'5;a="q\\"x"\r\nhello\r\n0\r\n\r\n',  # an escaped quote in a quoted extension
    b"5;a;b=c\r\nhello\r\n0\r\n\r\n",  # several extensions, one without a value
    b"5;a=\r\nhello\r\n0\r\n\r\n",  # an empty extension value
    b'5;a="\x80";b\r\nhello\r\n0\r\n\r\n',  # a non-ASCII byte in a quoted value
    b"0;x\r\nx: \x80\t1\r\n\r\n",  # an extension on the last chunk, a trailer with a tab
    b"0\r\n\r\n\r\n",  # a line end after the end
]


@needs_core
@pytest.mark.parametrize("wire", _INVALID_FRAMING + _VALID_FRAMING)
def test_chunk_framing_ends_both_paths_alike(wire: bytes) -> None:
    """As strict as llhttp (the pure path's parser), whole and one byte per read."""
    good = _framed(STREAMS["openai-chat"][0], random.Random(0))
    for pieces in ([good, wire], [good, *(wire[i : i + 1] for i in range(len(wire)))]):
        fast, _ = _read("openai-chat", pieces, compiled=True)
        pure, _ = _read("openai-chat", pieces, compiled=False)
        assert fast == pure
        if len(pieces) == 2:  # (read byte by byte, the body has ended before bytes after its end arrive)
            assert (fast == "HTTPParseError") is (wire in _INVALID_FRAMING)


def test_the_compiled_core_is_built_where_a_compiler_is() -> None:
    """`pip install` builds it on Linux with a C compiler (CI has one): its tests must not be skipped there."""
    if not (sys.platform.startswith("linux") and shutil.which("cc")) or os.environ.get("TOKENLOAD_PURE_PYTHON") == "1":
        pytest.skip("no C compiler or not Linux: the pure-Python path is the only one")
    assert reader_compiled()


@needs_core
@settings(max_examples=400, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3), st.binary(min_size=1, max_size=3)),
                      min_size=1, max_size=4),
       cut=st.integers(1, 200))
def test_a_mangled_body_ends_both_paths_alike(edits: list[tuple[int, int, bytes]], cut: int) -> None:
    """Any bytes, not only the listed cases: a valid body with bytes replaced, inserted or deleted,
    read in pieces of `cut` bytes, gives the compiled core and llhttp + the pure path the same result."""
    rng = random.Random(0)
    start, delta, end = STREAMS["openai-chat"]
    wire = bytearray(b"".join(_framed(c, rng) for c in [start, *(delta(b"tok") for _ in range(6)), end]) + _last(rng))
    for at, how, data in edits:
        at %= len(wire)
        if how == 0:
            wire[at : at + len(data)] = data
        elif how == 1:
            wire[at:at] = data
        else:
            del wire[at : at + len(data)]
    pieces = [bytes(wire[i : i + cut]) for i in range(0, len(wire), cut)]
    assert _read("openai-chat", pieces, compiled=True)[0] == _read("openai-chat", pieces, compiled=False)[0]
