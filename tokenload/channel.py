"""Channel configuration: where requests go, how they authenticate, which model.

Users already configured their channel for a coding assistant, so tokenload reads
that configuration exactly as it is: flags > environment (`ANTHROPIC_*`,
`OPENAI_*`) > settings.json (tokenload's `{"anthropic": {...}}` form or Claude
Code's `{"env": {...}}` form) > a load scenario's `[channel]` defaults > built-in
defaults, all decided in `resolve()`. Every field remembers where it came
from, so `doctor` can say which source supplied it. Secrets never leave this
module in clear text: `repr()`, `public()` and `redact()` show fingerprints only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, TypedDict
from urllib.parse import urlsplit

from tokenload.errors import ConfigError
from tokenload.protocolspec import DEFAULT_PROTOCOL, ENV_VARS, PROTOCOLS, SPECS

# Claude Code's settings files, highest precedence first.
SETTINGS_CANDIDATES: tuple[str, ...] = (
    ".claude/settings.local.json",
    ".claude/settings.json",
    "~/.claude/settings.json",
)

KNOWN_ENV_VARS: frozenset[str] = frozenset(v for family in ENV_VARS.values() for v in family.values())

SECRET_FIELDS: tuple[str, ...] = ("api_key", "auth_token")


def fingerprint(secret: str) -> str:
    """A safe stand-in for a secret: its length and, if long enough, last 4 characters."""
    stripped = secret.strip()
    tail = f"…{stripped[-4:]}" if len(stripped) >= 12 else "****"
    return f"{tail} ({len(secret)} chars)"


def family(protocol: str) -> str:
    """Which environment variables a protocol reads (a key of `ENV_VARS`)."""
    return SPECS[protocol].family


def endpoint_url(base_url: str, protocol: str, model: str = "") -> str:
    """Join base URL and API path the way the official SDKs do (`ProtocolSpec.endpoint_url`).

    Anthropic: base + `/v1/messages`, so `https://host/api` gives
    `https://host/api/v1/messages` (and a base ending in `/v1` gives the 404
    `/v1/v1/messages`, faithfully, so `doctor` can catch it). OpenAI bases
    usually end in `/v1`; when one does not, `/v1` is added.
    """
    return SPECS[protocol].endpoint_url(base_url, model)


def parse_headers(text: str) -> dict[str, str]:
    """`ANTHROPIC_CUSTOM_HEADERS` format: one `Name: value` per line."""
    headers: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            # The line is not echoed: custom header values are often credentials.
            raise ConfigError(
                f"custom header line {number} is not 'Name: value'; write one 'Name: value' per line"
            )
        headers[name.strip()] = value.strip()
    return headers


@dataclass(frozen=True, repr=False)
class Channel:
    """A resolved model channel. Immutable; safe to share between users and threads."""

    base_url: str
    protocol: str = DEFAULT_PROTOCOL
    model: str = SPECS[DEFAULT_PROTOCOL].default_model
    api_key: str | None = None
    auth_token: str | None = None
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    connect_timeout_s: float = 10.0
    first_token_timeout_s: float = 120.0
    idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {self.protocol!r}; use one of {', '.join(PROTOCOLS)}")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"base URL {self.base_url!r} is not an http(s) URL; give the API endpoint, e.g. https://relay.example/api"
            )

    @property
    def url(self) -> str:
        """The full request URL for this channel's protocol and model."""
        return endpoint_url(self.base_url, self.protocol, self.model)

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self.api_key, self.auth_token) if s)

    def auth_headers(self) -> dict[str, str]:
        """Authentication headers as the official SDKs send them."""
        return SPECS[self.protocol].auth_headers(self.api_key, self.auth_token)

    def headers(self) -> dict[str, str]:
        """Every header a streaming request carries, auth included."""
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        headers.update(SPECS[self.protocol].headers)
        headers.update(self.extra_headers)
        headers.update(self.auth_headers())
        return headers

    def public(self) -> dict[str, object]:
        """A JSON-safe description without secrets, for manifests and reports."""
        return {
            "base_url": self.base_url,
            "url": self.url,
            "protocol": self.protocol,
            "model": self.model,
            "api_key": fingerprint(self.api_key) if self.api_key else None,
            "auth_token": fingerprint(self.auth_token) if self.auth_token else None,
            "extra_headers": sorted(self.extra_headers),
        }

    def redact(self, text: str) -> str:
        """`text` with every secret of this channel, and anything key-shaped, masked."""
        return redact_secrets(text, self.secrets)

    def with_model(self, model: str) -> Channel:
        return replace(self, model=model)

    def __repr__(self) -> str:
        auth = ", ".join(f"{k}={v}" for k, v in self.public().items() if k in SECRET_FIELDS and v)
        return f"Channel({self.protocol} {self.url} model={self.model}{', ' + auth if auth else ''})"

    __str__ = __repr__


_KEYLIKE = re.compile(r"\b(sk-[A-Za-z0-9_\-]{6,}|sk_[A-Za-z0-9_\-]{6,}|Bearer\s+[A-Za-z0-9_\-.=]{8,})")


