"""The wire under real faults: keep-alive that dies, slow TLS, pings without tokens, gzip, error wordings.

Each case runs over real sockets against the scripted server (tests/fakeserver.py)
through both clients: the load transport (geventhttpclient, in a gevent-patched
child process, `_load`) and the probe client (httpx, `stream_once`).
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
from lagprobe import LagProbe
from stampserver import StampServer

from fakeserver import (
    WIRES,
    FakeServer,
    Script,
    Write,
    anthropic_stream,
    api_base,
    chat_stream,
    json_script,
    sse,
    stream_script,
)
from loadkit import free_port, run_cli, write_scenario

from tokenload import errors as ek
from tokenload.channel import Channel, redact_secrets, resolve
from tokenload.doctor import Doctor, Limits, check_latency
from tokenload.failures import classify_exception, fix_for
from tokenload.measure import Timeline, measure
from tokenload.protocolspec import PROTOCOLS
from tokenload.transport.httpx_client import stream_once

KEY = "sk-wire-test-0123456789abcdef"

_CHILD = r"""
from gevent import monkey; monkey.patch_all()
import json, sys, time
import gevent
from tokenload.channel import Channel
from tokenload.transport.gevent_client import Transport
from tokenload.protocols import adapter_for
from tokenload.stream import StreamSession

cfg = json.loads(sys.argv[1])
channel = Channel(**cfg["channel"])
adapter = adapter_for(channel)
transport = Transport(channel)
for case in cfg["cases"]:
    gevent.sleep(case.get("pause", 0.0))
    session = StreamSession(adapter, time.perf_counter())
    request = adapter.prepare(case.get("prompt", "hello") * case.get("repeat", 1), case.get("max_tokens", 8))
    started = time.perf_counter()
    transport.stream(request, session)
    record = session.record()
    record["elapsed_s"] = time.perf_counter() - started
    record["headers"] = session.timeline.response_headers
    print(json.dumps(record), flush=True)
    if cfg["lockstep"]:  # the test acts on the channel between two cases
        sys.stdin.readline()
"""


def _channel_fields(server_url: str, protocol: str, **fields: Any) -> dict[str, Any]:
    return {"base_url": api_base(server_url, protocol), "protocol": protocol, "api_key": KEY, **fields}


def _load(server_url: str, protocol: str, cases: list[dict[str, Any]], *, env: dict[str, str] | None = None,
          prefix: list[str] | None = None, between: Callable[[int], None] | None = None,
          **fields: Any) -> list[dict[str, Any]]:
    """Send `cases` one after another through one load `Transport`; one record each.

    `between(i)`, when given, runs after the i-th case's record and before the next case is sent."""
    cfg = {"channel": _channel_fields(server_url, protocol, **fields), "cases": cases, "lockstep": between is not None}
    with subprocess.Popen([*(prefix or []), sys.executable, "-c", _CHILD, json.dumps(cfg)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})}) as child:
        assert child.stdin is not None and child.stdout is not None
        lines = []
        for i in range(len(cases)):
            line = child.stdout.readline()
            if not line:
                break
            lines.append(line)
            if between is not None:
                between(i)
                child.stdin.write("\n")
                child.stdin.flush()
        _, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr
    records = [json.loads(line) for line in lines]
    assert not any(r["error_kind"] == ek.CLIENT_ERROR for r in records), records
    return records


def _probe(server: FakeServer, protocol: str, client: httpx.Client | None = None, **fields: Any) -> dict[str, Any]:
    return stream_once(Channel(**_channel_fields(server.url, protocol, **fields)), "hello", 8, client=client)


TOKENS = ["one", " two", " three", " four"]


# ------------------------------------------------------------ keep-alive and t0


def test_reused_connection_the_server_closed_is_resent_once(fake_server: FakeServer) -> None:
    """llama.cpp's server implies keep-alive and closes after each answer: no false `disconnected`."""
    fake_server.connection = "keep-alive-then-close"
    fake_server.play(stream_script("openai-chat", TOKENS, 0.02, 0.01))
    records = _load(fake_server.url, "openai-chat", [{}] * 6)
    assert [r["error_kind"] for r in records] == [None] * 6
    assert [r["reconnects"] for r in records] == [0, 1, 1, 1, 1, 1]
    assert fake_server.dropped == 5 and len(fake_server.requests) == 6  # the server answered each request once
    assert all(r["connect_s"] > 0 for r in records)  # each answer came on a fresh connection


