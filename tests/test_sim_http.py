"""Routing, auth bodies, keep-alive, profiles and the CLI / subprocess launcher."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from simfixtures import anthropic_body, chat_body, raw_request, read_truth

from tokenload.errors import ConfigError
from tokenload.sim import Profile, builtin_profiles, launch, load_profile, serve_in_thread

KEY = "sk-http-secret"


@pytest.mark.parametrize("path,status", [
    ("/", 200), ("/api", 200), ("/api/", 200), ("/v1/messages", 404), ("/api/v1/v1/messages", 404),
    ("/api/dashboard", 404)])
def test_wrong_paths_get_an_html_page(fast_sim: Any, path: str, status: int) -> None:
    url = urlsplit(fast_sim.base_url)
    response = raw_request(f"http://{url.netloc}", path, anthropic_body("hi"))
    assert response.status == status and response.headers["content-type"].startswith("text/html")
    assert b"<html>" in response.body


def test_known_path_with_wrong_method_is_html_404(fast_sim: Any) -> None:
    response = raw_request(fast_sim.base_url, "/v1/messages", method="GET")
    assert response.status == 404 and response.headers["content-type"].startswith("text/html")


def test_health_and_beta_query(fast_sim: Any) -> None:
    assert raw_request(fast_sim.base_url, "/health", method="GET").status == 200
    response = raw_request(fast_sim.base_url, "/v1/messages?beta=true", anthropic_body("beta", 2))
    assert response.status == 200 and response.json_events()[-1]["type"] == "message_stop"


def test_keep_alive_serves_several_streams_on_one_connection(fast_sim: Any) -> None:
    url = urlsplit(fast_sim.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    for i in range(3):
        conn.request("POST", f"{url.path}/v1/chat/completions", json.dumps(chat_body(f"keep {i}", 3)),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.read().endswith(b"data: [DONE]\n\n")
    conn.close()


def test_a_protocol_with_nothing_before_its_tokens_still_streams(fast_sim: Any, monkeypatch: Any) -> None:
    """A framer with no preamble (a protocol whose stream starts with its first token): an empty chunk would have
    ended the chunked body before any token (found by a toy fourth protocol)."""
    from tokenload.sim import wire

    monkeypatch.setattr(wire.OpenAIChatFramer, "preamble", lambda self: b"")
    response = raw_request(fast_sim.base_url, "/v1/chat/completions", chat_body("no preamble", 3))
    assert response.status == 200 and response.body.endswith(b"data: [DONE]\n\n")


def test_401_bodies_are_exact_and_the_key_never_leaks(tmp_path: Path) -> None:
    truth = tmp_path / "t.jsonl"
    with serve_in_thread("fast", api_key=KEY, truth_path=truth) as sim:
        missing = raw_request(sim.base_url, "/v1/messages", anthropic_body("x"))
        wrong = raw_request(sim.base_url, "/v1/chat/completions", chat_body("x"), headers={"Authorization": "Bearer nope"})
        good = raw_request(sim.base_url, "/v1/messages", anthropic_body("x", 1), headers={"x-api-key": KEY})
        models = raw_request(sim.base_url, "/v1/models", method="GET")
    assert missing.status == 401 and json.loads(missing.body) == {
        "type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"},
        "request_id": missing.headers["request-id"]}
    assert wrong.status == 401 and json.loads(wrong.body) == {"error": {
        "message": "Incorrect API key provided.", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    assert good.status == 200 and models.status == 401
    assert KEY not in truth.read_text()
    assert [r["error"] for r in read_truth(truth).values()] == ["auth", "auth", None, "auth"]


def test_bad_requests_get_400_in_the_protocol_shape(fast_sim: Any) -> None:
    no_max = raw_request(fast_sim.base_url, "/v1/messages", {"model": "sim-7b", "messages": [{"role": "user", "content": "x"}]})
    assert no_max.status == 400 and json.loads(no_max.body)["error"]["type"] == "invalid_request_error"
    not_json = raw_request(fast_sim.base_url, "/v1/chat/completions", b"{nope")
    assert not_json.status == 400 and "error" in json.loads(not_json.body)
    too_long = raw_request(fast_sim.base_url, "/v1/chat/completions", chat_body("x", 10**6))
    assert too_long.status == 400 and json.loads(too_long.body)["error"]["param"] == "max_tokens"


def test_builtin_profiles_load_and_peak_extends_offpeak() -> None:
    assert {"default", "fast", "offpeak", "peak", "ratelimited"} <= set(builtin_profiles())
    for name in builtin_profiles():
        assert isinstance(load_profile(name), Profile)
    peak, offpeak = load_profile("peak"), load_profile("offpeak")
    assert peak.load > 1 and {k: v for k, v in vars(peak).items() if k != "load"} == {
        k: v for k, v in vars(offpeak).items() if k != "load"}
    assert load_profile("ratelimited").rate_limit_rpm > 0


@pytest.mark.parametrize("text,message", [
    ("slotz = 3\n", "unknown profile key 'slotz'"),
    ("slots = \"many\"\n", "slots: expected int, got str"),
    ("noise = -1.0\n", "noise: must be >= 0.0"),
    ("eos_distribution = \"zipf\"\n", "eos_distribution: must be one of"),
    ("[faults]\n\"explode\" = 0.1\n", "faults.explode: unknown fault"),
    ("[faults]\n\"stall seconds=2\" = 2\n", "expected a probability"),
    ("extends = \"nope\"\n", "unknown profile 'nope'"),
    ("slots = [\n", "invalid TOML"),
])
def test_profile_validation_names_the_field_and_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert message in str(err.value) and "\n" not in str(err.value)
    if "unknown profile 'nope'" not in message:
        assert str(path) in str(err.value)


def test_overrides_are_validated_too() -> None:
    with pytest.raises(ConfigError, match="slots: must be >= 1"):
        with serve_in_thread("fast", slots=0):
            pass


def test_cli_rejects_a_bad_profile_with_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("slotz = 1\n")
    result = subprocess.run([sys.executable, "-m", "tokenload", "sim", "--profile", str(path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "slotz" in result.stderr


def test_launch_subprocess_serves_and_stops_cleanly(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    with launch(["--profile", "fast", "--truth", str(truth), "--model", "m-1b", "--prefix", "/relay"]) as sim:
        assert sim.base_url.endswith("/relay") and sim.truth_path == truth
        response = raw_request(sim.base_url, "/v1/messages", anthropic_body("sub", 3, model="m-1b"))
        assert response.status == 200
        assert raw_request(sim.base_url, "/v1/messages", anthropic_body("sub", 3)).status == 404
        assert sim.process is not None
        sim.process.send_signal(signal.SIGINT)
        assert sim.process.wait(timeout=10) == 0
    assert read_truth(truth)[response.headers["x-request-id"]]["output_tokens"] == 3


def test_workers_share_one_port() -> None:
    with launch(["--profile", "fast", "--workers", "2"]) as sim:
        statuses = [raw_request(sim.base_url, "/v1/chat/completions", chat_body(f"w {i}", 2)).status for i in range(6)]
        assert statuses == [200] * 6
        assert sim.process is not None
        sim.process.terminate()
        assert sim.process.wait(timeout=10) == 0


def test_cli_simulator_does_not_delay_the_first_token_on_kept_alive_connections(tmp_path: Path) -> None:
    """With Nagle left on, the first token waited ~40 ms behind the headers for the client's delayed ACK."""
    import httpx

    from tokenload.channel import Channel
    from tokenload.transport.httpx_client import stream_once

    truth = tmp_path / "truth.jsonl"
    with launch(["--profile", "fast", "--truth", str(truth)]) as sim, httpx.Client() as client:
        channel = Channel(base_url=sim.base_url, model="sim-7b")
        records = [stream_once(channel, "hello there", 8, client=client) for _ in range(12)]
    server = read_truth(truth)
    excess = sorted(r["ttft_s"] - (server[r["server_request_id"]]["first_token"]
                                   - server[r["server_request_id"]]["arrival"]) for r in records)
    assert excess[len(excess) // 2] < 0.020, excess


def test_builtin_profile_name_wins_over_a_folder_of_the_same_name(tmp_path: Path, monkeypatch: Any) -> None:
    """`tokenload demo` run where its own offpeak/ and peak/ run folders lie."""
    (tmp_path / "peak").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_profile("peak").load > 1  # the shipped peak profile, not an error about the folder
