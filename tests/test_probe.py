"""`tokenload probe` end to end: a real subprocess against the scripted server, per protocol.

This is the check users run by hand after configuring a channel, so what it
prints is the contract: the answer live, then TTFT/TPOT/total and the formula
line; `--json` with the record's names; exit 1 with the error kind and its fix;
and never the key, whatever the server echoes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fakeserver import FakeServer, Received, Script, api_base, body_script, json_script, sse, stream_script

from tokenload.errors import FIXES
from tokenload.protocolspec import PROTOCOLS, SPECS

TOKENS = ["One", " [bold]two", " [/x]three", " four", " five", " six"]  # rich markup in answers must print verbatim
KEY = "sk-zz-DISTINCTIVEsecret-4f9a2c7e1b"
SPEC_FIELDS = {
    "ttfb_s", "ttft_s", "ttft_text_s", "tpot_s", "e2e_s", "input_tokens", "input_tokens_source", "output_tokens",
    "output_tokens_source", "chunks", "itl_p50_s", "itl_p99_s", "itl_max_s", "stop_reason", "http_status", "error_kind", "status",
}


def clean_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """No ANTHROPIC_*/OPENAI_* from the developer's shell, and a home without ~/.claude."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "COLUMNS"))}
    env.update(HOME=str(tmp_path / "home"), PYTHONIOENCODING="utf-8")
    env.update(extra or {})
    return env


def tokenload(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenload", *args],
        capture_output=True, text=True, encoding="utf-8", cwd=tmp_path, env=clean_env(tmp_path, env), timeout=60,
    )


def base_url(server: FakeServer, protocol: str) -> str:
    return api_base(server.url, protocol)


def probe_args(server: FakeServer, protocol: str, *more: str) -> list[str]:
    return ["probe", "--base-url", base_url(server, protocol), "--protocol", protocol, "--api-key", KEY, *more]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_probe_prints_answer_then_summary_and_formula(fake_server: FakeServer, tmp_path: Path, protocol: str) -> None:
    fake_server.play(stream_script(protocol, TOKENS, 0.2, 0.03))
    proc = tokenload(tmp_path, *probe_args(fake_server, protocol))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert "".join(TOKENS) in out
    for label in ("TTFT", "TPOT", "output tokens", "total (e2e)"):
        assert label in out
    formula_lines = [line for line in out.splitlines() if line.startswith("formula: TTFT + TPOT x N = ")]
    assert len(formula_lines) == 1
    assert f" x {len(TOKENS)} = " in formula_lines[0] and "predicted vs" in formula_lines[0] and "N-1" in formula_lines[0]
    assert out.index("".join(TOKENS)) < out.index("TTFT")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_probe_json_has_spec_fields(fake_server: FakeServer, tmp_path: Path, protocol: str) -> None:
    fake_server.play(stream_script(protocol, TOKENS, 0.2, 0.03))
    proc = tokenload(tmp_path, *probe_args(fake_server, protocol, "--json", "--max-tokens", "9"))
    assert proc.returncode == 0, proc.stderr
    record: dict[str, Any] = json.loads(proc.stdout)  # the whole stdout is one JSON object: no live text
    assert SPEC_FIELDS <= record.keys()
    assert (record["status"], record["error_kind"], record["http_status"]) == ("ok", None, 200)
    assert (record["output_tokens"], record["output_tokens_source"], record["chunks"]) == (len(TOKENS), "server", len(TOKENS))
    assert record["ttft_s"] >= 0.18 and record["ttfb_s"] < record["ttft_s"] <= record["e2e_s"]
    assert record["formula"]["predicted_exact_s"] == pytest.approx(record["e2e_s"])
    assert record["protocol"] == protocol and record["max_tokens"] == 9
    body = fake_server.last.json()
    assert body.get("max_tokens", body.get("max_output_tokens")) == 9