def test_keep_alive_reuses_one_connection_with_zero_connect_time(fake_server: FakeServer) -> None:
    fake_server.connection = "keep-alive"
    fake_server.play(stream_script("anthropic", TOKENS, 0.02, 0.01))
    records = _load(fake_server.url, "anthropic", [{}] * 3)
    assert [r["status"] for r in records] == ["ok"] * 3
    assert records[0]["connect_s"] > 0 and [r["connect_s"] for r in records[1:]] == [0.0, 0.0]
    assert [r["reconnects"] for r in records] == [0, 0, 0]
    assert {r.connection for r in fake_server.requests} == {1}


def test_t0_is_when_the_request_was_out_so_a_held_back_write_is_send_lag_not_ttft() -> None:
    """A server that reads a new connection only after 0.6 s, through a small receive buffer: a 10 MB request
    cannot be written until then. Both clients count that wait as the client's (`send_lag_s`), and TTFT is the
    server's own: from the kernel's arrival of the request's last byte to its first token (50 ms)."""
    prompt, repeat = "word ", 2_000_000
    with StampServer(ttft_s=0.05, read_delay_s=0.6, rcvbuf=4096) as server, LagProbe() as lag:
        records = _load(server.base_url, "anthropic", [{"prompt": prompt, "repeat": repeat}])
        records.append(stream_once(Channel(**_channel_fields(server.base_url, "anthropic")), prompt * repeat, 8))
        truth = server.ttfts(len(records))
    for record in records:
        assert record["status"] == "ok", record["error_message"]
        true_ttft = truth[record["server_request_id"]]
        assert abs(record["ttft_s"] - true_ttft) < _margin(record, lag), (record["ttft_s"], true_ttft, lag.worst)
        assert record["send_lag_s"] > 0.4 and record["send_lag_s"] >= record["connect_s"] > 0


def test_no_latency_is_negative_when_the_answer_starts_before_the_write_returns() -> None:
    """Headers written the moment the connection is accepted reach the client's kernel before its write of the
    request returns (t0): their arrival stamp comes first. No latency may read below zero, and TTFT is still the
    server's own."""
    with StampServer(ttft_s=0.05, early_headers=True) as server, LagProbe() as lag:
        records = _load(server.base_url, "anthropic", [{}] * 4)
        records.append(stream_once(Channel(**_channel_fields(server.base_url, "anthropic")), "hello", 8))
        truth = server.ttfts(len(records))
    for record in records:
        assert record["status"] == "ok", record["error_message"]
        assert record["ttfb_s"] >= 0 and record["ttft_s"] >= record["ttfb_s"], (record["ttfb_s"], record["ttft_s"])
        true_ttft = truth[record["server_request_id"]]
        assert abs(record["ttft_s"] - true_ttft) < _margin(record, lag), (record["ttft_s"], true_ttft, lag.worst)


def _margin(record: dict[str, Any], lag: LagProbe) -> float:
    """How far a record's TTFT may be from the server's: 40 ms, and where the client stamped an end with its
    own clock (`ttft_exact` false: httpx), how late this process's threads woke meanwhile, at each end."""
    return 0.04 + (0 if record["ttft_exact"] else 2 * lag.worst)


def test_connection_close_in_the_response_is_honoured(fake_server: FakeServer) -> None:
    """The answer says `Connection: close` but the socket stays open: the client must not reuse it."""
    fake_server.connection = "close-header-only"
    fake_server.play(stream_script("openai-chat", TOKENS, 0.02, 0.01))
    records = _load(fake_server.url, "openai-chat", [{}] * 3)
    assert [r["status"] for r in records] == ["ok"] * 3
    assert [r.connection for r in fake_server.requests] == [1, 2, 3]
    assert all(r["connect_s"] > 0 for r in records)


