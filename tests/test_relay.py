"""A relay in the middle (LiteLLM in front of llama.cpp, say): what it changes on the wire, read right.

Scripted streams that do what a relay does: usage counts of 0 first and the real
ones at the end, no request-id header but a call id of its own (or none: the
stream's own id), an answer cut for length below the max_tokens asked. Each is
read by probe's client (`stream_once`) and, where the load path differs, by a real
`tokenload run`.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from fakeserver import WIRES, FakeServer, Received, Script, api_base, json_script, stream_script
from loadkit import run_cli, write_scenario

from tokenload.analysis import analyze_run
from tokenload.analysis.report import verdict_rows
from tokenload.channel import Channel
from tokenload.protocolspec import PROTOCOLS, SPECS
from tokenload.tokens import estimate_tokens
from tokenload.transport.httpx_client import stream_once

KEY = "sk-relay-test-1234567890"
PROMPT = "Say hello to the relay, please."
TOKENS = ["a", "b", "c", "d"]
# message_start as LiteLLM's Anthropic route sends it, and the real counts it sends in message_delta
RELAY_START = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
RELAY_DELTA = {"input_tokens": 5, "cache_read_input_tokens": 22, "cache_creation_input_tokens": 0}
# How the relay reports a stream's 27 input tokens, where it is not as the protocol's fake does by default.
RELAY_USAGE: dict[str, dict[str, Any]] = {"anthropic": {"start_usage": RELAY_START, "delta_usage": RELAY_DELTA}}


def channel_for(server: FakeServer, protocol: str) -> Channel:
    return Channel(base_url=api_base(server.url, protocol, ""), protocol=protocol, api_key=KEY)


def once(server: FakeServer, protocol: str, script: Script, max_tokens: int = 32) -> dict[str, Any]:
    server.play(script)
    record = dict(stream_once(channel_for(server, protocol), PROMPT, max_tokens))
    assert record["status"] == "ok", record["error_message"]
    return record


def with_headers(script: Script, *headers: tuple[str, str]) -> Script:
    return Script(status=script.status, headers=(*script.headers, *headers), writes=script.writes)


# ------------------------------------------------------------------------------------------ usage


def test_anthropic_usage_zero_at_the_start_real_at_the_end_is_read(fake_server: FakeServer) -> None:
    """LiteLLM: 0 in message_start, input 5 + cache read 22 in message_delta: the prompt was 27 tokens."""
    record = once(fake_server, "anthropic", stream_script("anthropic", TOKENS, start_usage=RELAY_START,
                                                          delta_usage=RELAY_DELTA))
    assert (record["input_tokens"], record["input_tokens_source"]) == (27, "server")
    assert (record["cache_read_input_tokens"], record["cache_creation_input_tokens"]) == (22, 0)
    assert (record["output_tokens"], record["output_tokens_source"]) == (4, "server")


def test_anthropic_usage_zero_and_nothing_later_is_unknown_not_zero(fake_server: FakeServer) -> None:
    record = once(fake_server, "anthropic", stream_script("anthropic", TOKENS, start_usage=RELAY_START))
    assert (record["input_tokens"], record["input_tokens_source"]) == (estimate_tokens(PROMPT), "estimate")


def test_anthropic_start_counts_stand_when_the_delta_has_output_only(fake_server: FakeServer) -> None:
    """Anthropic's own servers: the input and cache counts in message_start, output only in message_delta."""
    start = {"input_tokens": 5, "cache_read_input_tokens": 22, "cache_creation_input_tokens": 3, "output_tokens": 1}
    record = once(fake_server, "anthropic", stream_script("anthropic", TOKENS, start_usage=start,
                                                          delta_usage={"cache_read_input_tokens": 0}))
    assert (record["input_tokens"], record["input_tokens_source"]) == (30, "server")
    assert (record["cache_read_input_tokens"], record["cache_creation_input_tokens"]) == (22, 3)


@pytest.mark.parametrize("protocol", [p for p in PROTOCOLS if SPECS[p].family == "openai"])
def test_openai_usage_of_zero_input_is_unknown(fake_server: FakeServer, protocol: str) -> None:
    record = once(fake_server, protocol, stream_script(protocol, TOKENS, input_tokens=0))
    assert (record["input_tokens"], record["input_tokens_source"]) == (estimate_tokens(PROMPT), "estimate")
    assert (record["output_tokens"], record["output_tokens_source"]) == (4, "server")


