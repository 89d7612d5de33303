"""The load transport's read path: tokens stamped when they arrived, even when the process read them late.

A gevent-patched child process streams from the scripted server while its own
event loop is blocked (an unpatched `time.sleep`, what a saturated client looks
like to a stream): a token that arrived during the block must keep its arrival
time, not the time the loop got round to reading it.
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
    gevent.sleep(cfg["block_at"])
    blocking_sleep(cfg["block_for"])  # the whole process stalls; the server's bytes wait in the kernel
    stream.join()
    record = session.record()
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


def _stream_while_blocked(server: FakeServer, script: Script, reader: str, requests: int = 2) -> list[dict[str, Any]]:
    server.play(*[script] * requests)
    cfg = {"url": server.url + "/v1", "requests": requests, "block_at": 0.05, "block_for": 0.6}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True, text=True,
                         timeout=60, check=False, env=reader_env(reader))
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["status"] for r in records] == ["ok"] * requests, records
    assert {r["reader"] for r in records} == {reader}
    return records


@pytest.mark.parametrize("reader", READERS)
def test_a_token_read_late_keeps_its_arrival_time(fake_server: FakeServer, reader: str) -> None:
    """First token at 0.2 s, read at 0.65 s when the loop unblocks: TTFT 0.2 s, and the gap to the
    second token (at 1.0 s, counted by its shape) is 0.8 s, not the 0.35 s between the two reads."""
    for record in _stream_while_blocked(fake_server, _answer(0.2, 0.8), reader):
        assert 0.15 < record["ttft_s"] < 0.4, record["ttft_s"]  # read-time stamping gives >= 0.65
        assert record["chunk_gaps"] == [pytest.approx(0.8, abs=0.15)]
        assert record["first_read_tokens"] == 1  # its read held no later token: the stamp is its own arrival


@pytest.mark.parametrize("reader", READERS)
def test_a_first_token_read_with_the_next_one_says_its_ttft_is_an_upper_bound(fake_server: FakeServer,
                                                                              reader: str) -> None:
    """First token at 0.2 s, second at 0.3 s, both read at 0.65 s: the kernel gives the read the second's
    arrival (0.3 s), so TTFT is 0.1 s too long, and the record says so: two tokens came in the first one's read."""
    for record in _stream_while_blocked(fake_server, _answer(0.2, 0.1), reader):
        assert 0.25 < record["ttft_s"] < 0.5, record["ttft_s"]  # the second write's arrival, not the first's
        assert record["first_read_tokens"] == 2
        assert record["chunk_gaps"] == [0.0]


@pytest.mark.parametrize("reader", READERS)
def test_a_token_that_came_with_the_headers_keeps_their_arrival_time(fake_server: FakeServer, reader: str) -> None:
    """Headers and first token at 0.2 s, both read at 0.65 s: TTFB and TTFT are 0.2 s (the first read is
    the transport's own, stamped, before the header parser sees the bytes)."""
    for record in _stream_while_blocked(fake_server, _answer(0.0, 0.8, headers_after=0.2), reader):
        assert 0.15 < record["ttfb_s"] < 0.4, record["ttfb_s"]
        assert 0.15 < record["ttft_s"] < 0.4, record["ttft_s"]
        assert record["ttft_s"] >= record["ttfb_s"]