def test_probe_streams_text_live(fake_server: FakeServer, tmp_path: Path) -> None:
    """The first words must be on stdout while the server still holds the rest back."""
    writes = list(stream_script("openai-chat", ["LIVEWORD", " later"], 0.0, 0.0).writes)
    cut = next(i for i, (_, data) in enumerate(writes) if b"LIVEWORD" in data) + 1
    fake_server.play(Script(writes=[*writes[:cut], (2.0, b""), *writes[cut:]]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenload", *probe_args(fake_server, "openai-chat")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=clean_env(tmp_path),
    )
    try:
        seen = b""
        assert proc.stdout is not None
        while b"LIVEWORD" not in seen:
            byte = proc.stdout.read(1)
            assert byte, "probe ended without printing the first token"
            seen += byte
        assert proc.poll() is None and b"TTFT" not in seen  # printed before the answer ended
        rest, _ = proc.communicate(timeout=30)
        assert b"later" in rest and proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("script", "kind", "fix"),
    [
        (json_script(401, {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
         "auth", FIXES["auth"]),
        (json_script(404, {"type": "error", "error": {"type": "not_found_error", "message": "model: claude-nope"}}),
         "not_found_model", "ask the channel's operator for the exact model id and set it in ANTHROPIC_MODEL"),
        (Script(status=200, headers=(("content-type", "text/html"),), writes=[(0.0, b"<!doctype html><title>Home</title>")], framing="length"),
         "bad_base_url", FIXES["bad_base_url"]),
        (Script(writes=[(0.0, sse({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, "error"))]),
         "overloaded", FIXES["overloaded"]),
    ],
    ids=["auth", "model", "html", "stream-error"],
)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_probe_error_exits_1_with_kind_and_fix(fake_server: FakeServer, tmp_path: Path, script: Script, kind: str, fix: str,
                                               as_json: bool) -> None:
    fake_server.play(script)
    proc = tokenload(tmp_path, *probe_args(fake_server, "anthropic", *(["--json"] if as_json else [])))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    if as_json:
        record = json.loads(proc.stdout)
        assert (record["status"], record["error_kind"]) == ("error", kind)
    else:
        assert f"FAIL {kind}" in proc.stderr
        assert f"fix: {fix}" in proc.stderr


def test_probe_reads_claude_code_settings_from_cwd(fake_server: FakeServer, tmp_path: Path) -> None:
    """The zero-flag path: ./.claude/settings.json in Claude Code's form, Bearer token from it."""
    fake_server.play(stream_script("anthropic", TOKENS))
    settings = tmp_path / ".claude/settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"env": {"ANTHROPIC_BASE_URL": fake_server.url + "/api", "ANTHROPIC_AUTH_TOKEN": KEY, "ANTHROPIC_MODEL": "claude-x"}}))
    proc = tokenload(tmp_path, "probe", "--json")
    assert proc.returncode == 0, proc.stderr
    assert fake_server.last.headers["authorization"] == f"Bearer {KEY}"
    assert fake_server.last.json()["model"] == "claude-x"


# ------------------------------------------------------------------ secrets

_ECHO_401 = json_script(401, {"error": {"message": f"Incorrect API key provided: {KEY}. Header was 'Bearer {KEY}'", "type": "invalid_request_error"}})
_ECHO_STREAM = Script(writes=[(0.0, sse({"type": "error", "error": {"type": "api_error", "message": f"key {KEY} is suspended"}}, "error"))])


@pytest.mark.parametrize(
    ("protocol", "script", "how", "rc"),
    [
        ("anthropic", stream_script("anthropic", TOKENS), "flag", 0),
        ("anthropic", _ECHO_401, "env", 1),
        ("anthropic", _ECHO_STREAM, "env-auth-token", 1),
        ("openai-chat", _ECHO_401, "env", 1),
        ("openai-responses", _ECHO_401, "settings", 1),
        ("anthropic", _ECHO_401, "env-with-newline", 1),
    ],
)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_key_never_printed(fake_server: FakeServer, tmp_path: Path, protocol: str, script: Script, how: str, rc: int, as_json: bool) -> None:
    fake_server.play(script)
    args = ["probe", "--base-url", base_url(fake_server, protocol), "--protocol", protocol] + (["--json"] if as_json else [])
    env: dict[str, str] = {}
    prefix = SPECS[protocol].family.upper()
    if how == "flag":
        args += ["--api-key", KEY]
    elif how == "env":
        env[f"{prefix}_API_KEY"] = KEY
    elif how == "env-auth-token":
        env["ANTHROPIC_AUTH_TOKEN"] = KEY
    elif how == "env-with-newline":
        env[f"{prefix}_API_KEY"] = KEY + "\n"
    else:
        settings = tmp_path / "s.json"
        settings.write_text(json.dumps({"openai": {"api_key": KEY}}))
        args += ["--settings", str(settings)]
    proc = tokenload(tmp_path, *args, env=env)
    assert proc.returncode == rc, proc.stderr
    assert fake_server.last.headers.get("x-api-key", fake_server.last.headers.get("authorization", "")).endswith(KEY)  # it was sent
    output = proc.stdout + proc.stderr
    assert KEY not in output and KEY[:-4] not in output and KEY[4:] not in output
    if how == "env-with-newline":
        assert "newline" in proc.stderr  # the warning names the problem without the key


def test_probe_says_which_settings_file_supplied_the_channel(fake_server: FakeServer, tmp_path: Path) -> None:
    """Claude Code's project settings are found without --settings, and named."""
    fake_server.play(stream_script("anthropic", TOKENS, 0.01, 0.01))
    settings = tmp_path / ".claude" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"env": {"ANTHROPIC_BASE_URL": base_url(fake_server, "anthropic"),
                                            "ANTHROPIC_AUTH_TOKEN": KEY, "ANTHROPIC_MODEL": "m-1"}}))
    proc = tokenload(tmp_path, "probe")
    assert proc.returncode == 0, proc.stderr
    assert f"base URL from settings {settings} (ANTHROPIC_BASE_URL)" in proc.stderr
    assert f"auth token from settings {settings} (ANTHROPIC_AUTH_TOKEN)" in proc.stderr
    assert fake_server.last.json()["model"] == "m-1"
    assert KEY not in proc.stdout + proc.stderr