# ---------------------------------------------------------------------------- server_request_id


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_request_id_is_the_streams_own_id_without_a_header(fake_server: FakeServer, protocol: str) -> None:
    """llama.cpp sends no request-id header: the stream's id (msg_, chatcmpl-, resp_) joins to its log."""
    record = once(fake_server, protocol, stream_script(protocol, TOKENS))
    assert record["server_request_id"] == WIRES[protocol].stream_id


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("header", "value"), [("x-litellm-call-id", "7f1c-call"), ("request-id", "req_011abc"),
                                                 ("X-Request-ID", "b5e0-req")])
def test_server_request_id_from_a_header_wins(fake_server: FakeServer, protocol: str, header: str, value: str) -> None:
    record = once(fake_server, protocol, with_headers(stream_script(protocol, TOKENS), (header, value)))
    assert record["server_request_id"] == value


def test_a_vendor_request_id_wins_over_a_relay_call_id(fake_server: FakeServer) -> None:
    script = with_headers(stream_script("anthropic", TOKENS), ("x-litellm-call-id", "call-1"), ("request-id", "req_1"))
    assert once(fake_server, "anthropic", script)["server_request_id"] == "req_1"


# ------------------------------------------------------------------------------------- truncated


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_answer_cut_for_length_below_max_tokens_is_truncated(fake_server: FakeServer, protocol: str) -> None:
    """llama.cpp's full context slot: it stops for length after 4 tokens of the 32 asked."""
    record = once(fake_server, protocol, stream_script(protocol, TOKENS, **WIRES[protocol].for_length), max_tokens=32)
    assert record["stop_reason"] == SPECS[protocol].length_stop
    assert record["truncated"] is True


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_answer_that_reached_max_tokens_or_stopped_is_not_truncated(fake_server: FakeServer, protocol: str) -> None:
    at_limit = once(fake_server, protocol, stream_script(protocol, TOKENS, **WIRES[protocol].for_length), max_tokens=4)
    natural = once(fake_server, protocol, stream_script(protocol, TOKENS), max_tokens=32)
    assert at_limit["truncated"] is False and natural["truncated"] is False


def test_a_failed_request_is_not_truncated(fake_server: FakeServer) -> None:
    fake_server.play(json_script(500, {"error": {"message": "boom", "type": "server_error"}}))
    record = stream_once(channel_for(fake_server, "openai-chat"), PROMPT, 32)
    assert record["status"] == "error" and record["truncated"] is False


# ------------------------------------------------------------------------------------ load path


def _relay(protocol: str) -> Any:
    """A relay's answers: ids only in the stream (one per request), zeros-then-real usage, cut for length."""
    numbers = itertools.count(1)

    def answer(received: Received) -> Script:
        if received.method != "POST":
            return json_script(404, {"error": {"message": "not found", "type": "not_found"}})
        fake = WIRES[protocol]
        kw = {fake.id_keyword: fake.stream_id.replace("fake01", f"{next(numbers):04d}"),
              **RELAY_USAGE.get(protocol, {"input_tokens": 27})}
        return stream_script(protocol, TOKENS, 0.0, 0.005, **kw, **fake.for_length)

    return answer


def _two_users(tmp_path: Path, max_tokens: int, step_s: float, drain_s: float) -> Path:
    """2 users with 16-token prompts for one step."""
    return write_scenario(tmp_path, f"""
[prompt]
tokens = 16
[output]
max_tokens = {max_tokens}
[load]
kind = "constant"
users = 2
step_s = {step_s}
[stop]
drain_s = {drain_s}
""")


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_load_path_records_the_relays_counts_ids_and_truncation(fake_server: FakeServer, tmp_path: Path,
                                                                     protocol: str) -> None:
    """Real `tokenload run` (Locust, the load transport and its shape counting): the same record as probe's."""
    scenario = _two_users(tmp_path, max_tokens=32, step_s=2, drain_s=2)
    fake_server.route(_relay(protocol))
    base = api_base(fake_server.url, protocol, "")
    result = run_cli(scenario, base, tmp_path / "run", "--protocol", protocol, "--api-key", KEY)
    posted = sum(r.method == "POST" for r in fake_server.requests)
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert result.returncode == 0, result.stderr[-2000:]
    done = df[df.status == "ok"]
    assert len(done) >= 4
    prefix = WIRES[protocol].stream_id.split("fake")[0]
    assert done.server_request_id.str.startswith(prefix).all() and done.server_request_id.is_unique
    assert len(set(done.server_request_id)) <= posted
    assert (done.input_tokens == 27).all() and (done.input_tokens_source == "server").all()
    assert done.truncated.all() and (done.output_tokens == 4).all()
    summary = analyze_run(tmp_path / "run", write=False)
    assert summary["run"]["truncated"] == int(df.truncated.sum()) > 0
    assert any(topic == "Answers cut short" and str(len(df[df.truncated])) in finding
               for topic, finding, _ in verdict_rows(summary))


