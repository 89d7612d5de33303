"""`tokenload doctor`: every check fails exactly when it should, with the right fix, over real loopback HTTP.

Channels are the simulator (tokenload.sim, healthy or configured to exhibit a
mistake) and the scripted server (tests/fakeserver.py) for what the simulator
does not do on purpose: a dashboard answering 200 HTML, redirects, a buffering
proxy, a stream without its final event, a server echoing the key. Checks run
in-process through `diagnose_channel`; exit codes, `--json` and secrecy run the real
console entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakeserver import Received, Script, body_script, json_script, sse, stream_script

from tokenload.channel import fingerprint, resolve
from tokenload.doctor import (
    CHECKS,
    FAIL,
    OK,
    SKIP,
    CheckResult,
    Doctor,
    Limits,
    base_variants,
    check_config,
    check_key,
    diagnose_channel,
    is_local,
)
from tokenload.protocolspec import PROTOCOLS
from tokenload.sim import serve_in_thread

KEY = "sk-doctor-7QxWv2LmZr9Tq4Hn"  # distinctive: must never appear in any output
FAST = Limits(prompt_tokens=100, probe_tokens=8, timeout_s=5.0)
NAMES = [c.name for c in CHECKS]


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    """A healthy simulated channel (fast profile) that requires KEY; its base URL ends in /api."""
    with serve_in_thread("fast", api_key=KEY) as handle:
        yield handle.base_url


def run_doctor(tmp_path: Path, env: dict[str, str] | None = None, limits: Limits = FAST, **flags: str | None) -> dict[str, CheckResult]:
    """Diagnose with an isolated environment, cwd and home; results by check name."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    full = {k: flags.get(k) for k in ("protocol", "base_url", "api_key", "auth_token", "model", "settings")}
    results, _ = diagnose_channel(flags=full, env=env or {}, cwd=tmp_path, home=home, limits=limits)
    assert [r.name for r in results] == NAMES
    return {r.name: r for r in results}


def statuses(results: dict[str, CheckResult]) -> dict[str, str]:
    return {name: r.status for name, r in results.items()}