# --------------------------------------------------------- words a newcomer meets


def test_no_key_says_so_and_where_to_set_one(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.play(json_script(401, {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}))
    proc = tokenload(tmp_path, "probe", "--base-url", fake_server.url + "/api")
    assert proc.returncode == 1
    assert "no key was given" in proc.stderr
    assert "fix: this channel needs a key: set ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN" in proc.stderr


def test_refused_connection_is_named_without_http_none_or_a_home_page_fix(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = tokenload(tmp_path, "probe", "--base-url", f"http://127.0.0.1:{port}/api", "--api-key", KEY)
    assert proc.returncode == 1
    assert f"FAIL bad_base_url: 127.0.0.1:{port} refused the connection" in proc.stderr
    assert "HTTP None" not in proc.stderr and "home page" not in proc.stderr
    assert "fix: check the host and port in --base-url and that the channel is up" in proc.stderr


def test_timeout_is_named_without_http_none(tmp_path: Path) -> None:
    with socket.socket() as listener:  # accepts (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
        proc = tokenload(tmp_path, "probe", "--base-url", url, "--api-key", KEY, "--timeout", "0.5")
    assert proc.returncode == 1
    assert "FAIL timeout_first_token: " in proc.stderr and "sent no response within 0.5 s" in proc.stderr
    assert "HTTP None" not in proc.stderr and "home page" not in proc.stderr


def test_base_url_ending_in_api_v1_gets_the_exact_url(fake_server: FakeServer, tmp_path: Path) -> None:
    def router(received: Received) -> Script:
        if received.method == "POST" and received.path == "/api/v1/messages":
            return json_script(400, {"type": "error", "error": {"type": "invalid_request_error", "message": "messages: required"}})
        return body_script(404, b"<html><title>404 Not Found</title></html>")

    fake_server.route(router)
    proc = tokenload(tmp_path, "probe", "--base-url", fake_server.url + "/api/v1", "--api-key", KEY)
    assert proc.returncode == 1
    assert f"fix: set --base-url to {fake_server.url}/api" + "\n" in proc.stderr


def test_unknown_model_gets_no_arbitrary_closest_match(fake_server: FakeServer, tmp_path: Path) -> None:
    def router(received: Received) -> Script:
        if received.method == "GET" and received.path == "/api/v1/models":
            return json_script(200, {"object": "list", "data": [{"id": "sim-7b"}, {"id": "sim-30b"}]})
        return json_script(404, {"type": "error", "error": {"type": "not_found_error", "message": "model: claude-sonnet-4"}})

    fake_server.route(router)
    proc = tokenload(tmp_path, "probe", "--base-url", fake_server.url + "/api", "--api-key", KEY, "--model", "claude-sonnet-4")
    assert proc.returncode == 1
    assert "closest" not in proc.stderr
    assert "fix: set --model to one of the models this channel serves: sim-7b, sim-30b" in proc.stderr