@pytest.mark.slow
def test_a_stream_cut_before_the_relays_counts_records_the_input_in_the_servers_tokens(
        fake_server: FakeServer, tmp_path: Path) -> None:
    """LiteLLM's Anthropic route sends the input count only at the end (here 3 server tokens per locally
    estimated one, as llama.cpp's Gemma counted 35 where the local estimate said 11): a stream the run's end
    cuts never gets it. Its record says `estimate` and counts in the server's tokens, calibrated on the answers
    that got their count, not the raw local estimate."""
    posts = itertools.count(1)

    def relay(received: Received) -> Script:
        slow = received.method == "POST" and next(posts) > 6
        prompt = received.json()["messages"][-1]["content"] if received.method == "POST" else ""
        text = prompt if isinstance(prompt, str) else " ".join(part["text"] for part in prompt)
        return stream_script("anthropic", TOKENS, 0.0, 3.0 if slow else 0.005, start_usage=RELAY_START,
                             delta_usage={"input_tokens": 3 * estimate_tokens(text)})

    fake_server.route(relay)
    scenario = _two_users(tmp_path, max_tokens=8, step_s=3, drain_s=0.5)
    result = run_cli(scenario, fake_server.url, tmp_path / "run", "--protocol", "anthropic", "--api-key", KEY)
    assert result.returncode == 0, result.stderr[-2000:]
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    done, cut = df[df.status == "ok"], df[df.status == "cancelled"]
    assert (done.input_tokens_source == "server").all() and len(cut) == 2, df[["status", "input_tokens"]]
    assert (cut.input_tokens_source == "estimate").all()
    assert (cut.input_tokens == 3 * cut.context_tokens).all(), cut[["input_tokens", "context_tokens"]]


# ---------------------------------------------------------------------------------- storm breaker

UPSTREAM_DOWN = {"error": {"message": "litellm.InternalServerError: InternalServerError: OpenAIException - "
                                      "Connection error. Received Model Group=claude-sonnet-4-5",
                           "type": None, "param": None, "code": "500"}}


def _storm_scenario(tmp_path: Path, step_s: float, storm_s: float, first_token_timeout_s: float = 120) -> Path:
    """4 users on one long step, the breaker's window `storm_s`, one probe before it gives up."""
    return write_scenario(tmp_path, f"""
[channel]
first_token_timeout_s = {first_token_timeout_s}
[prompt]
tokens = 16
[output]
max_tokens = 4
[load]
kind = "constant"
users = 4
step_s = {step_s}
[stop]
drain_s = 1
storm_s = {storm_s}
storm_probes = 1
""")