def redact_keylike(text: str) -> str:
    """Mask substrings that look like API keys (servers sometimes echo them back)."""
    return _KEYLIKE.sub(lambda m: m.group(0)[:5] + "…[redacted]", text)


# Shorter values are not secrets worth the name: masking them would mangle ordinary
# words (a 1-character key turned `max_tokens` into `ma****...`) and protect nothing.
# From this length on a value is masked wherever it appears, glued to other text too
# (`key%3D<secret>` in an echoed URL), since no ordinary word contains a real key.
MIN_SECRET_CHARS = 8


def redact_secrets(text: str, secrets: Iterable[str]) -> str:
    """`text` with each secret (as given and stripped) shown as its fingerprint, and key shapes masked.

    Only secrets of at least `MIN_SECRET_CHARS` characters. Longest first, so a
    secret that contains another is replaced whole.
    """
    long_enough = (v for v in secrets if len(v.strip()) >= MIN_SECRET_CHARS)
    for secret in sorted(long_enough, key=len, reverse=True):
        for form in (secret, secret.strip()):
            text = text.replace(form, fingerprint(secret))
    return redact_keylike(text)


@dataclass
class Resolution:
    """A channel plus how it was resolved: the source of each field and any warnings."""

    channel: Channel
    sources: dict[str, str]
    warnings: list[str]
    settings_files: list[Path]
    raw: dict[str, str]

    FIELD_LABELS: ClassVar[dict[str, str]] = {
        "base_url": "base URL", "api_key": "API key", "auth_token": "auth token", "model": "model",
        "protocol": "protocol",
    }

    def describe(self) -> str:
        """Which source supplied each field, e.g. `base URL from settings .claude/settings.json (...)`."""
        return "; ".join(f"{label} from {self.sources[name]}" for name, label in self.FIELD_LABELS.items()
                         if name in self.sources)


def _read_settings(path: Path) -> dict[str, str]:
    """Channel fields from one settings.json, in either supported form."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # editors on Windows save a BOM
    except OSError as exc:
        raise ConfigError(f"cannot read settings file {path}: {exc.strerror}; check the path given to --settings") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"settings file {path} is not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8 JSON"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"settings file {path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; fix the JSON"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"settings file {path} must hold a JSON object, like {{\"env\": {{...}}}}")
    fields: dict[str, str] = {}
    env_block = data.get("env")
    if isinstance(env_block, dict):
        fields.update({var: v for var, v in env_block.items() if var in KNOWN_ENV_VARS and isinstance(v, str)})
    for section, names in ENV_VARS.items():
        block = data.get(section)
        if not isinstance(block, dict):
            continue
        for name, var in names.items():
            value = block.get(name)
            if isinstance(value, dict) and name == "headers":
                value = "\n".join(f"{k}: {v}" for k, v in value.items())
            if isinstance(value, str):
                fields[var] = value
    return fields


def settings_paths(explicit: str | None, cwd: Path, home: Path) -> list[Path]:
    """The settings files to read, highest precedence first."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ConfigError(f"settings file {explicit} does not exist; check the path given to --settings")
        return [path]
    found = []
    for candidate in SETTINGS_CANDIDATES:
        path = home / candidate[2:] if candidate.startswith("~/") else cwd / candidate
        if path.is_file():
            found.append(path)
    return found


def _whitespace_problem(value: str) -> str | None:
    if value != value.strip():
        return "a newline" if ("\n" in value or "\r" in value) else "surrounding whitespace"
    if any(c.isspace() for c in value):
        return "whitespace inside it"
    return None


