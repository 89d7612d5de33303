"""The load transport's read path: tokens stamped when they arrived, even when the process read them late.

A gevent-patched child process streams from the scripted server while its own
event loop is blocked (an unpatched `time.sleep`, what a saturated client looks
like to a stream): a token that arrived during the block must keep its arrival
time, not the time the loop got round to reading it. The block starts once the
request is out (or its headers are read), and each stamp is compared with when
the server wrote the bytes (`Received.written`), so a busy machine that delays
the child or the server moves both sides alike.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from fakeserver import FakeServer, Script, sse
from loadkit import READERS, reader_env

_CHILD = r"""
from gevent import monkey; monkey.patch_all()
import json, sys, time
import gevent
from gevent.monkey import get_original
from tokenload.channel import Channel
from tokenload.transport.reader import compiled
from tokenload.transport.gevent_client import Transport
from tokenload.protocols import adapter_for
from tokenload.stream import StreamSession

cfg = json.loads(sys.argv[1])
channel = Channel(base_url=cfg["url"], protocol="openai-chat", api_key="sk-reader-test-0123456789")
adapter = adapter_for(channel)
transport = Transport(channel)
blocking_sleep = get_original("time", "sleep")
for _ in range(cfg["requests"]):
    session = StreamSession(adapter, time.perf_counter())
    stream = gevent.spawn(transport.stream, adapter.prepare("hello", 8), session)
    timeline = session.timeline
    while (timeline.send_lag_s if cfg["block_after"] == "sent" else timeline.t_headers) is None:
        gevent.sleep(0.001)
    blocked = time.perf_counter()
    blocking_sleep(cfg["block_for"])  # the whole process stalls; the server's bytes wait in the kernel
    blocked = [blocked, time.perf_counter()]
    stream.join()
    record = session.record()
    record["t0"], record["blocked"] = timeline.t0, blocked
    record["chunk_gaps"] = [b - a for a, b in zip(session.timeline.chunk_times, session.timeline.chunk_times[1:])]
    record["reader"] = "compiled" if compiled() else "pure"
    print(json.dumps(record), flush=True)
"""


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    choices = [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else []
    return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices,
                **({"usage": usage} if usage else {})})


def _answer(first_token_after: float, second_token_after: float, headers_after: float = 0.0) -> Script:
    return Script(headers_delay_s=headers_after, writes=[
        (0.0, _chunk({"role": "assistant", "content": ""})),
        (first_token_after, _chunk({"content": "Hello"})),
        (second_token_after, _chunk({"content": " there"})),
        (0.0, _chunk({}, "stop")),
        (0.0, _chunk({}, usage={"prompt_tokens": 3, "completion_tokens": 2})),
        (0.0, b"data: [DONE]\n\n"),
    ])


def _stream_while_blocked(server: FakeServer, script: Script, reader: str, block_after: str = "headers",
                          requests: int = 2) -> list[tuple[dict[str, Any], list[float]]]:
    """Each record, with when the server wrote each part of its answer (the head, then each write: the midpoint
    of its write call)."""
    server.play(*[script] * requests)
    cfg = {"url": server.url + "/v1", "requests": requests, "block_after": block_after, "block_for": 0.6}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True, text=True,
                         timeout=60, check=False, env=reader_env(reader))
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["status"] for r in records] == ["ok"] * requests, records
    assert {r["reader"] for r in records} == {reader}
    assert len(server.requests) == requests
    return [(r, [(a + b) / 2 for a, b in received.written]) for r, received in zip(records, server.requests)]


def _at(record: dict[str, Any], latency: str) -> float:
    """When a latency of the record ended, on the server's clock (both use the monotonic clock)."""
    return float(record["t0"] + record[latency])


def _during_block(record: dict[str, Any], written_at: float) -> None:
    """The test's premise: the server wrote these bytes while the child's loop was blocked, long enough before
    it ended that a stamp of the read (its end) could not pass for their arrival."""
    start, end = record["blocked"]
    assert start < written_at < end - 0.1, ("the server wrote outside the block", start, written_at, end)


# Kernel arrival stamps against the server's write calls: within this of each other (clock conversion, a write
# call's own length on a busy machine).
TOLERANCE_S = 0.01


@pytest.mark.parametrize("reader", READERS)
def test_a_token_read_late_keeps_its_arrival_time(fake_server: FakeServer, reader: str) -> None:
    """First token 0.2 s after the headers, read when the loop unblocks 0.6 s after them: TTFT is the first
    token's arrival, and the gap to the second token (0.8 s later, counted by its shape) is the gap between
    the writes, not the one between the two reads."""
    for record, (_, _, first, second, *_) in _stream_while_blocked(fake_server, _answer(0.2, 0.8), reader):
        _during_block(record, first)
        assert _at(record, "ttft_s") == pytest.approx(first, abs=TOLERANCE_S)  # read-time stamping: the block's end
        assert record["chunk_gaps"] == [pytest.approx(second - first, abs=TOLERANCE_S)]
        assert record["first_read_tokens"] == 1  # its read held no later token: the stamp is its own arrival


@pytest.mark.parametrize("reader", READERS)
def test_a_first_token_read_with_the_next_one_says_its_ttft_is_an_upper_bound(fake_server: FakeServer,
                                                                              reader: str) -> None:
    """First token 0.2 s after the headers, second 0.1 s later, both read when the loop unblocks: the kernel
    gives the read the second's arrival, so TTFT is 0.1 s too long, and the record says so: two tokens came in
    the first one's read."""
    for record, (_, _, _, second, *_) in _stream_while_blocked(fake_server, _answer(0.2, 0.1), reader):
        _during_block(record, second)
        assert _at(record, "ttft_s") == pytest.approx(second, abs=TOLERANCE_S)  # the second write's arrival
        assert record["first_read_tokens"] == 2
        assert record["chunk_gaps"] == [0.0]


@pytest.mark.parametrize("reader", READERS)
def test_a_token_that_came_with_the_headers_keeps_their_arrival_time(fake_server: FakeServer, reader: str) -> None:
    """Headers and first token 0.2 s after the request, read when the loop unblocks 0.6 s after it: TTFB and
    TTFT are their arrival (the first read is the transport's own, stamped, before the header parser sees the
    bytes)."""
    script = _answer(0.0, 0.8, headers_after=0.2)
    for record, (head, _, first, *_) in _stream_while_blocked(fake_server, script, reader, block_after="sent"):
        _during_block(record, head)
        # One read brought the head and the first token, stamped with the newest byte's arrival.
        assert head - TOLERANCE_S < _at(record, "ttfb_s") < first + TOLERANCE_S
        assert _at(record, "ttft_s") == pytest.approx(first, abs=TOLERANCE_S)
        assert record["ttft_s"] >= record["ttfb_s"]