@pytest.mark.slow
def test_a_backend_dying_under_4_users_trips_the_storm_breaker(fake_server: FakeServer, tmp_path: Path) -> None:
    """The relay answers, its backend is gone: each request fails slowly (2 s, then a 500 naming the lost
    upstream connection), so 4 users end about 6 requests per 3 s window, under the old fixed 10. The
    breaker pauses every user within its window, its probe fails too, and the run stops saying why. The
    verdict names the outage in the relay's words, not a breakpoint "below 4 users" (the 8 before all passed)."""
    posts = itertools.count(1)

    def relay(received: Received) -> Script:
        if received.method == "POST" and next(posts) <= 8:
            return stream_script("anthropic", TOKENS, 0.0, 0.01)
        return Script(status=500, headers=(("content-type", "application/json"),), headers_delay_s=2.0,
                      writes=[(0.0, json.dumps(UPSTREAM_DOWN).encode())], framing="length")

    fake_server.route(relay)
    scenario = _storm_scenario(tmp_path, step_s=30, storm_s=3)
    result = run_cli(scenario, fake_server.url, tmp_path / "run", "--protocol", "anthropic", "--api-key", KEY)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert manifest["storms"], (manifest["stop_reason"], result.stderr[-1500:])
    storm = manifest["storms"][0]
    failing_since = df[df.status == "error"].started_at.min()
    # the failures started; within one window (plus a failure's 2 s and the breaker's tick) every user paused
    assert storm["paused_at"] - failing_since <= 3 + 2 + 2, storm
    users = df[df.phase != "storm_probe"]
    assert (users.started_at > storm["paused_at"] + 0.5).sum() == 0  # nothing the users sent while paused
    assert storm["outcome"] == "stopped" and manifest["stop_reason"].startswith(f"error storm: {storm['detail']}")
    assert len(df) == next(posts) - 1 and (df.phase == "storm_probe").sum() == 1  # what the relay saw, probe too
    summary = analyze_run(tmp_path / "run", write=False)
    outage = summary["outage"]
    assert outage is not None and outage["served_before"] == 8 and outage["http_status"] == 500
    assert abs(outage["at"] - failing_since) < 0.5, (outage, failing_since)
    assert summary["breakpoint"] is None and "went down" in summary["breakpoint_note"]
    said = {topic: finding for topic, finding, _ in verdict_rows(summary)}
    assert UPSTREAM_DOWN["error"]["message"] in said["Outage"] and "HTTP 500" in said["Outage"], said
    assert "backend" in said["First fix"], said


@pytest.mark.slow
def test_a_hung_backend_behind_a_live_relay_trips_the_storm_breaker(fake_server: FakeServer, tmp_path: Path) -> None:
    """The relay accepts each request and then says nothing (its backend hangs): no status line until the
    client gives up after its first-token timeout (3 s here; LiteLLM's was 35 s). At 4 users that is about 4
    failures per 3 s, each one a whole timeout long; the breaker pauses every user within its window, its
    probe hangs too, and the run stops saying error storm, which the analysis repeats (not "plan complete")."""
    posts = itertools.count(1)

    def relay(received: Received) -> Script:
        if received.method == "POST" and next(posts) <= 8:
            return stream_script("anthropic", TOKENS, 0.0, 0.01)
        return Script(status=500, headers=(("content-type", "application/json"),), headers_delay_s=30.0,
                      writes=[(0.0, b"{}")], framing="length")  # never reached: the client gives up first

    fake_server.route(relay)
    scenario = _storm_scenario(tmp_path, step_s=40, storm_s=6, first_token_timeout_s=3)
    result = run_cli(scenario, fake_server.url, tmp_path / "run", "--protocol", "anthropic", "--api-key", KEY,
                     timeout=120)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    records = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    df = records[records.phase != "storm_probe"]  # what the users sent
    assert manifest["storms"], (manifest["stop_reason"], result.stderr[-1500:])
    storm = manifest["storms"][0]
    assert (records.phase == "storm_probe").sum() == storm["failed_probes"] == 1
    failed = df[df.status == "error"]
    assert set(failed.error_kind) == {"timeout_first_token"} and failed.http_status.isna().all()  # no status seen
    # hanging since the 9th request was sent; within one window (plus one 3 s timeout and a tick) all paused
    hung_since = df.sort_values("started_at").started_at.iloc[8]
    assert storm["paused_at"] - hung_since <= 6 + 3 + 2, storm
    assert (df.started_at > storm["paused_at"] + 0.5).sum() == 0  # nothing sent while paused
    assert storm["outcome"] == "stopped" and manifest["stop_reason"].startswith(f"error storm: {storm['detail']}")
    summary = analyze_run(tmp_path / "run", write=False)
    assert summary["outage"]["errors_by_kind"] == {"timeout_first_token": len(failed)}  # hung: down all the same
    assert summary["breakpoint"] is None
    said = {topic: finding for topic, finding, _ in verdict_rows(summary)}
    assert said["Run incomplete"] == (f"the error-storm breaker stopped the run during step 1 of 1 "
                                      f"({manifest['stop_reason']})"), said