def test_run_against_a_server_that_closes_after_each_answer_has_no_disconnected(
        fake_server: FakeServer, tmp_path: Path) -> None:
    """A short `tokenload run` (the issue's 2-minute run, bounded to seconds) with zero think time."""
    fake_server.connection = "keep-alive-then-close"
    fake_server.play(stream_script("openai-chat", TOKENS, 0.01, 0.005))
    scenario = write_scenario(tmp_path, """
[output]
max_tokens = 4
[load]
kind = "steps"
users = [4]
step_s = 4
[stop]
drain_s = 3
""")
    result = run_cli(scenario, fake_server.url + "/v1", tmp_path / "run", "--protocol", "openai-chat",
                     "--api-key", KEY, model="gpt-test")
    assert result.returncode == 0, result.stderr
    df = pd.read_parquet(Path(result.stdout.strip().splitlines()[-1]) / "requests.parquet")
    assert len(df) >= 20
    assert (df.error_kind == "disconnected").sum() == 0 and (df.status == "ok").all()
    assert df.reconnects.sum() > 0 and fake_server.dropped == df.reconnects.sum()
    sent = [r for r in fake_server.requests if r.path != "/metrics"]  # the run's one look for server metrics aside
    assert len(sent) == len(df)  # nothing was sent twice that the server answered


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: cannot make a self-signed certificate for the TLS cases")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                           str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                          capture_output=True, text=True, timeout=60, check=False)
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr.strip()[:200]}")
    return cert, key


@pytest.fixture
def slow_tls_server(tls_files: tuple[Path, Path]) -> Iterator[FakeServer]:
    cert, key = tls_files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = FakeServer(tls=context, handshake_delay_s=0.5)
    server.connection = "keep-alive"
    yield server
    server.close()


def test_tls_setup_is_connect_time_not_ttft_under_load(slow_tls_server: FakeServer, tls_files: tuple[Path, Path]) -> None:
    slow_tls_server.play(stream_script("anthropic", TOKENS, 0.1, 0.01))
    records = _load(slow_tls_server.url, "anthropic", [{}] * 2, env={"SSL_CERT_FILE": str(tls_files[0])})
    first, second = records
    assert first["status"] == second["status"] == "ok"
    assert first["connect_s"] >= 0.45  # the held-back handshake
    assert 0.09 <= first["ttft_s"] < 0.5  # the server's 0.1 s, not 0.6 s
    assert second["connect_s"] == 0.0 and second["ttft_s"] < 0.5


def test_tls_setup_is_connect_time_not_ttft_in_probe(slow_tls_server: FakeServer, tls_files: tuple[Path, Path]) -> None:
    slow_tls_server.play(stream_script("openai-chat", TOKENS, 0.1, 0.01))
    with httpx.Client(verify=ssl.create_default_context(cafile=str(tls_files[0]))) as client:
        first = _probe(slow_tls_server, "openai-chat", client)
        second = _probe(slow_tls_server, "openai-chat", client)
    assert first["status"] == second["status"] == "ok"
    assert first["connect_s"] >= 0.45 and 0.09 <= first["ttft_s"] < 0.5
    assert second["connect_s"] == 0.0