def resolve(
    *,
    protocol: str | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
    auth_token: str | None = None,
    model: str | None = None,
    settings: str | None = None,
    scenario: Mapping[str, str | None] | None = None,
    scenario_label: str = "scenario",
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    home: Path | None = None,
) -> Resolution:
    """Resolve a channel: flags (the keyword arguments) > environment > settings > scenario > defaults.

    `scenario` is a load scenario's `[channel]` table (`protocol`, `base_url`,
    `model`): defaults the scenario's author suggests, so anything the user set
    (a flag, an exported variable, a settings file) wins over them. The source
    of such a value reads `scenario_label`, e.g. `scenario ramp.toml [channel]`.
    The protocol is never set by the environment; inferring openai-chat from
    OPENAI_*-only variables is a default, so a scenario's protocol beats it.
    """
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    home = Path.home() if home is None else home
    suggested = {k: v for k, v in (scenario or {}).items() if v is not None and v.strip()}
    files = settings_paths(settings, cwd, home)
    file_fields: dict[str, tuple[str, Path]] = {}
    for path in reversed(files):  # lower precedence first, so higher ones overwrite
        for var, value in _read_settings(path).items():
            file_fields[var] = (value, path)

    def has_any(fam: str) -> bool:
        return any(v in env or v in file_fields for v in ENV_VARS[fam].values())

    if protocol is not None:
        proto_source = "flag --protocol"
    elif "protocol" in suggested:
        protocol, proto_source = suggested["protocol"], scenario_label
    else:
        protocol, proto_source = _inferred_protocol([fam for fam in ENV_VARS if has_any(fam)])
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
    spec = SPECS[protocol]
    # An OpenAI-protocol run against a relay configured only through ANTHROPIC_*
    # (one endpoint speaking both APIs) falls back to those variables.
    families = spec.env_families
    flags = {"base_url": base_url, "api_key": api_key, "auth_token": auth_token, "model": model}
    defaults = {"base_url": spec.default_base_url, "model": spec.default_model}
    raw: dict[str, str] = {}
    sources: dict[str, str] = {"protocol": proto_source}
    for name in ("base_url", "api_key", "auth_token", "model", "headers"):
        layers: list[tuple[str | None, str]] = [(flags.get(name), f"flag --{name.replace('_', '-')}")]
        for var in (ENV_VARS[fam][name] for fam in families if name in ENV_VARS[fam]):
            setting = file_fields.get(var)
            layers += [(env.get(var), f"environment {var}"),
                       (setting[0] if setting else None, f"settings {setting[1]} ({var})" if setting else "")]
        layers += [(suggested.get(name), scenario_label), (defaults.get(name), "default")]
        # An empty or blank value is unset, as for the SDKs: a lower layer still applies.
        found = next(((value, source) for value, source in layers if value is not None and value.strip()), None)
        if found is not None:
            raw[name], sources[name] = found

    warnings: list[str] = []
    clean: dict[str, str] = {}
    for name in ("base_url", "api_key", "auth_token", "model"):
        if name not in raw:
            continue
        value = raw[name]
        problem = _whitespace_problem(value)
        if problem:
            shown = fingerprint(value) if name in SECRET_FIELDS else repr(value)
            warnings.append(
                f"{name.replace('_', ' ')} from {sources[name]} has {problem} ({shown}); "
                "remove it where the value is set (it is stripped for this run)"
            )
        clean[name] = value.strip()
        if not clean[name]:
            del clean[name]
    channel = Channel(
        base_url=clean.get("base_url", spec.default_base_url),
        protocol=protocol,
        model=clean.get("model", spec.default_model),
        api_key=clean.get("api_key"),
        auth_token=clean.get("auth_token"),
        extra_headers=parse_headers(raw["headers"]) if "headers" in raw else {},
    )
    return Resolution(channel=channel, sources=sources, warnings=warnings, settings_files=files, raw=raw)


def _inferred_protocol(families_set: list[str]) -> tuple[str, str]:
    """The protocol when nothing names one, and why: the default, unless only another family's variables are
    set (OPENAI_* alone means openai-chat, the first protocol of that family)."""
    default = SPECS[DEFAULT_PROTOCOL]
    if len(families_set) == 1 and families_set[0] != default.family:
        fam = families_set[0]
        return next(s.name for s in SPECS.values() if s.family == fam), f"inferred from {fam.upper()}_* variables"
    return default.name, "default"


def add_channel_arguments(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    """The CHANNEL options, the same on every command (`several_models`: `--model` may be repeated, as on run)."""
    group = parser.add_argument_group(
        "channel",
        f"Resolution order: these flags > environment ({', '.join(v for fam in ENV_VARS.values() for v in fam.values())}"
        ") > settings.json (--settings, else ./.claude/settings.local.json, "
        "./.claude/settings.json, ~/.claude/settings.json) > a scenario's [channel] table (run) > defaults.",
    )
    group.add_argument("--base-url", help="API base URL, e.g. https://relay.example/api (the path part matters)")
    group.add_argument("--api-key", help="key sent as x-api-key (Anthropic) or Bearer (OpenAI); prefer the environment")
    group.add_argument("--auth-token", help="token sent as Authorization: Bearer (ANTHROPIC_AUTH_TOKEN)")
    if several_models:
        group.add_argument("--model", action="append",
                           help="model id, e.g. claude-sonnet-4-20250514; repeat it to send to several models (they "
                                "replace the scenario's [channel] models; requests pick among them)")
    else:
        group.add_argument("--model", help="model id, e.g. claude-sonnet-4-20250514")
    group.add_argument("--protocol", choices=PROTOCOLS, help="wire protocol (default: anthropic, or openai-chat when only OPENAI_* is set)")
    group.add_argument("--settings", metavar="FILE", help="settings.json in {\"anthropic\": {...}} or Claude Code's {\"env\": {...}} form")


class ChannelFlags(TypedDict, total=False):
    """The CHANNEL options as `resolve()` takes them: the flags layer."""

    protocol: str | None
    base_url: str | None
    api_key: str | None
    auth_token: str | None
    model: str | None
    settings: str | None


def channel_flags(args: argparse.Namespace) -> ChannelFlags:
    """The parsed CHANNEL options as `resolve()`'s keyword arguments."""
    model = args.model[0] if isinstance(args.model, list) else args.model  # a repeated --model: the first resolves
    return ChannelFlags(protocol=args.protocol, base_url=args.base_url, api_key=args.api_key,
                        auth_token=args.auth_token, model=model, settings=args.settings)


def resolve_from_args(args: argparse.Namespace) -> Resolution:
    """Resolve the channel from parsed CHANNEL options plus environment and settings."""
    return resolve(**channel_flags(args))
