"""Channel configuration: read the user's existing setup exactly, never leak a secret.

Common mistake 7 ("the configuration is not read at all") is the one users
cannot see, so resolution order, settings discovery and error messages are
pinned here. Everything runs on an explicit `env`, `cwd` and `home`, never the
real environment.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenload.channel import (
    Channel,
    add_channel_arguments,
    endpoint_url,
    fingerprint,
    parse_headers,
    resolve,
    resolve_from_args,
)
from tokenload.errors import ConfigError

SECRET = "sk-ant-SECRETsecret-0123456789abcdef"
TOKEN = "tok-AUTHauth-9876543210fedcba"


def write(path: Path, obj: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return path


def resolve_in(tmp_path: Path, env: dict[str, str] | None = None, **flags: str | None):  # type: ignore[no-untyped-def]
    """`resolve` isolated from the real environment, cwd and home."""
    return resolve(env=env or {}, cwd=tmp_path, home=tmp_path / "home", **flags)


# ------------------------------------------------------------ resolution order


@pytest.mark.parametrize(
    ("layers", "winner"),
    [
        (("flag", "env", "settings"), "flag"),
        (("env", "settings"), "env"),
        (("settings",), "settings"),
        ((), "default"),
        (("flag", "settings"), "flag"),
    ],
)
def test_resolution_order_flags_env_settings_defaults(tmp_path: Path, layers: tuple[str, ...], winner: str) -> None:
    values = {layer: f"http://{layer}.example/api" for layer in ("flag", "env", "settings")}
    models = {layer: f"model-{layer}" for layer in ("flag", "env", "settings")}
    env = {"ANTHROPIC_BASE_URL": values["env"], "ANTHROPIC_MODEL": models["env"]} if "env" in layers else {}
    if "settings" in layers:
        write(tmp_path / ".claude/settings.json", {"env": {"ANTHROPIC_BASE_URL": values["settings"], "ANTHROPIC_MODEL": models["settings"]}})
    flags = {"base_url": values["flag"], "model": models["flag"]} if "flag" in layers else {}
    res = resolve_in(tmp_path, env, **flags)
    if winner == "default":
        assert res.channel.base_url == "https://api.anthropic.com"
        assert res.sources["base_url"] == "default"
    else:
        assert res.channel.base_url == values[winner]
        assert res.channel.model == models[winner]
        assert res.sources["base_url"].startswith({"flag": "flag", "env": "environment", "settings": "settings"}[winner])


def test_each_field_resolves_independently(tmp_path: Path) -> None:
    """A flag for the model does not hide the environment's key or the settings' URL."""
    write(tmp_path / ".claude/settings.json", {"env": {"ANTHROPIC_BASE_URL": "http://s.example/api", "ANTHROPIC_MODEL": "m-settings"}})
    res = resolve_in(tmp_path, {"ANTHROPIC_AUTH_TOKEN": TOKEN}, model="m-flag")
    ch = res.channel
    assert (ch.base_url, ch.model, ch.auth_token) == ("http://s.example/api", "m-flag", TOKEN)
    assert res.sources["auth_token"] == "environment ANTHROPIC_AUTH_TOKEN"
    assert ".claude/settings.json" in res.sources["base_url"]


@pytest.mark.parametrize(
    "settings",
    [
        {"anthropic": {"base_url": "http://relay.example/api", "auth_token": TOKEN, "api_key": SECRET, "model": "m1"}},
        {"env": {"ANTHROPIC_BASE_URL": "http://relay.example/api", "ANTHROPIC_AUTH_TOKEN": TOKEN, "ANTHROPIC_API_KEY": SECRET, "ANTHROPIC_MODEL": "m1"}},
    ],
    ids=["tokenload-form", "claude-code-form"],
)
def test_both_settings_forms(tmp_path: Path, settings: dict) -> None:
    path = write(tmp_path / "cfg.json", settings)
    ch = resolve_in(tmp_path, settings=str(path)).channel
    assert (ch.base_url, ch.auth_token, ch.api_key, ch.model) == ("http://relay.example/api", TOKEN, SECRET, "m1")
    assert ch.url == "http://relay.example/api/v1/messages"


def test_settings_headers_as_object(tmp_path: Path) -> None:
    path = write(tmp_path / "cfg.json", {"anthropic": {"base_url": "http://h", "headers": {"X-Team": "a", "X-Env": "b"}}})
    assert dict(resolve_in(tmp_path, settings=str(path)).channel.extra_headers) == {"X-Team": "a", "X-Env": "b"}


def test_auto_discovered_settings_precedence(tmp_path: Path) -> None:
    """settings.local.json > project settings.json > ~/.claude/settings.json, and the source names the file."""
    files = {
        "local": tmp_path / ".claude/settings.local.json",
        "project": tmp_path / ".claude/settings.json",
        "home": tmp_path / "home/.claude/settings.json",
    }
    for name, path in files.items():
        write(path, {"env": {"ANTHROPIC_MODEL": f"model-{name}", "ANTHROPIC_BASE_URL": f"http://{name}.example"}})
    for name in ("local", "project", "home"):
        res = resolve_in(tmp_path)
        assert res.channel.model == f"model-{name}"
        assert str(files[name]) in res.sources["model"]
        assert res.settings_files[0] == files[name]
        files[name].unlink()
    assert resolve_in(tmp_path).settings_files == []


def test_lower_precedence_settings_fill_gaps(tmp_path: Path) -> None:
    write(tmp_path / ".claude/settings.local.json", {"env": {"ANTHROPIC_MODEL": "m-local"}})
    write(tmp_path / "home/.claude/settings.json", {"env": {"ANTHROPIC_BASE_URL": "http://home.example/api", "ANTHROPIC_MODEL": "m-home"}})
    ch = resolve_in(tmp_path).channel
    assert (ch.model, ch.base_url) == ("m-local", "http://home.example/api")


def test_explicit_settings_skips_discovery(tmp_path: Path) -> None:
    write(tmp_path / ".claude/settings.local.json", {"env": {"ANTHROPIC_MODEL": "m-local"}})
    path = write(tmp_path / "mine.json", {"env": {"ANTHROPIC_BASE_URL": "http://mine.example"}})
    res = resolve_in(tmp_path, settings=str(path))
    assert res.settings_files == [path]
    assert res.channel.model == "claude-sonnet-4-20250514"


def test_missing_settings_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.json.*does not exist"):
        resolve_in(tmp_path, settings=str(tmp_path / "nope.json"))


def test_invalid_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.json", '{\n  "env": {\n    "ANTHROPIC_MODEL": "x",\n  }\n}\n')
    with pytest.raises(ConfigError) as info:
        resolve_in(tmp_path, settings=str(path))
    message = str(info.value)
    assert str(path) in message and "line 4 column 3" in message


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"[1, 2]", "JSON object"), (b"\xff\xfe{}", "UTF-8")],
    ids=["not-an-object", "not-utf8"],
)
def test_unusable_settings_file_is_a_config_error(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "s.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        resolve_in(tmp_path, settings=str(path))


def test_settings_with_utf8_bom_is_read(tmp_path: Path) -> None:
    """Windows editors save JSON with a BOM; Claude Code reads it, so must we."""
    path = tmp_path / "s.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"env": {"ANTHROPIC_MODEL": "m-bom"}}).encode())
    assert resolve_in(tmp_path, settings=str(path)).channel.model == "m-bom"


def test_empty_environment_variable_does_not_hide_settings(tmp_path: Path) -> None:
    """`export ANTHROPIC_API_KEY=` (empty) is unset for every SDK; the settings key must still apply."""
    write(tmp_path / ".claude/settings.json", {"env": {"ANTHROPIC_API_KEY": SECRET, "ANTHROPIC_BASE_URL": "http://s.example"}})
    res = resolve_in(tmp_path, {"ANTHROPIC_API_KEY": "", "ANTHROPIC_BASE_URL": "  "})
    assert res.channel.api_key == SECRET
    assert res.channel.base_url == "http://s.example"


# ------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    ("raw", "problem"),
    [(SECRET + "\n", "newline"), ("  " + SECRET + " ", "whitespace"), (SECRET + "\r\n", "newline")],
    ids=["newline", "spaces", "crlf"],
)
@pytest.mark.parametrize("source", ["env", "flag", "settings"])
def test_whitespace_in_key_warns_without_showing_it(tmp_path: Path, raw: str, problem: str, source: str) -> None:
    env = {"ANTHROPIC_API_KEY": raw} if source == "env" else {}
    flags = {"api_key": raw} if source == "flag" else {}
    if source == "settings":
        write(tmp_path / ".claude/settings.json", {"env": {"ANTHROPIC_API_KEY": raw}})
    res = resolve_in(tmp_path, env, **flags)
    assert res.channel.api_key == SECRET  # stripped for this run
    assert len(res.warnings) == 1
    warning = res.warnings[0]
    assert problem in warning and "api key" in warning
    assert SECRET not in warning and SECRET[:-4] not in warning
    assert fingerprint(raw) in warning  # last 4 characters and length: enough to recognise it


def test_clean_key_gives_no_warning(tmp_path: Path) -> None:
    assert resolve_in(tmp_path, {"ANTHROPIC_API_KEY": SECRET}).warnings == []


def channel_with_secrets() -> Channel:
    return Channel(base_url="http://relay.example/api", api_key=SECRET, auth_token=TOKEN, extra_headers={"X-Org": "o"})


@pytest.mark.parametrize(
    "render",
    [repr, str, lambda ch: json.dumps(ch.public()), lambda ch: f"{ch!r} {ch}", lambda ch: str(ch.with_model("m2"))],
    ids=["repr", "str", "public", "fstring", "with_model"],
)
def test_no_secret_in_any_rendering(render) -> None:  # type: ignore[no-untyped-def]
    text = render(channel_with_secrets())
    for secret in (SECRET, TOKEN):
        assert secret not in text
        assert secret[:-4] not in text
    assert "relay.example" in text


def test_redact_masks_own_secrets_and_keylike_strings() -> None:
    ch = channel_with_secrets()
    echoed = f"invalid key {SECRET}, token {TOKEN}; also sk-proj-OTHERkey123456 and Bearer abcdefghijklmnop"
    text = ch.redact(echoed)
    for leaked in (SECRET, TOKEN, "sk-proj-OTHERkey123456", "abcdefghijklmnop"):
        assert leaked not in text
    assert "invalid key" in text


def test_fingerprint_never_contains_a_short_key() -> None:
    assert "abc" not in fingerprint("abc")
    assert fingerprint("abcdefghijklmnop").startswith("…mnop")


# ---------------------------------------------------------- headers and URLs


def test_custom_headers_parsing() -> None:
    assert parse_headers("X-A: 1\n\nX-B:  two: parts \r\nX-C:") == {"X-A": "1", "X-B": "two: parts", "X-C": ""}


def test_custom_headers_from_environment_are_sent(tmp_path: Path) -> None:
    ch = resolve_in(tmp_path, {"ANTHROPIC_CUSTOM_HEADERS": "X-Team: blue\nX-Trace: 1"}).channel
    assert ch.headers()["X-Team"] == "blue" and ch.headers()["X-Trace"] == "1"
    assert ch.public()["extra_headers"] == ["X-Team", "X-Trace"]


def test_bad_custom_header_line_is_a_config_error_without_its_value() -> None:
    """Custom header values are often credentials: the error names the line, not its content."""
    with pytest.raises(ConfigError) as info:
        parse_headers(f"X-Ok: 1\nX-Api-Key={SECRET}")
    assert "Name: value" in str(info.value)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    ("base", "protocol", "url"),
    [
        ("http://h/api", "anthropic", "http://h/api/v1/messages"),
        ("http://h/api/", "anthropic", "http://h/api/v1/messages"),
        ("https://api.anthropic.com", "anthropic", "https://api.anthropic.com/v1/messages"),
        ("http://h/api/v1", "anthropic", "http://h/api/v1/v1/messages"),  # faithful to the SDK: doctor flags it
        ("http://h/v1", "openai-chat", "http://h/v1/chat/completions"),
        ("http://h", "openai-chat", "http://h/v1/chat/completions"),
        ("http://h/api/v1/", "openai-responses", "http://h/api/v1/responses"),
        ("http://h/openai", "openai-responses", "http://h/openai/v1/responses"),
    ],
)
def test_endpoint_url_joins_like_the_sdks(base: str, protocol: str, url: str) -> None:
    assert endpoint_url(base, protocol) == url


@pytest.mark.parametrize(
    ("protocol", "api_key", "auth_token", "expected"),
    [
        ("anthropic", SECRET, None, {"x-api-key": SECRET}),
        ("anthropic", None, TOKEN, {"authorization": f"Bearer {TOKEN}"}),
        ("anthropic", SECRET, TOKEN, {"x-api-key": SECRET, "authorization": f"Bearer {TOKEN}"}),
        ("openai-chat", SECRET, None, {"authorization": f"Bearer {SECRET}"}),
        ("openai-responses", None, TOKEN, {"authorization": f"Bearer {TOKEN}"}),
    ],
)
def test_auth_headers(protocol: str, api_key: str | None, auth_token: str | None, expected: dict[str, str]) -> None:
    ch = Channel(base_url="http://h", protocol=protocol, api_key=api_key, auth_token=auth_token)
    assert ch.auth_headers() == expected


@pytest.mark.parametrize(
    ("env", "protocol", "base_url"),
    [
        ({"OPENAI_BASE_URL": "http://o.example/v1", "OPENAI_API_KEY": SECRET}, "openai-chat", "http://o.example/v1"),
        ({"OPENAI_API_KEY": SECRET, "ANTHROPIC_API_KEY": SECRET}, "anthropic", "https://api.anthropic.com"),
        ({}, "anthropic", "https://api.anthropic.com"),
    ],
    ids=["openai-only", "both", "none"],
)
def test_protocol_inferred_from_openai_variables_only(tmp_path: Path, env: dict[str, str], protocol: str, base_url: str) -> None:
    res = resolve_in(tmp_path, env)
    assert res.channel.protocol == protocol
    assert res.channel.base_url == base_url


def test_openai_key_sent_as_bearer_after_inference(tmp_path: Path) -> None:
    ch = resolve_in(tmp_path, {"OPENAI_API_KEY": SECRET}).channel
    assert ch.headers()["authorization"] == f"Bearer {SECRET}"
    assert "anthropic-version" not in ch.headers()


def test_openai_protocol_falls_back_to_anthropic_variables_of_a_dual_relay(tmp_path: Path) -> None:
    """A relay configured for Claude Code only, driven with --protocol openai-chat."""
    env = {"ANTHROPIC_BASE_URL": "http://relay.example/api", "ANTHROPIC_AUTH_TOKEN": SECRET, "ANTHROPIC_MODEL": "m1"}
    res = resolve(protocol="openai-chat", env=env, cwd=tmp_path, home=tmp_path / "home")
    assert res.channel.url == "http://relay.example/api/v1/chat/completions"
    assert res.channel.headers()["authorization"] == f"Bearer {SECRET}"
    assert res.channel.model == "m1"
    assert res.sources["base_url"] == "environment ANTHROPIC_BASE_URL"


def test_openai_variables_win_over_the_anthropic_fallback(tmp_path: Path) -> None:
    env = {"ANTHROPIC_BASE_URL": "http://relay.example/api", "OPENAI_BASE_URL": "http://o.example/v1"}
    res = resolve(protocol="openai-responses", env=env, cwd=tmp_path, home=tmp_path / "home")
    assert res.channel.base_url == "http://o.example/v1"


def test_anthropic_protocol_never_reads_openai_variables(tmp_path: Path) -> None:
    env = {"OPENAI_BASE_URL": "http://o.example/v1", "OPENAI_API_KEY": SECRET}
    res = resolve(protocol="anthropic", env=env, cwd=tmp_path, home=tmp_path / "home")
    assert res.channel.base_url == "https://api.anthropic.com" and res.channel.secrets == ()


@pytest.mark.parametrize(
    "kwargs",
    [{"base_url": "relay.example/api"}, {"base_url": "ftp://h"}, {"base_url": "http://h", "protocol": "grpc"}],
    ids=["no-scheme", "ftp", "bad-protocol"],
)
def test_invalid_channel_is_a_config_error(kwargs: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        Channel(**kwargs)


def test_resolve_from_args_reads_flags_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI path: argparse options plus the process environment and cwd."""
    for var in ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_MODEL", "ANTHROPIC_CUSTOM_HEADERS",
                "OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_channel_arguments(parser)
    res = resolve_from_args(parser.parse_args(["--base-url", "http://h/api", "--protocol", "anthropic", "--model", "m"]))
    assert (res.channel.url, res.channel.model, res.channel.auth_token) == ("http://h/api/v1/messages", "m", TOKEN)