def offline(tmp_path: Path, env: dict[str, str], **flags: str) -> Doctor:
    """A Doctor for the offline checks (configuration, key hygiene)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return Doctor(resolve(env=env, cwd=tmp_path, home=home, **flags), env, tmp_path, home, FAST)


def write_settings(path: Path, data: dict[str, Any] | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=2))
    return path


# ------------------------------------------------------------------ healthy


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_healthy_channel_passes_every_check(sim: str, tmp_path: Path, protocol: str) -> None:
    results = run_doctor(tmp_path, base_url=sim, auth_token=KEY, model="sim-7b", protocol=protocol)
    assert statuses(results) == dict.fromkeys(NAMES, OK), {n: r.saw for n, r in results.items()}
    assert all(r.fix is None for r in results.values())
    assert "base URL from flag --base-url" in results["config"].saw
    assert results["latency"].details["ttft_s"] < 1.0
    assert results["streaming"].details["chunks"] == FAST.probe_tokens


# ------------------------------------------------------------ configuration


def test_config_names_each_source(tmp_path: Path) -> None:
    settings = write_settings(tmp_path / ".claude/settings.json", {"env": {"ANTHROPIC_AUTH_TOKEN": KEY}})
    env = {"ANTHROPIC_BASE_URL": "http://127.0.0.1:9/api"}
    result = check_config(offline(tmp_path, env, model="sim-7b"))
    assert result.status == OK
    assert result.details["sources"] == {
        "base_url": "environment ANTHROPIC_BASE_URL",
        "auth_token": f"settings {settings} (ANTHROPIC_AUTH_TOKEN)",
        "model": "flag --model",
        "protocol": "default",
    }


def test_invalid_json_gives_line_and_column_and_skips_the_rest(tmp_path: Path) -> None:
    bad = write_settings(tmp_path / "s.json", '{\n  "env": {\n    "ANTHROPIC_BASE_URL": "http://x/api",,\n  }\n}\n')
    results, channel = diagnose_channel(flags={"settings": str(bad)}, env={}, cwd=tmp_path, home=tmp_path)
    assert channel is None
    assert results[0].status == FAIL and "line 3 column 42" in results[0].saw
    assert [r.status for r in results[1:]] == [SKIP] * (len(NAMES) - 1)


@pytest.mark.parametrize(
    ("name", "real"),
    [
        ("ANTHROPIC_BASEURL", "ANTHROPIC_BASE_URL"),
        ("ANTROPIC_AUTH_TOKEN", "ANTHROPIC_AUTH_TOKEN"),
        ("ANTHROPIC_AUTH_KEY", "ANTHROPIC_AUTH_TOKEN"),
        ("anthropic_base_url", "ANTHROPIC_BASE_URL"),
        ("OPENAI_API_BASE", "OPENAI_BASE_URL"),
    ],
)
def test_misspelt_environment_variable(tmp_path: Path, name: str, real: str) -> None:
    env = {name: "http://127.0.0.1:9/api", "ANTHROPIC_MODEL": "sim-7b"}
    result = check_config(offline(tmp_path, env))
    assert result.status == FAIL
    assert f"environment {name} is not read by tokenload (did you mean {real}?)" in result.saw
    assert f"rename it to {real}" in (result.fix or "")


def test_misspelt_variable_in_settings_env_block_blocks_the_network_checks(tmp_path: Path) -> None:
    settings = write_settings(tmp_path / ".claude/settings.json",
                              {"env": {"ANTHROPIC_BASEURL": "http://127.0.0.1:9/api", "ANTHROPIC_AUTH_TOKEN": KEY}})
    results = run_doctor(tmp_path)
    assert results["config"].status == FAIL
    assert f"{settings} env.ANTHROPIC_BASEURL is not read by tokenload (did you mean ANTHROPIC_BASE_URL?)" in results["config"].saw
    assert results["base_url"].status == SKIP and "configuration" in results["base_url"].saw


def test_misspelt_key_in_the_section_form(tmp_path: Path) -> None:
    settings = write_settings(tmp_path / ".claude/settings.json",
                              {"anthropic": {"base_url": "http://127.0.0.1:9/api", "auth-tokn": KEY}})
    result = check_config(offline(tmp_path, {}))
    assert result.status == FAIL
    assert f"{settings} anthropic.auth-tokn is not read by tokenload (did you mean anthropic.auth_token?)" in result.saw


def test_model_with_a_newline_fails_configuration(tmp_path: Path) -> None:
    result = check_config(offline(tmp_path, {"ANTHROPIC_BASE_URL": "http://127.0.0.1:9/api", "ANTHROPIC_MODEL": "sim-7b\n"}))
    assert result.status == FAIL and "model from environment ANTHROPIC_MODEL has a newline" in result.saw


def test_variables_of_neighbouring_tools_are_not_misspellings(tmp_path: Path) -> None:
    env = {"ANTHROPIC_BASE_URL": "http://127.0.0.1:9/api", "ANTHROPIC_SMALL_FAST_MODEL": "m", "ANTHROPIC_VERTEX_BASE_URL": "x",
           "OPENAI_ORG_ID": "o", "PATH": "/bin", "HOME": "/h", "ANTHROPIC_BETAS": "b", "MY_ANTHROPIC_API_KEY": "k",
           "OPENAI_API_KEY_OLD": "k"}
    result = check_config(offline(tmp_path, env))
    assert result.status == OK, result.saw
    assert result.details["misspelt"] == {}


def test_settings_shadowed_by_environment_fails_but_does_not_block(tmp_path: Path) -> None:
    settings = write_settings(tmp_path / ".claude/settings.json", {"env": {"ANTHROPIC_BASE_URL": "http://127.0.0.1:8/api"}})
    env = {"ANTHROPIC_BASE_URL": "http://127.0.0.1:9/api"}
    result = check_config(offline(tmp_path, env))
    assert result.status == FAIL and not result.blocks
    assert f"env.ANTHROPIC_BASE_URL in {settings} is shadowed by a different value of ANTHROPIC_BASE_URL in the environment" in result.saw
    assert "unset ANTHROPIC_BASE_URL" in (result.fix or "")
    same = check_config(offline(tmp_path, {"ANTHROPIC_BASE_URL": "http://127.0.0.1:8/api"}))
    assert same.status == OK


def test_nothing_configured_fails_and_points_at_a_near_miss_settings_file(tmp_path: Path) -> None:
    write_settings(tmp_path / ".claude/setting.json", {"env": {}})
    results = run_doctor(tmp_path)
    config = results["config"]
    assert config.status == FAIL and "nothing is configured" in config.saw
    assert "export ANTHROPIC_BASE_URL" in (config.fix or "") and "setting.json" in (config.fix or "")
    assert statuses(results)["base_url"] == SKIP


# -------------------------------------------------------------- key hygiene


@pytest.mark.parametrize(("raw", "what"), [(KEY + "\n", "a newline"), (f"  {KEY} ", "whitespace")])
def test_key_with_whitespace(tmp_path: Path, raw: str, what: str) -> None:
    result = check_key(offline(tmp_path, {"ANTHROPIC_AUTH_TOKEN": raw, "ANTHROPIC_BASE_URL": "http://127.0.0.1:9/api"}))
    assert result.status == FAIL
    assert f"the auth token from environment ANTHROPIC_AUTH_TOKEN contains {what}" in result.saw
    assert f"remove the {what.removeprefix('a ')} from ANTHROPIC_AUTH_TOKEN" in (result.fix or "")


@pytest.mark.parametrize("placeholder", ["YOUR_API_KEY", "sk-xxx", "<key>", "changeme", "${ANTHROPIC_API_KEY}", "sk-ant-..."])
def test_placeholder_key(tmp_path: Path, placeholder: str) -> None:
    result = check_key(offline(tmp_path, {"ANTHROPIC_API_KEY": placeholder, "ANTHROPIC_BASE_URL": "https://relay.example/api"}))
    assert result.status == FAIL and "is a placeholder, not a key" in result.saw
    assert "put the key you created into ANTHROPIC_API_KEY" in (result.fix or "")


def test_two_different_keys_fail_and_equal_ones_pass(tmp_path: Path) -> None:
    base = {"ANTHROPIC_BASE_URL": "https://relay.example/api", "ANTHROPIC_AUTH_TOKEN": KEY}
    result = check_key(offline(tmp_path, {**base, "ANTHROPIC_API_KEY": KEY + "2"}))
    assert result.status == FAIL and "both set, to different values" in result.saw
    assert "keep one" in (result.fix or "")
    assert check_key(offline(tmp_path, {**base, "ANTHROPIC_API_KEY": KEY})).status == OK


def test_no_key_fails_for_a_remote_channel_only(tmp_path: Path) -> None:
    remote = check_key(offline(tmp_path, {"ANTHROPIC_BASE_URL": "https://relay.example/api"}))
    assert remote.status == FAIL and "no key is configured for relay.example" in remote.saw
    assert "ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN" in (remote.fix or "")
    assert check_key(offline(tmp_path, {"ANTHROPIC_BASE_URL": "http://127.0.0.1:9/api"})).status == OK


# ----------------------------------------------------------------- base URL


@pytest.mark.parametrize(
    ("protocol", "suffix", "suggested"),
    [("anthropic", "", "/api"), ("anthropic", "/api/v1", "/api"), ("openai-chat", "", "/api/v1")],
)
def test_wrong_base_path_suggests_the_variant_that_answers(sim: str, tmp_path: Path, protocol: str, suffix: str, suggested: str) -> None:
    root = sim.removesuffix("/api")
    results = run_doctor(tmp_path, base_url=root + suffix, auth_token=KEY, model="sim-7b", protocol=protocol)
    base = results["base_url"]
    assert base.status == FAIL and "with an HTML page" in base.saw
    assert base.fix == f"set --base-url to {root}{suggested}"
    assert [results[n].status for n in NAMES[3:]] == [SKIP] * (len(NAMES) - 3)


def _dashboard(received: Received) -> Script:
    """A site whose API lives under /api and whose every other page is a 200 dashboard."""
    if received.method == "POST" and received.path == "/api/v1/messages":
        return json_script(400, {"type": "error", "error": {"type": "invalid_request_error", "message": "messages: required"}})
    return body_script(200, b"<!doctype html><html><head><title>Relay Dashboard</title></head><body>hi</body></html>")


def test_dashboard_html_page_instead_of_api(fake_server: Any, tmp_path: Path) -> None:
    fake_server.route(_dashboard)
    results = run_doctor(tmp_path, env={"ANTHROPIC_BASE_URL": fake_server.url + "/dashboard"}, auth_token=KEY)
    base = results["base_url"]
    assert base.status == FAIL
    assert "answered HTTP 200 with an HTML page ('Relay Dashboard')" in base.saw
    assert base.fix == f"set ANTHROPIC_BASE_URL to {fake_server.url}/api"


def test_json_404_route_is_a_wrong_path(fake_server: Any, tmp_path: Path) -> None:
    def router(received: Received) -> Script:
        if received.path == "/api/v1/messages":
            return json_script(400, {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}})
        return json_script(404, {"detail": "Not Found"})

    fake_server.route(router)
    base = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY)["base_url"]
    assert base.status == FAIL and "answered HTTP 404 with '{\"detail\": \"Not Found\"}'" in base.saw
    assert base.fix == f"set --base-url to {fake_server.url}/api"


def test_no_variant_answers(fake_server: Any, tmp_path: Path) -> None:
    fake_server.play(body_script(404, b"<html><title>Not here</title></html>"))
    base = run_doctor(tmp_path, base_url=fake_server.url + "/x", auth_token=KEY)["base_url"]
    assert base.status == FAIL and "no common variant" in base.saw
    assert "copy the API base URL" in (base.fix or "")


def test_gateway_error_page_is_not_a_wrong_path(fake_server: Any, tmp_path: Path) -> None:
    fake_server.play(body_script(502, b"<html><head><title>502 Bad Gateway</title></head></html>"))
    base = run_doctor(tmp_path, base_url=fake_server.url + "/api", auth_token=KEY)["base_url"]
    assert base.status == FAIL and "HTTP 502 with a proxy's error page" in base.saw and "502 Bad Gateway" in base.saw
    assert "retry later" in (base.fix or "")
    assert len(fake_server.requests) == 1  # no variants tried: the path is not the problem


def test_redirect_is_reported_with_its_location(fake_server: Any, tmp_path: Path) -> None:
    target = "https://relay.example/api/v1/messages"
    fake_server.play(Script(status=308, headers=(("location", target), ("content-length", "0"))))
    base = run_doctor(tmp_path, base_url=fake_server.url + "/api", auth_token=KEY)["base_url"]
    assert base.status == FAIL and f"redirected (HTTP 308) to {target}" in base.saw
    assert base.fix == "set --base-url to https://relay.example/api"


def test_connection_refused(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = run_doctor(tmp_path, base_url=f"http://127.0.0.1:{port}/api", auth_token=KEY)["base_url"]
    assert base.status == FAIL and "refused the connection" in base.saw


def test_https_to_a_plain_http_server(fake_server: Any, tmp_path: Path) -> None:
    url = fake_server.url.replace("http://", "https://") + "/api"
    base = run_doctor(tmp_path, base_url=url, auth_token=KEY, limits=Limits(timeout_s=1.0))["base_url"]
    assert base.status == FAIL and "TLS handshake" in base.saw and "plain http" in base.saw
    assert base.fix == f"use {fake_server.url}/api in --base-url"


def test_dns_failure(tmp_path: Path) -> None:
    base = run_doctor(tmp_path, base_url="http://doctor-test.invalid/api", auth_token=KEY)["base_url"]
    assert base.status == FAIL and "DNS lookup of doctor-test.invalid failed" in base.saw


def test_silent_server_times_out(tmp_path: Path) -> None:
    with socket.socket() as listener:  # accepts (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
        base = run_doctor(tmp_path, base_url=url, auth_token=KEY, limits=Limits(timeout_s=0.5))["base_url"]
    assert base.status == FAIL and "sent no response within 0.5 s" in base.saw


def test_base_variants_and_locality() -> None:
    assert base_variants("https://r.example/api/v1") == ["https://r.example/api", "https://r.example"]
    assert base_variants("https://r.example") == ["https://r.example/api"]
    assert base_variants("https://r.example/console/x")[:2] == ["https://r.example/console/x/api", "https://r.example/console"]
    assert is_local("http://127.0.0.1:1/api") and is_local("http://localhost/") and is_local("http://10.0.0.2/")
    assert not is_local("http://relay.example/api") and not is_local("http://8.8.8.8/")


# --------------------------------------------------------------------- auth


def test_wrong_key_fails_auth_with_the_servers_message(sim: str, tmp_path: Path) -> None:
    results = run_doctor(tmp_path, base_url=sim, auth_token="sk-wrong-0123456789abcdef", model="sim-7b")
    auth = results["auth"]
    assert auth.status == FAIL and auth.saw.startswith("HTTP 401: ")
    assert "no stray space or newline" in (auth.fix or "") and "ANTHROPIC_API_KEY (x-api-key)" in (auth.fix or "")
    assert [results[n].status for n in ("model", "latency", "streaming")] == [SKIP] * 3


def test_missing_key_on_a_channel_that_needs_one(sim: str, tmp_path: Path) -> None:
    results = run_doctor(tmp_path, base_url=sim, model="sim-7b")
    assert results["key"].status == OK  # loopback: no key is plausible...
    assert results["auth"].status == FAIL  # ...but this one needs it
    assert "this channel needs a key: set ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN" in (results["auth"].fix or "")


def test_forbidden_key(fake_server: Any, tmp_path: Path) -> None:
    fake_server.play(json_script(403, {"type": "error", "error": {"type": "permission_error", "message": "key not allowed for this group"}}))
    auth = run_doctor(tmp_path, base_url=fake_server.url + "/api", api_key=KEY)["auth"]
    assert auth.status == FAIL and "HTTP 403: key not allowed for this group" in auth.saw
    assert "valid but not allowed" in (auth.fix or "")


# -------------------------------------------------------------------- model


def test_unknown_model_lists_models_and_the_closest(sim: str, tmp_path: Path) -> None:
    model = run_doctor(tmp_path, base_url=sim, auth_token=KEY, model="sim-30B-instruct")["model"]
    assert model.status == FAIL and "sim-30B-instruct is not served" in model.saw
    assert model.details["models"] == ["sim-7b", "sim-30b"]
    assert model.fix == "set --model to sim-30b (the closest match)"


def test_unknown_model_without_a_model_list(fake_server: Any, tmp_path: Path) -> None:
    def router(received: Received) -> Script:
        if received.path.endswith("/models"):
            return body_script(404, b"<html><title>404</title></html>")
        return json_script(404, {"error": {"message": "The model `gpt-9` does not exist", "type": "invalid_request_error"}})

    fake_server.route(router)
    model = run_doctor(tmp_path, base_url=fake_server.url + "/v1", api_key=KEY, model="gpt-9", protocol="openai-chat")["model"]
    assert model.status == FAIL and "offers no model list" in model.saw
    assert "ask the channel's operator for the exact model id" in (model.fix or "")


# ------------------------------------------------------------------ latency


def test_slow_prefill_for_any_prompt_points_at_model_or_load(tmp_path: Path) -> None:
    with serve_in_thread("fast", api_key=KEY, prefill_base_s=0.5) as handle:
        latency = run_doctor(tmp_path, base_url=handle.base_url, auth_token=KEY, model="sim-7b",
                             limits=Limits(ttft_s=0.3, prompt_tokens=100, probe_tokens=4))["latency"]
    assert latency.status == FAIL and "TTFT above 0.3 s" in latency.saw
    assert latency.details["ttft_short_prompt_s"] > 0.3
    assert "model size or channel load" in (latency.fix or "") and "off-peak" in (latency.fix or "")


def test_slow_prefill_for_a_long_prompt_points_at_the_prompt(tmp_path: Path) -> None:
    with serve_in_thread("fast", api_key=KEY, prefill_per_token_s=0.001, prefill_exponent=1.0) as handle:
        latency = run_doctor(tmp_path, base_url=handle.base_url, auth_token=KEY, model="sim-7b",
                             limits=Limits(ttft_s=0.3, prompt_tokens=500, probe_tokens=4))["latency"]
    assert latency.status == FAIL and "TTFT above 0.3 s" in latency.saw
    assert latency.details["ttft_short_prompt_s"] < 0.1
    assert "the prompt length drives TTFT" in (latency.fix or "")


def test_high_tpot_suggests_a_smaller_model(tmp_path: Path) -> None:
    with serve_in_thread("fast", api_key=KEY, decode_base_s=0.06) as handle:  # sim-30b: about 2.5x, 0.15 s/token
        latency = run_doctor(tmp_path, base_url=handle.base_url, auth_token=KEY, model="sim-30b",
                             limits=Limits(tpot_s=0.1, prompt_tokens=50, probe_tokens=4))["latency"]
    assert latency.status == FAIL and "TPOT above 0.1 s/token" in latency.saw
    assert "a smaller model (this channel serves sim-7b) may meet the need" in (latency.fix or "")


def test_long_output_suggests_capping_max_tokens(tmp_path: Path) -> None:
    """20 ms a token: a 1,000-token answer takes 20 s. (At the fast profile's 1 ms, a client on a busy machine read
    the probe's 8 tokens together, TPOT near 0, and the long answer fitted in the bound.)"""
    limits = Limits(e2e_s=1.0, expected_output_tokens=1000, prompt_tokens=50, probe_tokens=8)
    with serve_in_thread("fast", api_key=KEY, decode_base_s=0.02) as handle:
        latency = run_doctor(tmp_path, base_url=handle.base_url, auth_token=KEY, model="sim-7b",
                             limits=limits)["latency"]
    assert latency.status == FAIL and "the output is long" in latency.saw
    ttft, tpot = latency.details["ttft_s"], latency.details["tpot_s"]
    assert f"cap max tokens at about {max(1, int((1.0 - ttft) / tpot))} " in (latency.fix or "")


# ---------------------------------------------------------------- streaming


def _one_burst(received: Received) -> Script:
    """A buffering proxy: the whole stream in one write, after the generation time."""
    tokens = [f"w{i} " for i in range(12)]
    events = stream_script("anthropic", tokens).body()
    return Script(writes=[(0.3, events)])


def test_buffering_proxy_is_detected(fake_server: Any, tmp_path: Path) -> None:
    fake_server.route(_one_burst)
    results = run_doctor(tmp_path, base_url=fake_server.url + "/api", auth_token=KEY)
    streaming = results["streaming"]
    assert streaming.status == FAIL and "all 12 token chunks arrived within" in streaming.saw
    assert "proxy_buffering off" in (streaming.fix or "")


@pytest.mark.parametrize("first_delay", [0.0, 0.2])
def test_incremental_stream_is_not_a_burst(fake_server: Any, tmp_path: Path, first_delay: float) -> None:
    fake_server.route(lambda r: stream_script("anthropic", [f"w{i} " for i in range(12)], first_delay, 0.02))
    streaming = run_doctor(tmp_path, base_url=fake_server.url + "/api", auth_token=KEY)["streaming"]
    assert streaming.status == OK and "ended cleanly" in streaming.saw


def test_instant_local_stream_is_not_a_burst(fake_server: Any, tmp_path: Path) -> None:
    fake_server.route(lambda r: stream_script("anthropic", [f"w{i} " for i in range(12)]))
    assert run_doctor(tmp_path, base_url=fake_server.url + "/api", auth_token=KEY)["streaming"].status == OK


def test_stream_without_its_final_event(fake_server: Any, tmp_path: Path) -> None:
    def router(received: Received) -> Script:
        writes = stream_script("anthropic", [f"w{i} " for i in range(6)], 0.0, 0.01).writes
        return Script(writes=writes[:-1])  # no message_stop

    fake_server.route(router)
    streaming = run_doctor(tmp_path, base_url=fake_server.url + "/api", auth_token=KEY)["streaming"]
    assert streaming.status == FAIL and "stream ended before its final event" in streaming.saw
    assert "dropped it" in (streaming.fix or "")


def test_json_body_instead_of_a_stream(fake_server: Any, tmp_path: Path) -> None:
    fake_server.play(json_script(200, {"type": "message", "content": [{"type": "text", "text": "hi"}]}))
    results = run_doctor(tmp_path, base_url=fake_server.url + "/api", auth_token=KEY)
    assert results["latency"].status == SKIP
    assert results["streaming"].status == FAIL and "not an event stream" in results["streaming"].saw


# ----------------------------------------------------------------------- CLI


def cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m tokenload doctor ARGS` with only the given environment, in an empty cwd and home."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    full_env = {"PATH": os.environ["PATH"], "HOME": str(home), "COLUMNS": "80", **(env or {})}
    return subprocess.run([sys.executable, "-m", "tokenload", "doctor", *args], capture_output=True, text=True,
                          env=full_env, cwd=tmp_path, timeout=60)


def test_cli_healthy_json_exit_0(sim: str, tmp_path: Path) -> None:
    proc = cli(tmp_path, "--json", "--model", "sim-7b", env={"ANTHROPIC_BASE_URL": sim, "ANTHROPIC_AUTH_TOKEN": KEY})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = json.loads(proc.stdout)
    assert [c["name"] for c in checks] == NAMES
    assert all(set(c) == {"name", "title", "status", "saw", "fix", "details", "informational"} and c["status"] == "ok"
               for c in checks)
    assert [c["name"] for c in checks if c["informational"]] == ["fidelity", "rate_limits", "caching"]


def test_cli_failure_one_line_per_check_exit_1(sim: str, tmp_path: Path) -> None:
    proc = cli(tmp_path, "--base-url", sim, "--model", "sim-7b", env={"ANTHROPIC_AUTH_TOKEN": "sk-wrong-0123456789abcdef"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()[1:]
    assert [line.split()[:2] for line in lines] == [
        ["1", "ok"], ["2", "ok"], ["3", "ok"], ["4", "FAIL"], ["5", "skip"], ["6", "skip"], ["7", "skip"],
        ["8", "skip"], ["9", "skip"], ["10", "skip"]]
    assert "fix: check the key" in lines[3]


def test_cli_unreadable_configuration_exit_2(tmp_path: Path) -> None:
    bad = write_settings(tmp_path / "settings.json", '{"env": {"ANTHROPIC_BASE_URL": "http://x"}')
    proc = cli(tmp_path, "--settings", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "not valid JSON" in proc.stderr and "line 1 column" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "1 FAIL configuration" in proc.stdout


def _echo(received: Received) -> Script:
    """A server that echoes whatever credentials it got, in a 401 body and in its HTML 404 pages."""
    presented = received.headers.get("authorization", "") + " " + received.headers.get("x-api-key", "")
    if received.path != "/api/v1/messages":
        return body_script(404, f"<html><title>no route for {presented}</title></html>".encode())
    return json_script(401, {"type": "error", "error": {"type": "authentication_error", "message": f"invalid key {presented}"}})


LEAKS = [
    ("sim", ["--base-url", "{sim}", "--model", "sim-7b"], {"ANTHROPIC_AUTH_TOKEN": f"  {KEY}\n"}),
    ("sim", ["--base-url", "{sim}", "--model", "sim-7b", "--json"], {"ANTHROPIC_API_KEY": KEY + "\r\n"}),
    ("echo", ["--base-url", "{echo}/api"], {"ANTHROPIC_AUTH_TOKEN": KEY, "ANTHROPIC_API_KEY": KEY + "x"}),
    ("echo", ["--base-url", "{echo}", "--json"], {"ANTHROPIC_AUTH_TOKEN": f"{KEY}\n"}),
    ("sim", ["--base-url", "{sim}"], {"ANTHROPIC_AUTH_KEY": KEY}),
]


@pytest.mark.parametrize(("server", "args", "env"), LEAKS)
def test_no_key_in_any_output(sim: str, fake_server: Any, tmp_path: Path, server: str, args: list[str], env: dict[str, str]) -> None:
    fake_server.route(_echo)
    proc = cli(tmp_path, *[a.format(sim=sim, echo=fake_server.url) for a in args], env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), output
    if "--json" in args:  # read the JSON as text, with its \u escapes undone
        output = json.dumps(json.loads(proc.stdout), ensure_ascii=False) + proc.stderr
    assert KEY not in output and KEY[3:15] not in output
    if "ANTHROPIC_AUTH_KEY" not in env:  # a misspelt variable's value is never shown at all
        assert fingerprint(next(iter(env.values()))).split(" ")[0] in output
    if server == "echo":
        assert fake_server.requests, "the echo server was asked"


# ------------------------------------------------- relays: what a request proved (issue: the relay in the middle)

RELAY = Limits(prompt_tokens=100, probe_tokens=8, timeout_s=1.0, relay_probe_timeout_s=0.5)


def relay(request: Script, *, models: Script | None = None, caching: Script | None = None) -> Any:
    """A relay's routes: the base URL knock (an empty JSON body) answers 400 JSON at once, as LiteLLM does;
    `GET /v1/models` answers `models` (default: silent, as a dead host); model requests get `request`,
    and prompt-caching requests (a system prompt) `caching` when given."""
    def router(received: Received) -> Script:
        if received.method == "GET":
            return models or Script(headers_delay_s=30.0)
        if received.body == b"{}":
            return json_script(400, {"error": {"message": "messages: field required", "type": "invalid_request_error"}})
        if caching is not None and "system" in received.json():
            return caching
        return request
    return router


NO_DB = json_script(400, {"error": {"message": "No connected db.", "type": "no_db_connection", "param": None, "code": "400"}})
PLAIN_500 = body_script(500, b"Internal Server Error", "text/plain")
UPSTREAM_500 = json_script(500, {"error": {"message": "litellm.APIConnectionError: OpenAIException - Connection error.",
                                           "type": None, "param": None, "code": "500"}})
HUNG = Script(headers_delay_s=30.0)


@pytest.mark.parametrize(("script", "key", "said"), [
    (NO_DB, KEY, "HTTP 400: No connected db."),
    (PLAIN_500, None, "HTTP 500: Internal Server Error"),
    (HUNG, KEY, "sent no response within 1 s"),
], ids=["wrong-key-no-db", "no-key-500-text", "timeout"])
def test_auth_and_model_are_never_ok_unless_a_request_succeeded(fake_server: Any, tmp_path: Path, script: Script,
                                                                 key: str | None, said: str) -> None:
    fake_server.route(relay(script))
    results = run_doctor(tmp_path, base_url=fake_server.url, auth_token=key, limits=RELAY)
    for name in ("auth", "model"):
        assert results[name].status == "unverified", (name, results[name].saw)
        assert results[name].saw.startswith("could not verify: ") and said in results[name].saw
    assert results["base_url"].status == OK  # the relay itself answered
    assert [results[n].status for n in ("latency", "streaming", "fidelity", "caching")] == [SKIP] * 4
    assert results["rate_limits"].status == "unverified"  # no answer announced any limit: nothing to call ok
    assert "retry later" not in (results["auth"].fix or "")
    if key is None:
        assert "(no key was sent)" in results["auth"].saw and "ANTHROPIC_AUTH_TOKEN" in (results["auth"].fix or "")


@pytest.mark.parametrize("script", [
    UPSTREAM_500,
    json_script(502, {"error": {"message": "Bad Gateway"}}),
    Script(writes=[(0.0, sse({"type": "error", "error": {"type": "api_error", "message":
                                                       "litellm.APIConnectionError: Connection error."}}, "error"))]),
], ids=["500-connection-error", "502", "in-stream-error-after-200"])
def test_relay_up_backend_down_says_so_and_who_can_fix_it(fake_server: Any, tmp_path: Path, script: Script) -> None:
    fake_server.route(relay(script))
    results = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, limits=RELAY)
    auth = results["auth"]
    assert auth.status == "unverified"
    assert "the relay answers but its backend does not" in auth.saw
    assert "relay's operator" in (auth.fix or "") and "retry later" not in (auth.fix or "")
    assert results["model"].status == "unverified"


def test_hung_backend_behind_a_live_relay(fake_server: Any, tmp_path: Path) -> None:
    models = json_script(200, {"object": "list", "data": [{"id": "claude-sonnet-4-5"}]})
    fake_server.route(relay(HUNG, models=models))
    auth = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, model="claude-x", limits=RELAY)["auth"]
    assert auth.status == "unverified"
    assert "the relay answers but its backend does not: no response within 1 s" in auth.saw
    assert f"GET {fake_server.url}/v1/models answered HTTP 200" in auth.saw
    assert "relay's operator" in (auth.fix or "")


def test_backend_lost_mid_stream_is_the_relays_backend(fake_server: Any, tmp_path: Path) -> None:
    writes = stream_script("anthropic", ["a", "b", "c"]).writes
    error = sse({"type": "error", "error": {"type": "api_error", "message": "APIConnectionError: upstream connect error"}},
                "error")
    fake_server.route(relay(Script(writes=[*writes[:5], (0.0, error)])))
    results = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, limits=RELAY)
    assert results["auth"].status == OK  # tokens came: the key and the model worked
    streaming = results["streaming"]
    assert streaming.status == "unverified" and "the relay answers but its backend does not" in streaming.saw
    assert "relay's operator" in (streaming.fix or "")


RATE_429 = {"type": "error", "error": {"type": "rate_limit_error", "message": "rate limit exceeded"}}


@pytest.mark.parametrize(("headers", "said"), [
    ((("llm_provider-retry-after", "60"),), "retry in 60 s (llm_provider-retry-after)"),
    ((("retry-after", "30"),), "retry in 30 s (retry-after)"),
    ((("retry-after-ms", "4000"), ("retry-after", "9")), "retry in 4 s (retry-after-ms)"),
    ((("x-ratelimit-limit-requests", "3"), ("x-ratelimit-remaining-requests", "0"), ("x-ratelimit-reset-requests", "20s")),
     "retry in 20 s (x-ratelimit-reset-*)"),
    ((), "the channel did not say when to retry"),
], ids=["litellm", "retry-after", "retry-after-ms", "openai-reset", "none"])
def test_rate_limit_line_reads_a_429_and_its_retry_header(fake_server: Any, tmp_path: Path,
                                                         headers: tuple[tuple[str, str], ...], said: str) -> None:
    fake_server.route(relay(json_script(429, RATE_429, headers)))
    results = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, limits=RELAY)
    line = results["rate_limits"]
    assert line.status == FAIL and line.informational
    assert "the rate limit is used up" in line.saw and said in line.saw and "rate limit exceeded" in line.saw
    assert results["auth"].status == "unverified" and "rate limit is used up" in results["auth"].saw


def test_anthropic_reset_header_on_a_429(fake_server: Any, tmp_path: Path) -> None:
    from datetime import datetime, timedelta, timezone

    reset = (datetime.now(timezone.utc) + timedelta(seconds=45)).isoformat()
    headers = (("anthropic-ratelimit-requests-limit", "50"), ("anthropic-ratelimit-requests-remaining", "0"),
               ("anthropic-ratelimit-requests-reset", reset))
    fake_server.route(relay(json_script(429, RATE_429, headers)))
    line = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, limits=RELAY)["rate_limits"]
    assert line.status == FAIL and "(anthropic-ratelimit-*-reset)" in line.saw
    assert 40 <= line.details["retry_after_s"] <= 45


# -------------------------------------------------------------- channel fidelity


def _fidelity(fake_server: Any, tmp_path: Path, script: Script, model: str = "claude-x") -> CheckResult:
    """Doctor's fidelity line when the latency probe (max_tokens 8) is answered with `script` and the one-token
    request with one token, as asked."""
    answer = relay(script)
    one = stream_script("anthropic", ["OK"], stop_reason="max_tokens", model=model)
    fake_server.route(lambda r: one if r.body != b"{}" and r.json().get("max_tokens") == 1 else answer(r))
    return run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, model=model, limits=RELAY)["fidelity"]


@pytest.mark.parametrize(("script", "said"), [
    (stream_script("anthropic", [f"w{i} " for i in range(16)]), "it ignores max_tokens: asked for 8, got 16 tokens"),
    (stream_script("anthropic", [f"w{i} " for i in range(8)], stop_reason="end_turn"),
     "it misreports the stop reason: end_turn (a natural end) at exactly max_tokens (8)"),
    (stream_script("anthropic", [f"w{i} " for i in range(6)], output_tokens=3),
     "its usage disagrees with the stream: 3 output tokens reported, 6 token deltas streamed"),
    (Script(headers_delay_s=0.3, writes=stream_script("anthropic", [f"w{i} " for i in range(4)]).writes),
     "it holds the response headers until the first token"),
    (stream_script("anthropic", ["a", "b"], model="gemma-3-270m"), "the answer names model gemma-3-270m, not claude-x"),
], ids=["max-tokens", "stop-reason", "usage", "headers-held", "model"])
def test_channel_fidelity_findings_are_informational(fake_server: Any, tmp_path: Path, script: Script,
                                                     said: str) -> None:
    fidelity = _fidelity(fake_server, tmp_path, script)
    assert fidelity.status == FAIL and fidelity.informational and said in fidelity.saw, fidelity.saw


def test_faithful_channel_passes_fidelity(fake_server: Any, tmp_path: Path) -> None:
    script = stream_script("anthropic", [f"w{i} " for i in range(8)], 0.2, 0.01, stop_reason="max_tokens",
                           model="claude-x-20250514")
    fidelity = _fidelity(fake_server, tmp_path, script)
    assert fidelity.status == OK and "headers before the first token" in fidelity.saw, fidelity.saw


def test_exit_1_only_for_what_the_user_can_fix_unless_strict(fake_server: Any, tmp_path: Path) -> None:
    """A relay that ignores max_tokens and does not cache: findings, exit 0; --strict: exit 1. Its tokens come
    3 ms apart: all at once they read as a buffering proxy once a busy machine delays the first past 50 ms."""
    fake_server.route(relay(stream_script("anthropic", [f"w{i} " for i in range(40)], 0.0, 0.003)))
    args = ("--base-url", fake_server.url, "--model", "claude-x", "--timeout", "2")
    relaxed = cli(tmp_path, *args, env={"ANTHROPIC_AUTH_TOKEN": KEY})
    assert relaxed.returncode == 0, relaxed.stdout + relaxed.stderr
    # LiteLLM's Anthropic route answers max_tokens below 16 with 16 tokens: the one-token request shows it too
    assert "note channel fidelity: it ignores max_tokens: asked for 32, got 40 tokens; asked for 1, got 40" \
        in relaxed.stdout
    assert cli(tmp_path, *args, "--strict", env={"ANTHROPIC_AUTH_TOKEN": KEY}).returncode == 1
    fake_server.route(relay(json_script(429, {"error": {"message": "slow down", "type": "rate_limit_error"}},
                                        (("retry-after", "30"),))))
    busy = cli(tmp_path, *args, env={"ANTHROPIC_AUTH_TOKEN": KEY})
    assert busy.returncode == 0 and "could not verify: the channel's rate limit is used up" in busy.stdout, busy.stdout
    assert cli(tmp_path, *args, "--strict", env={"ANTHROPIC_AUTH_TOKEN": KEY}).returncode == 1


@pytest.mark.parametrize("script", [UPSTREAM_500, HUNG, NO_DB], ids=["backend-down", "backend-hung", "wrong-key-no-db"])
def test_a_channel_that_cannot_serve_exits_1(fake_server: Any, tmp_path: Path, script: Script) -> None:
    """The relay answers its own routes, but no request is served (its backend down or hung, or it refuses the
    key as LiteLLM without a database does): the channel cannot serve, exit 1 (it was 0: "could not verify")."""
    fake_server.route(relay(script))
    proc = cli(tmp_path, "--base-url", fake_server.url, "--model", "claude-x", "--timeout", "1",
               env={"ANTHROPIC_AUTH_TOKEN": KEY})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "could not verify" in proc.stdout and " FAIL " not in proc.stdout


def test_a_healthy_channel_is_not_judged_against_an_slo_nobody_gave(fake_server: Any, tmp_path: Path) -> None:
    """TPOT 0.02 s: a 256-token answer takes over 5 s, above the 3 s e2e default of run and analyze. Doctor was
    given no SLO: it shows the arithmetic and exits 0 (it exited 1, "FAIL latency"); given one, it judges it."""
    fake_server.route(relay(stream_script("anthropic", [f"w{i} " for i in range(32)], 0.05, 0.02,
                                          stop_reason="max_tokens")))
    args = ("--base-url", fake_server.url, "--model", "claude-x", "--timeout", "5", "--json")
    plain = cli(tmp_path, *args, env={"ANTHROPIC_AUTH_TOKEN": KEY})
    assert plain.returncode == 0, plain.stdout + plain.stderr
    latency = next(c for c in json.loads(plain.stdout) if c["name"] == "latency")
    ttft, tpot, total = (latency["details"][k] for k in ("ttft_s", "tpot_s", "projected_e2e_s"))
    assert latency["status"] == OK and total == pytest.approx(ttft + 256 * tpot) and total > 3, latency
    assert f"TTFT + TPOT x 256 = {ttft:.3f} + {tpot:.4f} x 256 = {total:.1f} s" in latency["saw"]
    assert "no SLO given" in latency["saw"]
    judged = cli(tmp_path, *args, "--slo-e2e", "3", env={"ANTHROPIC_AUTH_TOKEN": KEY})
    latency = next(c for c in json.loads(judged.stdout) if c["name"] == "latency")
    assert judged.returncode == 1 and latency["status"] == FAIL and "total above 3 s" in latency["saw"], latency
    scenario = tmp_path / "mine.toml"  # the SLO the user's own scenario runs with is one given too
    scenario.write_text("[load]\nkind = \"constant\"\n[slo]\ne2e_s = 3\n")
    by_scenario = cli(tmp_path, *args, "--scenario", str(scenario), env={"ANTHROPIC_AUTH_TOKEN": KEY})
    latency = next(c for c in json.loads(by_scenario.stdout) if c["name"] == "latency")
    assert by_scenario.returncode == 1 and latency["status"] == FAIL and "total above 3 s" in latency["saw"], latency
    missing = cli(tmp_path, *args, "--scenario", str(tmp_path / "nope.toml"), env={"ANTHROPIC_AUTH_TOKEN": KEY})
    assert missing.returncode == 2 and "nope.toml" in missing.stderr and "Traceback" not in missing.stderr


def test_a_wrong_protocol_is_named_not_taken_for_a_wrong_base_url(fake_server: Any, tmp_path: Path) -> None:
    """Responses asked of an Anthropic-only endpoint (404 everywhere but /v1/messages): "this endpoint speaks
    anthropic: use --protocol anthropic", not "point --base-url at the API endpoint"; exit 1."""
    def anthropic_only(received: Received) -> Script:
        if received.path == "/v1/messages":
            return json_script(400, {"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": "messages: field required"}})
        return json_script(404, {"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}})

    fake_server.route(anthropic_only)
    for base in (fake_server.url, fake_server.url + "/v1"):
        results = run_doctor(tmp_path, base_url=base, api_key=KEY, protocol="openai-responses")
        found = results["base_url"]
        at = "" if base == fake_server.url else f" with --base-url {fake_server.url}"
        assert found.status == FAIL and found.fix == f"this endpoint speaks anthropic: use --protocol anthropic{at}", found
        assert "home page" not in found.fix and "speaks anthropic" in found.saw
    proc = cli(tmp_path, "--base-url", fake_server.url, "--protocol", "openai-chat", env={"OPENAI_API_KEY": KEY})
    assert proc.returncode == 1 and "use --protocol anthropic" in proc.stdout, proc.stdout


def test_help_says_what_exit_1_means(tmp_path: Path) -> None:
    out = cli(tmp_path, "--help").stdout
    assert "--strict" in out and "1 when the channel cannot serve" in out and "could not verify" in out.lower()


# ------------------------------------------------------------- prompt caching probe


def _caching_calls(fake_server: Any) -> list[int]:
    """The size (bytes of system prompt) of each prompt-caching request the server saw, in order."""
    return [len(r.json()["system"][0]["text"]) for r in fake_server.requests if r.body != b"{}" and r.method == "POST"
            and "system" in r.json()]


def _llama_context(limit: int) -> Any:
    def refuse(received: Received) -> Script:
        size = len(received.body) // 5  # about 5 characters per token in tokenload's synthetic prompts
        if size > limit:
            return json_script(400, {"error": {"code": 400, "type": "exceed_context_size_error", "n_ctx": limit,
                                               "n_prompt_tokens": size, "message":
                                               f"request ({size} tokens) exceeds the available context size "
                                               f"({limit} tokens), try increasing it"}})
        return stream_script("anthropic", ["OK"], input_tokens=size)
    return refuse


def test_caching_probe_fits_a_context_limit_the_channel_names(fake_server: Any, tmp_path: Path) -> None:
    refuse = _llama_context(2048)
    fake_server.route(lambda r: refuse(r) if r.body != b"{}" else relay(NO_DB)(r))
    caching = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, limits=RELAY)["caching"]
    calls = _caching_calls(fake_server)
    assert len(calls) == 3 and calls[1] == calls[2] < calls[0] / 2  # refused, then the fitted prefix twice
    assert "the channel's context is 2,048 tokens" in caching.saw and caching.details["context_limit"] == 2048
    assert caching.details["prefix_tokens_sent"] == 1536


def test_caching_probe_refused_without_a_limit_sends_no_repeat(fake_server: Any, tmp_path: Path) -> None:
    too_long = json_script(400, {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": "prompt is too long for the context window"}})
    fake_server.route(relay(stream_script("anthropic", ["OK"]), caching=too_long))
    caching = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, limits=RELAY)["caching"]
    assert caching.status == "unverified" and "named no limit" in caching.saw and "repeat was not sent" in caching.saw
    assert len(_caching_calls(fake_server)) == 1


def test_caching_probe_failure_sends_no_repeat(fake_server: Any, tmp_path: Path) -> None:
    fake_server.route(relay(stream_script("anthropic", ["OK"]), caching=UPSTREAM_500))
    caching = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, limits=RELAY)["caching"]
    assert caching.status == "unverified" and "the repeat was not sent" in caching.saw
    assert "the relay answers but its backend does not" in caching.saw
    assert len(_caching_calls(fake_server)) == 1


def test_one_cached_token_per_request_is_not_caching(fake_server: Any, tmp_path: Path) -> None:
    """llama.cpp reports cached_tokens = 1 (the shared first token) on nearly every request. The caching probe's
    two answers take 0.4 s to their first token, so a client slowed by a busy machine on the first (by less
    than 0.17 s) cannot make the repeat look 30% faster, as a cache would."""
    def one_cached(received: Received) -> Script:
        if received.body == b"{}":
            return relay(NO_DB)(received)
        prefill = 0.4 if len(received.body) > 5000 else 0.0  # the caching probe's long prefix
        script = stream_script("openai-chat", ["OK"], prefill, input_tokens=len(received.body) // 4)
        return Script(writes=[(d, b.replace(b'"total_tokens"', b'"prompt_tokens_details": {"cached_tokens": 1}, '
                                                               b'"total_tokens"')) for d, b in script.writes])

    fake_server.route(one_cached)
    results = run_doctor(tmp_path, base_url=fake_server.url + "/v1", api_key=KEY, protocol="openai-chat", limits=RELAY)
    caching = results["caching"]
    assert caching.status == FAIL and "not a cache hit" in caching.saw, caching.saw
    assert results["latency"].status == OK and "prompt cache" not in results["latency"].saw


def test_no_closest_match_is_invented(sim: str, tmp_path: Path) -> None:
    """claude-sonnet-4 is like neither sim-7b nor sim-30b: no arbitrary "closest match"."""
    model = run_doctor(tmp_path, base_url=sim, auth_token=KEY, model="claude-sonnet-4")["model"]
    assert model.status == FAIL and model.details["closest"] is None
    assert "closest" not in (model.fix or "")
    assert model.fix == "set --model to one of the models this channel serves: sim-7b, sim-30b (none is close to the one given)"


def test_backend_down_costs_one_request_and_reads_on_one_line(fake_server: Any, tmp_path: Path) -> None:
    """The model list names the model (so the model line is ok), but nothing else is sent to a dead backend."""
    message = ("litellm.InternalServerError: OpenAIException - Cannot connect to host 127.0.0.1:18180\n\n"
               "LiteLLM: model group 'claude-x' failed with the error above. " + "x" * 400)
    down = json_script(500, {"error": {"message": message, "type": None, "param": None, "code": "500"}})
    models = json_script(200, {"object": "list", "data": [{"id": "claude-x"}]})
    fake_server.route(relay(down, models=models))
    results = run_doctor(tmp_path, base_url=fake_server.url, auth_token=KEY, model="claude-x", limits=RELAY)
    assert results["model"].status == OK and "in the channel's model list" in results["model"].saw
    assert [results[n].status for n in ("latency", "streaming", "fidelity", "caching")] == [SKIP] * 4
    sent = [r for r in fake_server.requests if r.method == "POST" and r.body != b"{}"]
    assert len(sent) == 1
    auth = results["auth"].saw
    assert "the relay answers but its backend does not" in auth and "\n" not in auth and len(auth) < 400


# ------------------------------------------------------------------------ --server-metrics


def _server_load(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    checks = json.loads(proc.stdout)
    assert [c["name"] for c in checks] == [*NAMES, "server_load"], proc.stderr
    return checks[-1]


def test_cli_server_metrics_says_an_idle_server_was_not_busy(sim: str, tmp_path: Path) -> None:
    """Only doctor talks to this simulator, one request at a time: at most 1 running, none waiting."""
    metrics = sim.rsplit("/api", 1)[0] + "/metrics"
    proc = cli(tmp_path, "--json", "--model", "sim-7b", "--server-metrics", metrics,
               env={"ANTHROPIC_BASE_URL": sim, "ANTHROPIC_AUTH_TOKEN": KEY})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    load = _server_load(proc)
    assert load["status"] == "ok" and load["informational"], load
    assert load["details"]["running_max"] <= 1 and load["details"]["waiting_max"] == 0
    assert load["details"]["scrapes"] >= 2 and load["details"]["servers"] == ["vLLM"]  # one at the start, one at the end
    assert load["saw"].startswith("the server was not busy during the checks: at most ")


def test_cli_server_metrics_says_a_server_busy_with_other_traffic_was_busy(tmp_path: Path) -> None:
    """One batch slot, three other clients looping on it: the simulator runs 1 and queues 2 or 3 (doctor's own
    request makes the third) whenever it is scraped, and doctor says the server was busy."""
    import threading

    from simfixtures import anthropic_body, raw_request

    stop = threading.Event()
    with serve_in_thread("fast", slots=1, decode_base_s=0.01) as handle:
        def other_client() -> None:
            while not stop.is_set():
                raw_request(handle.base_url, "/v1/messages", anthropic_body("other traffic", 20))

        clients = [threading.Thread(target=other_client, daemon=True) for _ in range(3)]
        for thread in clients:
            thread.start()
        try:
            proc = cli(tmp_path, "--json", "--model", "sim-7b", "--prompt-tokens", "50", "--server-metrics",
                       handle.base_url.rsplit("/api", 1)[0] + "/metrics", env={"ANTHROPIC_BASE_URL": handle.base_url})
        finally:
            stop.set()
            for thread in clients:
                thread.join(10)
    load = _server_load(proc)
    assert load["status"] == "fail" and load["informational"], load
    assert load["details"]["running_max"] == 1 and 2 <= load["details"]["waiting_max"] <= 3, load["details"]
    assert load["saw"].startswith("the server was busy during the checks: at most 1 running, ")
    assert "tokenload run" in load["fix"]
    others = json.loads(proc.stdout)[:-1]  # informational: only --strict makes the busy server count
    assert proc.returncode == int(any(c["status"] == "fail" and not c["informational"] for c in others))


def test_cli_server_metrics_that_is_no_metrics_is_refused_before_any_request(fake_server: Any,
                                                                             tmp_path: Path) -> None:
    fake_server.route(lambda r: body_script(404, b"not found", "text/plain"))
    proc = cli(tmp_path, "--base-url", fake_server.url, "--model", "m", "--server-metrics", fake_server.url + "/metrics",
               env={"ANTHROPIC_AUTH_TOKEN": KEY})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"tokenload: error: server metrics: {fake_server.url}/metrics answered HTTP 404; "
                                   "give the server's Prometheus /metrics address or leave --server-metrics / "
                                   "[server] metrics_url out")
    assert [r.path for r in fake_server.requests] == ["/metrics"]