def test_plain_probe_records_connect_time(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.play(stream_script("anthropic", TOKENS, 0.05, 0.01))
    record = _probe(fake_server, "anthropic")
    assert record["status"] == "ok" and 0 < record["connect_s"] < 0.5 and record["reconnects"] == 0
    out = subprocess.run([sys.executable, "-m", "tokenload", "probe", "--json", "--base-url", fake_server.url + "/api",
                          "--api-key", KEY], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
                         env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["connect_s"] > 0 and shown["reconnects"] == 0 and shown["eos_only"] is False
    assert "cache_read_input_tokens" in shown
    table = subprocess.run([sys.executable, "-m", "tokenload", "probe", "--base-url", fake_server.url + "/api",
                            "--api-key", KEY], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
                           env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "TERM": "dumb"})
    assert table.returncode == 0 and "connect (TCP+TLS)" in table.stdout


# --------------------------------------------------------------- deadlines


def _tokens_then_keepalives(keepalive: bytes) -> Script:
    writes = anthropic_stream(TOKENS, 0.05, 0.02)
    first_token = next(i for i, (_, data) in enumerate(writes) if b"text_delta" in data)
    return Script(writes=[*writes[: first_token + 2], *[(0.1, keepalive)] * 40], ending="hang")


KEEPALIVES = [sse({"type": "ping"}, "ping"), b": keepalive\n\n"]


@pytest.mark.parametrize("keepalive", KEEPALIVES, ids=["event-ping", "comment"])
def test_keepalives_after_a_token_do_not_defeat_the_stall_timeout(fake_server: FakeServer, keepalive: bytes) -> None:
    fake_server.play(_tokens_then_keepalives(keepalive))
    start = time.perf_counter()
    record = _probe(fake_server, "anthropic", idle_timeout_s=0.6)
    assert (record["error_kind"], record["chunks"]) == (ek.TIMEOUT_STALL, 2)
    assert time.perf_counter() - start < 2.5  # 0.6 s after the last token, not the 4 s of pings
    fake_server.play(_tokens_then_keepalives(keepalive))
    [loaded] = _load(fake_server.url, "anthropic", [{}], idle_timeout_s=0.6)
    assert (loaded["error_kind"], loaded["chunks"]) == (ek.TIMEOUT_STALL, 2)
    assert loaded["elapsed_s"] < 2.5


def test_first_token_deadline_applies_before_the_headers(fake_server: FakeServer) -> None:
    """Headers held back past the first-token timeout: that timeout ends it, not max(first-token, idle)."""
    fake_server.play(Script(writes=anthropic_stream(["a"]), headers_delay_s=6.0))
    [record] = _load(fake_server.url, "anthropic", [{}], first_token_timeout_s=0.6, idle_timeout_s=4.0)
    assert record["error_kind"] == ek.TIMEOUT_FIRST_TOKEN and record["http_status"] is None
    assert 0.5 <= record["elapsed_s"] < 2.5


# ------------------------------------------------------------------ gzip


def _gzipped(writes: list[Write]) -> Script:
    """The same stream, gzip-compressed, flushed after every write (a compressing proxy that streams)."""
    packer = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
    out = [(delay, packer.compress(data) + packer.flush(zlib.Z_SYNC_FLUSH)) for delay, data in writes]
    out.append((0.0, packer.flush()))
    return Script(headers=(("content-type", "text/event-stream"), ("content-encoding", "gzip")), writes=out)


def test_gzip_stream_is_decoded_under_load_and_identity_asked(fake_server: FakeServer) -> None:
    fake_server.play(_gzipped(chat_stream(TOKENS, 0.02, 0.02)))
    [record] = _load(fake_server.url, "openai-chat", [{}])
    assert record["status"] == "ok" and record["chunks"] == 4 and record["output_tokens"] == 4
    assert fake_server.last.headers["accept-encoding"] == "identity"
    assert record["headers"]["content-encoding"] == "gzip"  # response headers stay on the session


def test_gzip_json_error_is_decoded_under_load(fake_server: FakeServer) -> None:
    body = gzip.compress(json.dumps({"error": {"message": "Invalid API key", "type": "authentication_error"}}).encode())
    fake_server.play(Script(status=401, headers=(("content-type", "application/json"), ("content-encoding", "gzip")),
                            writes=[(0.0, body)], framing="length"))
    [record] = _load(fake_server.url, "openai-chat", [{}])
    assert record["error_kind"] == ek.AUTH and "Invalid API key" in record["error_message"]


def test_a_body_that_is_not_the_gzip_it_claims_is_malformed(fake_server: FakeServer) -> None:
    fake_server.play(Script(headers=(("content-type", "text/event-stream"), ("content-encoding", "gzip")),
                            writes=chat_stream(TOKENS)))
    assert _probe(fake_server, "openai-chat")["error_kind"] == ek.MALFORMED_STREAM
    [record] = _load(fake_server.url, "openai-chat", [{}])
    assert record["error_kind"] == ek.MALFORMED_STREAM and "could not be decoded" in record["error_message"]


# ------------------------------------------------------------ error kinds


CONTEXT_ERRORS = [
    ({"error": {"code": 400, "message": "request (9000 tokens) exceeds the available context size (4096 tokens), "
                "try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 4096}},
     4096, 9000),
    ({"error": {"message": "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens "
                "(8000 in the messages, 1000 in the completion). Please reduce the length of the messages or "
                "completion.", "type": "BadRequestError", "param": None, "code": 400}}, 4096, 8000),
    ({"error": {"message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context "
                "length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).",
                "type": "BadRequestError", "param": None, "code": 400}}, 4096, 2778),
    ({"error": {"message": "This model's maximum context length is 8192 tokens. However, your messages resulted in "
                "9000 tokens. Please reduce the length of the messages.", "type": "invalid_request_error",
                "param": "messages", "code": "context_length_exceeded"}}, 8192, 9000),
    ({"type": "error", "error": {"type": "invalid_request_error",
                                 "message": "prompt is too long: 208656 tokens > 200000 maximum"}}, 200000, 208656),
    ({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it",
                "type": "invalid_request_error"}}, None, None),
]


@pytest.mark.parametrize(("body", "limit", "prompt"), CONTEXT_ERRORS,
                         ids=["llama.cpp", "vllm-old", "vllm-new", "openai", "anthropic", "llama.cpp-old"])
def test_prompt_too_long_is_context_length_naming_the_limit(fake_server: FakeServer, body: dict[str, Any],
                                                            limit: int | None, prompt: int | None) -> None:
    fake_server.play(json_script(400, body))
    record = _probe(fake_server, "openai-chat")
    assert record["error_kind"] == ek.CONTEXT_LENGTH
    if limit is not None:
        assert f"context limit {limit} tokens" in record["error_message"]
        assert f"request {prompt} tokens" in record["error_message"]
    else:
        assert "exceeds the available context size" in record["error_message"]


def test_context_length_under_load(fake_server: FakeServer) -> None:
    fake_server.play(json_script(400, CONTEXT_ERRORS[0][0]))
    [record] = _load(fake_server.url, "openai-chat", [{}])
    assert record["error_kind"] == ek.CONTEXT_LENGTH and "context limit 4096 tokens" in record["error_message"]


@pytest.mark.parametrize(("body", "kind"), [
    ({"error": {"message": "Invalid API key", "type": "authentication_error"}}, ek.AUTH),
    ({"error": {"message": "invalid token (request id: 2025)", "type": "new_api_error", "code": ""}}, ek.AUTH),
    ({"error": {"message": "model gpt-x does not exist", "type": "invalid_request_error"}}, ek.NOT_FOUND_MODEL),
    ({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}, ek.RATE_LIMITED),
], ids=["auth", "relay-auth", "model", "rate-limit"])
def test_200_with_a_json_error_body_is_classified_by_the_body(fake_server: FakeServer, body: dict[str, Any],
                                                              kind: str) -> None:
    fake_server.play(json_script(200, body))
    assert _probe(fake_server, "openai-chat")["error_kind"] == kind
    [record] = _load(fake_server.url, "openai-chat", [{}])
    assert record["error_kind"] == kind and record["http_status"] == 200


def test_200_event_stream_carrying_a_bare_json_error(fake_server: FakeServer) -> None:
    body = json.dumps({"error": {"message": "Invalid API key", "type": "authentication_error"}}).encode()
    fake_server.play(Script(writes=[(0.0, body)], framing="length"))
    assert _probe(fake_server, "openai-chat")["error_kind"] == ek.AUTH


def test_refused_connection_is_bad_base_url_under_load() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    [record] = _load(url, "anthropic", [{}])
    assert record["error_kind"] == ek.BAD_BASE_URL and "refused" in record["error_message"]
    fix = fix_for(record["error_kind"], record["error_message"]) or ""
    assert "host and port" in fix and "home page" not in fix  # nothing listened there: no page to mistake


def test_a_refusal_after_the_channel_answered_is_connection_refused_a_load_error() -> None:
    """The server answers, then dies mid-run: its refusals are an outage (load, counted in the SLO), not a
    wrong address (config, which the live misconfiguration stop acts on and the SLO leaves out)."""
    server = FakeServer()
    server.play(stream_script("anthropic", TOKENS))
    try:
        first, after = _load(server.url, "anthropic", [{}, {}], between=lambda _: server.close())
    finally:
        server.close()
    assert first["status"] == "ok"
    assert after["error_kind"] == ek.CONNECTION_REFUSED and "refused" in after["error_message"], after
    assert ek.error_class(after["error_kind"]) == "load"


# What LiteLLM sends when the model server behind it dies mid-answer (HTTP 200, tokens, then this), per route.
RELAY_CUT = {
    "anthropic": sse({"type": "error", "error": {"type": "api_error", "message": (
        "Response payload is not completed: <TransferEncodingError: 400, message='Not enough data to satisfy "
        "transfer length header.'>")}}, "error"),
    "openai-chat": sse({"error": {"message": "litellm.APIConnectionError: APIConnectionError: OpenAIException - "
                                             "Connection error.", "type": None, "param": None, "code": "500"}}),
    "openai-responses": sse({"type": "response.failed", "sequence_number": 9, "response": {
        "id": "resp_x", "object": "response", "status": "failed", "output": [], "error": {
            "code": "server_error", "message": "Response payload is not completed: <TransferEncodingError: 400, "
                                              "message='Not enough data to satisfy transfer length header.'>"}}},
                                "response.failed") + b"data: [DONE]\n\n",
}


@pytest.mark.parametrize("protocol", sorted(RELAY_CUT))
def test_a_relay_whose_upstream_was_cut_mid_stream_is_disconnected(fake_server: FakeServer, protocol: str) -> None:
    """HTTP 200, two tokens, then the relay's own words for its cut upstream stream: `disconnected`, on both
    clients, with the timings the stream got (not a `server_error` the server chose to send)."""
    writes = [w for w in WIRES[protocol].build(TOKENS) if not any(t.encode() in w[1] for t in TOKENS[2:])]
    end = max(i for i, (_, data) in enumerate(writes) if TOKENS[1].encode() in data) + 1
    fake_server.play(Script(writes=[*writes[:end], (0.0, RELAY_CUT[protocol])]))
    for record in (_probe(fake_server, protocol), *_load(fake_server.url, protocol, [{}])):
        assert record["error_kind"] == ek.DISCONNECTED and record["http_status"] == 200, record
        assert record["ttft_s"] is not None and record["chunks"] >= 2, record


def _no_network() -> list[str]:
    """A command prefix that runs in a fresh network namespace whose only interface (lo) is down."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed: cannot run a client without a network")
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True, timeout=10, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {probe.stderr.strip()[:200]}")
    return ["unshare", "-rn"]


@pytest.mark.parametrize("host", ["127.0.0.1:9", "tokenload-test.invalid"], ids=["unreachable", "dns"])
def test_network_down_is_bad_base_url_on_every_path(host: str) -> None:
    prefix = _no_network()
    [record] = _load(f"http://{host}", "anthropic", [{}], prefix=prefix)
    assert record["error_kind"] == ek.BAD_BASE_URL, record["error_message"]
    code = ("import json; from tokenload.channel import Channel; from tokenload.transport.httpx_client import stream_once; "
            f"print(json.dumps(stream_once(Channel(base_url='http://{host}', api_key='{KEY}'), 'hi', 4)))")
    out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["error_kind"] == ek.BAD_BASE_URL


def test_exception_map_on_real_socket_errors() -> None:
    url = "http://relay.example/api"
    unreachable = OSError(errno.ENETUNREACH, "Network is unreachable")
    assert classify_exception(unreachable, url)[0] == ek.BAD_BASE_URL
    wrapped = httpx.ConnectError("[Errno 101] Network is unreachable")
    wrapped.__cause__ = unreachable
    assert classify_exception(wrapped, url)[0] == ek.BAD_BASE_URL
    assert classify_exception(ConnectionResetError(errno.ECONNRESET, "reset"), url)[0] == ek.DISCONNECTED
    assert classify_exception(TimeoutError("timed out"), url, connecting=True)[0] == ek.TIMEOUT_FIRST_TOKEN
    assert classify_exception(ValueError("our bug"), url)[0] == ek.CLIENT_ERROR


# ------------------------------------------------------------ short secrets


def test_short_keys_are_not_secrets_and_long_ones_are_masked_everywhere(fake_server: FakeServer) -> None:
    assert redact_secrets("max_tokens must be positive", ["a"]) == "max_tokens must be positive"
    assert redact_secrets("max_tokens", ["tokens"]) == "max_tokens"  # 6 characters: not a secret
    masked = redact_secrets(f"bad key {KEY}, url ?key%3D{KEY}", [KEY])
    assert KEY not in masked and "max_tokens" not in masked
    fake_server.play(json_script(400, {"error": {"message": "max_tokens: 10000 > 4096 for key a",
                                                 "type": "invalid_request_error"}}))
    record = stream_once(Channel(base_url=fake_server.url + "/api", api_key="a"), "hello", 8)
    assert record["error_message"] == "max_tokens: 10000 > 4096 for key a"


# ------------------------------------------------------------ EOS-aware TPOT


def _timeline(tokens: int, output_tokens: int, stop_reason: str) -> Timeline:
    tl = Timeline(t0=0.0)
    for i in range(tokens):
        tl.token(1.0 + 0.1 * i, "text", "x")
    tl.output_tokens, tl.stop_reason, tl.complete, tl.t_end = output_tokens, stop_reason, True, 2.0
    return tl


def test_eos_counted_but_not_streamed_does_not_shrink_tpot() -> None:
    record = measure(_timeline(5, 6, "stop"))  # llama.cpp: 5 streamed, usage 6 (the EOS)
    assert record["tpot_s"] == pytest.approx(0.1) and not record["eos_only"]
    assert measure(_timeline(5, 6, "length"))["tpot_s"] == pytest.approx(0.08)  # no natural stop: N is the count
    assert measure(_timeline(5, 5, "end_turn"))["tpot_s"] == pytest.approx(0.1)
    only = measure(_timeline(0, 1, "end_turn"))
    assert only["eos_only"] and only["status"] == "ok" and only["ttft_s"] is None and only["tpot_s"] is None


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_eos_aware_tpot_over_http(fake_server: FakeServer, protocol: str) -> None:
    fake_server.play(stream_script(protocol, TOKENS, 0.05, 0.05, output_tokens=len(TOKENS) + 1))
    record = _probe(fake_server, protocol)
    assert record["status"] == "ok" and record["output_tokens"] == 5 and record["chunks"] == 4
    assert record["tpot_s"] == pytest.approx(0.05, abs=0.02)  # span / 3 gaps, not span / 4
    fake_server.play(stream_script(protocol, [], 0.05, 0.05, output_tokens=1))
    only = _probe(fake_server, protocol)
    assert only["eos_only"] and only["ttft_s"] is None


# ------------------------------------------------------------ doctor latency


def test_doctor_latency_prompt_is_fresh_and_cached_tokens_reported(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.play(stream_script("anthropic", TOKENS, 0.02, 0.01))
    resolution = resolve(base_url=fake_server.url + "/api", api_key=KEY, model="claude-test", env={}, cwd=tmp_path,
                         home=tmp_path)
    prompts = []
    for _ in range(2):  # two doctor runs
        check_latency(Doctor(resolution, {}, tmp_path, tmp_path, Limits(prompt_tokens=50)))
        # the doctor's own request: under load a request of an earlier test's client can arrive after it
        sent = [r for r in fake_server.requests if r.path.endswith("/messages")]
        prompts.append(sent[-1].json()["messages"][0]["content"])
    assert prompts[0][:30] != prompts[1][:30]  # they differ at the very start: no cached prefix

    cached = [(delay, data.replace(b'"input_tokens": 12', b'"input_tokens": 2, "cache_read_input_tokens": 40'))
              for delay, data in anthropic_stream(TOKENS, 0.02, 0.01)]
    fake_server.play(Script(writes=cached))
    result = check_latency(Doctor(resolution, {}, tmp_path, tmp_path, Limits(prompt_tokens=50)))
    assert result.details["cached_tokens"] == 40 and "40 of them from the server's prompt cache" in result.saw