# ------------------------------------------------------------ the scenario layer (a load scenario's [channel])


@pytest.mark.parametrize(
    ("layers", "winner"),
    [
        (("flag", "env", "settings", "scenario"), "flag"),
        (("env", "settings", "scenario"), "env"),
        (("settings", "scenario"), "settings"),
        (("scenario",), "scenario"),
        ((), "default"),
    ],
)
def test_scenario_values_are_defaults_below_flags_environment_and_settings(
        tmp_path: Path, layers: tuple[str, ...], winner: str) -> None:
    """flags > environment > settings > scenario > built-in defaults, and the source names the true layer."""
    label = "scenario ramp [channel]"
    env = {"ANTHROPIC_MODEL": "m-env", "ANTHROPIC_BASE_URL": "http://env.example"} if "env" in layers else {}
    if "settings" in layers:
        write(tmp_path / ".claude/settings.json", {"env": {"ANTHROPIC_MODEL": "m-settings",
                                                           "ANTHROPIC_BASE_URL": "http://settings.example"}})
    flags = {"model": "m-flag", "base_url": "http://flag.example"} if "flag" in layers else {}
    scenario = {"model": "m-scenario", "base_url": "http://scenario.example"} if "scenario" in layers else None
    res = resolve(env=env, cwd=tmp_path, home=tmp_path / "home", scenario=scenario, scenario_label=label, **flags)
    expected_model = {"default": "claude-sonnet-4-20250514"}.get(winner, f"m-{winner}")
    assert res.channel.model == expected_model
    source = {"flag": "flag --model", "env": "environment ANTHROPIC_MODEL", "scenario": label,
              "default": "default"}.get(winner, "settings ")
    assert res.sources["model"].startswith(source), res.sources
    assert f"model from {res.sources['model']}" in res.describe()


def test_a_scenario_protocol_beats_the_inference_but_not_the_flag(tmp_path: Path) -> None:
    """Inferring openai-chat from OPENAI_* variables is a default: a scenario's protocol wins over it."""
    env = {"OPENAI_BASE_URL": "http://relay.example/v1"}
    res = resolve_in(tmp_path, env, scenario={"protocol": "openai-responses"}, scenario_label="scenario s")
    assert (res.channel.protocol, res.sources["protocol"]) == ("openai-responses", "scenario s")
    assert res.channel.base_url == "http://relay.example/v1"
    res = resolve_in(tmp_path, env, protocol="openai-chat", scenario={"protocol": "openai-responses"})
    assert (res.channel.protocol, res.sources["protocol"]) == ("openai-chat", "flag --protocol")
