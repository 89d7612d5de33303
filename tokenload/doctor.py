"""The checks behind `tokenload doctor`: the seven common channel mistakes, diagnosed in order.

Each check is one function taking the shared `Doctor` context and returning a
`CheckResult` (name, ok/fail/skip, what it saw, the exact fix). The order is
the common mistakes' list adjusted to what each check needs before it can say anything
true:

1. configuration read (mistake #7): nothing else means anything until we know
   what was read, from where;
2. key hygiene (the offline half of mistake #1): whitespace, placeholders,
   conflicting keys, no key, all without a request;
3. base URL (mistake #2): a 401 from a home page or a 404 from a wrong path
   says nothing about the key, so the URL is settled first;
4. auth (the online half of mistake #1);
5. model (mistake #3);
6. latency (mistakes #4, #5, #6): TTFT, TPOT, long outputs;
7. streaming end to end: incremental arrival and a clean end;
8. channel fidelity (informational): does the channel honour max_tokens, report
   the stop reason and usage truthfully, send headers before the first token and
   serve the model named? A relay can get each wrong;
9. the rate limits the channel announced (`anthropic-ratelimit-*`, `x-ratelimit-*`),
   as one line: what a load test may send; a 429 says when to retry;
10. prompt caching: does the second of two identical long-prefix requests read
   the prefix from the channel's cache (a relay may strip it)?
11. with `--server-metrics URL`, the server's load while the checks ran
   (`check_server_load`, informational): busy with other traffic, or not.

Checks that need an earlier one are skipped with the reason when it failed, so
a broken channel gets at most a handful of cheap requests. An `ok` means a
request succeeded (or the model list names the model); a failure that proves
nothing either way (a 5xx, a 429, a timeout) is `unverified`, said with the
status and the message, and with who can fix it when the channel is a relay
whose backend is down. All network access goes through `Doctor`, which caches
the two real requests (a one-token request for auth and model, the latency
probe reused by the streaming, fidelity and rate-limit checks). Every string a
result carries is redacted against every key doctor has seen.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from tokenload import errors as ek
from tokenload.channel import (
    KNOWN_ENV_VARS,
    SECRET_FIELDS,
    SETTINGS_CANDIDATES,
    Channel,
    ChannelFlags,
    Resolution,
    endpoint_url,
    family,
    fingerprint,
    redact_secrets,
    resolve,
)
from tokenload.errors import ConfigError, error_class
from tokenload.failures import (
    body_message,
    classify_exception,
    classify_http,
    context_limit,
    fix_for,
    looks_like_html,
    upstream_failure,
)
from tokenload.measure import NATURAL_STOPS, Timeline
from tokenload.modelsize import size_from_id as model_size
from tokenload.protocols import ADAPTERS, ProtocolAdapter
from tokenload.protocols.base import Conversation
from tokenload.protocolspec import ENV_VARS, PROTOCOLS, SPECS
from tokenload.record import RequestRecord
from tokenload.tokens import synth_prompt
from tokenload.transport.httpx_client import stream_exchange

OK, FAIL, SKIP = "ok", "fail", "skip"
# The channel answered, but not in a way that proves or disproves the check (a 500, a timeout, a 429).
UNVERIFIED = "unverified"

# Real variables of neighbouring tools (Claude Code, the OpenAI SDK) that look
# like tokenload's but are not misspellings of them.
OTHER_TOOLS_VARS: frozenset[str] = frozenset({
    "ANTHROPIC_BEDROCK_BASE_URL", "ANTHROPIC_VERTEX_BASE_URL", "ANTHROPIC_VERTEX_PROJECT_ID",
    "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_SMALL_FAST_MODEL_AWS_REGION", "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_BETAS", "ANTHROPIC_LOG",
    "OPENAI_ORG_ID", "OPENAI_PROJECT_ID", "OPENAI_ORGANIZATION", "OPENAI_API_VERSION", "OPENAI_API_TYPE",
    "OPENAI_LOG",
})
# Names users carry over from older tools; similarity alone would guess wrong.
ALIASES: dict[str, str] = {"OPENAI_API_BASE": "OPENAI_BASE_URL", "ANTHROPIC_API_URL": "ANTHROPIC_BASE_URL"}
NAME_SIMILARITY = 0.8
# A served model id this alike (difflib ratio, case ignored) is offered as "the closest match"; below, none is.
MODEL_SIMILARITY = 0.6
FIELD_OF: dict[str, str] = {var: name for names in ENV_VARS.values() for name, var in names.items()}

_PLACEHOLDER = re.compile(
    r"^(<.*>|\[.*\]|\{.*\}|\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|(sk-(ant-)?)?(x{3,}|\.{3,}|\*{3,})|"
    r"(your|my)[-_ ]?(api[-_ ]?|auth[-_ ]?|anthropic[-_ ]?|openai[-_ ]?)?(key|token|secret).*|"
    r".*(changeme|change[-_]me|placeholder|replace[-_]?me|insert[-_ ].*key|paste[-_ ].*key).*|"
    r"(none|null|undefined|todo|tbd|test|dummy|api[-_]?key|token|key|secret))$",
    re.IGNORECASE,
)
# Errors that mean the stream itself broke: the streaming check reports them, not latency.
STREAM_KINDS = frozenset({ek.DISCONNECTED, ek.MALFORMED_STREAM, ek.TIMEOUT_STALL})
_SHORT_PROMPT = "Say hi."
# Without usage fields: a repeat TTFT at most this fraction of the first counts as a cache hit.
CACHE_TTFT_GAIN = 0.7
# ...and by at least this much (s): between two millisecond answers the difference is noise.
CACHE_TTFT_MIN_GAIN_S = 0.05
# A failed request's message is shown up to this length (relays pass on whole tracebacks).
MESSAGE_CHARS = 300
# Headers held until the first token: judged only when TTFT is long enough to tell (s), and counted when
# the headers came within this share of TTFT before the first token.
HEADER_HOLD_MIN_TTFT_S = 0.1
HEADER_HOLD_SHARE = 0.1
# The latency line names cached prompt tokens from this share of the prompt on.
CACHE_NOTE_SHARE = 0.05
# With usage fields: the repeat must read at least this share of its input from the cache to count as a hit.
CACHE_HIT_SHARE = 0.5
# A prefix refused as too long is resent at this share of the context limit the refusal named (room for the
# chat template, the question and the server's own tokenizer counting differently from the estimate).
CACHE_PREFIX_SHARE_OF_CONTEXT = 0.75
_PROBE_PREFIX = "Count from 1 to 100, one number per word. Ignore the filler text that follows."


@dataclass(frozen=True)
class Limits:
    """Thresholds and budgets; every one is a command-line flag."""

    # The SLO's thresholds the user gave (`--slo-*`); None: not judged, the numbers are reported.
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None  # total for an answer of `expected_output_tokens`
    expected_output_tokens: int = 256
    burst_s: float = 0.010  # every token inside this window = one buffered burst
    timeout_s: float = 20.0  # connect, first token and stall timeout of every request
    prompt_tokens: int = 1000  # the latency probe's prompt; the comparison probe is a few tokens
    probe_tokens: int = 32  # output tokens the latency probe asks for
    cache_prefix_tokens: int = 4500  # the caching check's prefix: above every provider's minimum (up to 4,096)
    relay_probe_timeout_s: float = 5.0  # for /v1/models and /health, which a live relay answers at once


@dataclass
class CheckResult:
    """One line of the report: ok / fail / unverified / skip, what was seen, the exact fix.

    `ok` only for what a successful request (or the channel's own model list)
    proved; `unverified` when the channel answered in a way that proves nothing
    either way (a 5xx, a timeout, a 429). `informational` results (rate limits,
    prompt caching, channel fidelity) describe the channel rather than a mistake
    the user can fix, so they change the exit code only under `--strict`.
    """

    name: str
    title: str
    status: str
    saw: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    blocking: bool = True  # a fail that leaves nothing sound to check after it
    informational: bool = False

    @property
    def blocks(self) -> bool:
        return self.status != OK and self.blocking

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "status": self.status, "saw": self.saw,
                "fix": self.fix, "details": self.details, "informational": self.informational}


def exit_code(results: list[CheckResult], strict: bool = False) -> int:
    """1 when the channel cannot serve: a check the user can fix failed, or a request failed for good (a relay
    whose backend is down or hung, a 5xx, no answer; not a rate limit or an overload, which pass); with `strict`,
    also for any finding or check not proved."""
    if any(r.status == FAIL and not r.informational for r in results):
        return 1
    if any(r.status == UNVERIFIED and r.details.get("cannot_serve") and not r.informational for r in results):
        return 1
    if strict and any(r.status in (FAIL, UNVERIFIED) for r in results):
        return 1
    return 0


@dataclass
class Doctor:
    """What the checks share: the resolution, the environment, limits, and cached requests."""

    resolution: Resolution
    env: Mapping[str, str]
    cwd: Path
    home: Path
    limits: Limits = field(default_factory=Limits)
    channel: Channel = field(init=False)
    _tiny: tuple[RequestRecord, Timeline] | None = None
    _probe: tuple[RequestRecord, Timeline] | None = None
    _models: list[str] | None = None
    _models_status: int | None = None
    _models_fetched: bool = False
    _relay_route: str | None = None
    _relay_asked: bool = False
    served_models: list[str] = field(default_factory=list)  # the model ids the latency probe's answer named

    def __post_init__(self) -> None:
        # doctor waits `timeout_s` at most, not a load test's minutes, for anything
        t = self.limits.timeout_s
        self.channel = replace(self.resolution.channel, connect_timeout_s=min(t, 10.0), first_token_timeout_s=t,
                               idle_timeout_s=t)

    def where(self, name: str) -> str:
        """How the user changes a field, in the terms of the source that set it."""
        source = self.resolution.sources.get(name, "default")
        var = ENV_VARS[family(self.channel.protocol)].get(name, "")
        in_settings = re.fullmatch(r"settings (.+) \((\w+)\)", source)
        if source.startswith("flag"):  # the flag the source names (plain Locust's base URL is `--host`)
            return source.split(" ", 1)[1] if " " in source else f"--{name.replace('_', '-')}"
        if in_settings:
            return f"{in_settings.group(2)} in {in_settings.group(1)}"
        return var or f"--{name.replace('_', '-')}"

    def client(self, timeout_s: float | None = None) -> httpx.Client:
        t = timeout_s or self.limits.timeout_s
        return httpx.Client(timeout=httpx.Timeout(t, connect=min(t, 10.0)), follow_redirects=False)

    def tiny_exchange(self) -> tuple[RequestRecord, Timeline]:
        """A one-token streaming request: the cheapest request that proves key and model."""
        if self._tiny is None:
            self._tiny = stream_exchange(self.channel, "Reply with OK.", 1)
        return self._tiny

    def tiny(self) -> RequestRecord:
        return self.tiny_exchange()[0]

    def probe(self) -> tuple[RequestRecord, Timeline]:
        """The latency probe, shared with the streaming, rate-limit and fidelity checks."""
        if self._probe is None:
            prompt = synth_prompt(self.limits.prompt_tokens, prefix=f"{fresh_nonce()} {_PROBE_PREFIX}")
            adapter, self.served_models = model_watcher(self.channel)
            self._probe = stream_exchange(self.channel, prompt, self.limits.probe_tokens, adapter=adapter)
        return self._probe

    def last_exchange(self) -> tuple[RequestRecord, Timeline]:
        """The newest of the shared requests: the latency probe once sent, else the one-token request."""
        return self._probe if self._probe is not None else self.tiny_exchange()

    def models(self) -> list[str] | None:
        """The channel's model ids from `/v1/models`, or None when it offers no list."""
        if not self._models_fetched:
            self._models_fetched = True
            url = models_url(self.channel)
            try:
                with self.client(self.limits.relay_probe_timeout_s) as http:
                    response = http.get(url, headers=self.channel.headers())
                self._models_status = response.status_code
                data = response.json().get("data") if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                data = None
            if isinstance(data, list):
                self._models = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        return self._models

    def relay_answers(self) -> str | None:
        """Which of the channel's other routes answered at once (`GET .../v1/models answered HTTP 200`), or None.

        A relay whose backend hangs still answers its own routes: the model list
        and the health check are served by the relay itself, without the backend.
        """
        if not self._relay_asked:
            self._relay_asked = True
            self.models()
            if self._models_status is not None:
                self._relay_route = f"GET {models_url(self.channel)} answered HTTP {self._models_status}"
            else:
                parts = urlsplit(self.channel.base_url)
                health = urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))
                try:
                    with self.client(self.limits.relay_probe_timeout_s) as http:
                        status = http.get(health, headers=self.channel.headers()).status_code
                    self._relay_route = f"GET {health} answered HTTP {status}"
                except httpx.HTTPError:
                    self._relay_route = None
        return self._relay_route

    def redact(self, text: str) -> str:
        return redact(text, [self.resolution.raw.get(name, "") for name in SECRET_FIELDS], self.env)


# --- helpers ---------------------------------------------------------------------------


def redact(text: str, secrets: list[str], env: Mapping[str, str]) -> str:
    """`text` with the given secrets, every key-like variable's value (misspelt ones too) and key shapes masked."""
    keylike = [v for k, v in env.items() if re.search(r"KEY|TOKEN|SECRET", k, re.I)]
    return redact_secrets(text, secrets + keylike)


def fresh_nonce() -> str:
    """A random first line for a latency prompt: servers cache prompt prefixes, and a
    cached prefix answers in a fraction of the real TTFT (13 s read as 0.1 s on a rerun)."""
    return f"Request {uuid.uuid4().hex[:12]}."


def models_url(channel: Channel) -> str:
    """`GET` URL of the channel's model list: beside its endpoint, under the API root (`/v1`)."""
    return SPECS[channel.protocol].models_url(channel.base_url)


def _models_path(ctx: Doctor) -> str:
    spec = SPECS[ctx.channel.protocol]
    return spec.root + spec.models_path


def is_local(url: str) -> bool:
    """Loopback or private address: plain http and no key are normal there."""
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private


def misspellings(names: list[str]) -> dict[str, str]:
    """Unknown variable names that are near-misses of the ones tokenload reads -> the real name."""
    found: dict[str, str] = {}
    known = sorted(KNOWN_ENV_VARS)
    for name in names:
        upper = name.upper()
        if name in KNOWN_ENV_VARS or name in OTHER_TOOLS_VARS or any(k in upper and k != upper for k in known):
            continue  # a real name, or a deliberate variant of one (MY_ANTHROPIC_API_KEY, OPENAI_API_KEY_OLD)
        if upper in ALIASES:
            found[name] = ALIASES[upper]
        elif upper in KNOWN_ENV_VARS:
            found[name] = upper
        else:
            close = difflib.get_close_matches(upper, known, n=1, cutoff=NAME_SIMILARITY)
            if close:
                found[name] = close[0]
    return found


def is_placeholder(key: str) -> bool:
    return bool(_PLACEHOLDER.match(key.strip()))


def base_variants(base_url: str) -> list[str]:
    """The bases users most often meant: an API root (`/v1`) removed, `/api` added, trailing path parts dropped."""
    parts = urlsplit(base_url)
    segments = [s for s in parts.path.split("/") if s]
    prefixes = [segments[:i] for i in range(len(segments), -1, -1)]
    roots = {spec.root.strip("/") for spec in SPECS.values()}
    paths: list[str] = []
    for prefix in prefixes:
        trimmed = prefix[:-1] if prefix and prefix[-1] in roots else prefix
        for candidate in (trimmed, trimmed + ["api"] if "api" not in trimmed else trimmed):
            path = "/" + "/".join(candidate) if candidate else ""
            if path not in paths:
                paths.append(path)
    original = "/" + "/".join(segments) if segments else ""
    return [urlunsplit((parts.scheme, parts.netloc, p, "", "")) for p in paths if p != original]


def answer_kind(response: httpx.Response) -> str:
    """`api`, `html`, `gateway`, `redirect` or `not_found`: how a cheap request to an endpoint was answered."""
    if 300 <= response.status_code < 400:
        return "redirect"
    if looks_like_html(response.headers.get("content-type", ""), response.content):
        return "gateway" if response.status_code >= 500 else "html"  # a proxy's error page: the API behind it is down
    if response.status_code in (404, 405):
        kind, _ = classify_http(response.status_code, response.headers.get("content-type", ""), response.content)
        return "api" if kind == ek.NOT_FOUND_MODEL else "not_found"
    return "api"


def knock(ctx: Doctor, http: httpx.Client, base_url: str, protocol: str | None = None) -> httpx.Response:
    """A cheap request at a base: POST an empty JSON body to its endpoint (an API answers 4xx JSON); `protocol`:
    another protocol's endpoint than the channel's."""
    channel = ctx.channel
    return http.post(endpoint_url(base_url, protocol or channel.protocol, channel.model), headers=channel.headers(),
                     content=b"{}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def refusal_wait(headers: Mapping[str, str] | None, now: float) -> tuple[float, str] | None:
    """(seconds, the header that said so) a 429 asked us to wait, or None when it said nothing.

    Relays each have their dialect: `retry-after-ms` and `retry-after` (HTTP),
    LiteLLM's `llm_provider-retry-after` (seconds, passed on from its router),
    then the reset time of a used-up Anthropic or OpenAI limit.
    """
    from tokenload.limits import parse_rate_headers

    headers = headers or {}
    for name in ("retry-after-ms", "retry-after", "llm_provider-retry-after"):
        if name in headers:
            # LiteLLM's header carries the same seconds as retry-after
            wait = parse_rate_headers({name if name != "llm_provider-retry-after" else "retry-after": headers[name]},
                                      now).retry_after_s
            if wait is not None:
                return wait, name
    info = parse_rate_headers(dict(headers), now)
    resets = [r for r in (info.requests_reset_s, info.tokens_reset_s) if r is not None]
    # a refused request used up one of the limits whose reset is given, whatever `remaining` said
    wait = info.server_wait() if info.server_wait() is not None else max(resets, default=None)
    if wait is None:
        return None
    dialect = "anthropic-ratelimit-*-reset" if any(k.startswith("anthropic-ratelimit-") for k in headers) \
        else "x-ratelimit-reset-*"
    return wait, dialect


def model_watcher(channel: Channel) -> tuple[ProtocolAdapter, list[str]]:
    """The channel's protocol adapter, noting each model id its stream names (message_start's message, a chat
    chunk, the Responses `response`), in a list returned alongside."""
    seen: list[str] = []
    base: type[ProtocolAdapter] = ADAPTERS[channel.protocol]

    class Watching(base):  # type: ignore[misc, valid-type]
        def on_json(self, event: str, obj: dict[str, Any], t: float, tl: Timeline) -> None:
            for holder in (obj, obj.get("message"), obj.get("response")):
                model = holder.get("model") if isinstance(holder, dict) else None
                if isinstance(model, str) and model and model not in seen:
                    seen.append(model)
            super().on_json(event, obj, t, tl)

    return Watching(channel), seen


def accepted(record: RequestRecord) -> bool:
    """Did the channel accept this request (key and model)? It succeeded, or a token arrived, or it answered
    HTTP 200 and only the stream's form broke (no final event, a JSON body instead of events)."""
    if record["status"] == "ok" or record["ttft_s"] is not None:
        return True
    return (record["http_status"] == 200 and record["error_kind"] in (ek.MALFORMED_STREAM, ek.DISCONNECTED)
            and not upstream_failure(200, record["error_message"] or ""))


def _said(record: RequestRecord) -> str:
    """`HTTP 500: message`, or the message alone when no HTTP answer came (refused, timed out); a relay's
    multi-line message on one line, cut at `MESSAGE_CHARS`."""
    message = " ".join((record["error_message"] or record["error_kind"] or "no answer").split())
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS - 1] + "…"
    status = record["http_status"]
    if status is None:
        return message
    where = "an error inside the stream after HTTP 200" if status == 200 else f"HTTP {status}"
    return f"{where}: {message}"


BACKEND_FIX = ("only the relay's operator can fix this: the model server behind the relay is down, hung or unreachable "
               "from it; tell them, and retry once it is back (your key, URL and model are not the problem)")


def failure_story(ctx: Doctor, record: RequestRecord, timeline: Timeline | None = None) -> tuple[str, str | None]:
    """(what a failed request proves, who can fix it) for a check it could not prove either way.

    A 5xx or an in-stream error naming a failed upstream connection, or a hang
    while the relay's own routes answer, is the relay's backend: its operator's
    to fix. A 429 is the rate limit, with the wait the channel asked for.
    """
    kind, status = record["error_kind"], record["http_status"]
    said = _said(record)
    if upstream_failure(status, record["error_message"] or ""):
        return f"the relay answers but its backend does not ({said})", BACKEND_FIX
    if kind == ek.TIMEOUT_FIRST_TOKEN and status is None:
        route = ctx.relay_answers()
        if route is not None:
            return (f"the relay answers but its backend does not: no response within {ctx.limits.timeout_s:g} s, "
                    f"while {route}"), BACKEND_FIX
        host = urlsplit(ctx.channel.base_url).netloc
        return (f"{host} accepted the request but sent no response within {ctx.limits.timeout_s:g} s",
                "check that the channel is up (and whatever is behind it), or raise --timeout")
    if kind == ek.RATE_LIMITED:
        wait = refusal_wait(timeline.response_headers if timeline else None, time.time())
        when = f"it asks to retry in {wait[0]:.0f} s ({wait[1]})" if wait else "it did not say when to retry"
        return (f"the channel's rate limit is used up, {when} ({said})",
                f"wait {wait[0]:.0f} s, then run doctor again" if wait else "wait a minute, then run doctor again")
    if kind == ek.TIMEOUT_FIRST_TOKEN:
        return said, ("the channel (or the backend behind a relay) opened the answer but sent no token: it is stuck or "
                      "queueing; retry later, or raise --timeout")
    if not ctx.channel.secrets and status is not None and status >= 400:
        names = ENV_VARS[family(ctx.channel.protocol)]
        wanted = " or ".join(names[n] for n in SECRET_FIELDS if n in names)
        return f"{said} (no key was sent)", f"if this channel needs a key, set {wanted}; otherwise ask its operator"
    if status is not None and 400 <= status < 500:
        return said, ("read the channel's message above; a relay can refuse a wrong key this way (LiteLLM without its "
                      "database answers HTTP 400 no_db_connection), so check the key too")
    return said, fix_for(kind, record["error_message"])


def unverified(ctx: Doctor, name: str, title: str, exchange: tuple[RequestRecord, Timeline], *,
               blocking: bool = True) -> CheckResult:
    """The "could not verify" line for a check whose request failed in a way that proves nothing."""
    record, timeline = exchange
    story, fix = failure_story(ctx, record, timeline)
    details = {"http_status": record["http_status"], "error_kind": record["error_kind"],
               "relay_backend_down": story.startswith("the relay answers but its backend does not"),
               # a push-back says the channel is busy now, not that it cannot serve
               "cannot_serve": record["error_kind"] not in (ek.RATE_LIMITED, ek.OVERLOADED)}
    return CheckResult(name, title, UNVERIFIED, f"could not verify: {story}", fix, details, blocking=blocking)


# --- the checks ------------------------------------------------------------------------


def check_config(ctx: Doctor) -> CheckResult:
    """Where each field came from; misspelt, shadowed or absent configuration (mistake #7)."""
    res = ctx.resolution
    sources = {name: res.sources[name] for name in res.FIELD_LABELS if name in res.sources}
    saw = res.describe()
    details: dict[str, Any] = {"sources": sources, "settings_files": [str(p) for p in res.settings_files]}
    problems: list[str] = []
    fixes: list[str] = []
    blocking = False

    entries = {path: _settings_entries(path) for path in res.settings_files}
    typos = {f"environment {n}": (real, real) for n, real in misspellings(sorted(ctx.env)).items()}
    for path, found in entries.items():
        for var, real in misspellings(list(found)).items():
            written = found[var][0]
            section = written.partition(".")[0]
            typos[f"{path} {written}"] = (real if section == "env" else f"{section}.{FIELD_OF[real]}", real)
    own = {var: name for name, var in ENV_VARS[family(res.channel.protocol)].items()}
    for where, (suggestion, real) in typos.items():
        problems.append(f"{where} is not read by tokenload (did you mean {suggestion}?)")
        fixes.append(f"rename it to {suggestion}")
        if real in own and res.sources.get(own[real], "default") == "default":
            blocking = True  # the field it was meant to set is unset or fell back to its default
    details["misspelt"] = {where: suggestion for where, (suggestion, _) in typos.items()}

    shadowed = []
    for path, found in entries.items():
        for var, (written, value) in found.items():
            if var in KNOWN_ENV_VARS and var in ctx.env and value is not None and value.strip() != ctx.env[var].strip():
                shadowed.append(var)
                problems.append(f"{written} in {path} is shadowed by a different value of {var} in the environment")
                fixes.append(f"unset {var} in the shell (or make both agree) so the settings file takes effect")
    details["shadowed"] = shadowed

    for warning in res.warnings:
        if not any(warning.startswith(res.FIELD_LABELS[n].lower()) for n in SECRET_FIELDS):  # keys: key hygiene's job
            problems.append(warning)

    near = _near_miss_settings(ctx) if not res.settings_files else []
    if not any(s != "default" for n, s in res.sources.items() if n != "protocol"):
        blocking = True
        problems.insert(0, "nothing is configured: every field is a default")
        hint = f" (found {', '.join(map(str, near))}: rename it to settings.json?)" if near else ""
        fixes.insert(0, "export ANTHROPIC_BASE_URL and ANTHROPIC_AUTH_TOKEN (a variable set without `export` is "
                        "not seen), or put them under \"env\" in .claude/settings.json, or pass --base-url and "
                        f"--auth-token{hint}")
    if problems:
        return CheckResult("config", "configuration", FAIL, "; ".join(problems) + f" [{saw}]",
                           "; ".join(fixes) or "fix the values where they are set", details, blocking=blocking)
    return CheckResult("config", "configuration", OK, saw, details=details)


def _settings_entries(path: Path) -> dict[str, tuple[str, str | None]]:
    """Every variable a settings file sets, as {variable-like name: (as written, value)}.

    Claude Code's `env` block holds variable names; tokenload's section form
    (`{"anthropic": {"base_url": ...}}`) is mapped to the variable each key stands
    for, so one similarity test covers both spellings.
    """
    data = json.loads(path.read_text(encoding="utf-8"))  # resolve() already proved it parses
    found: dict[str, tuple[str, str | None]] = {}
    env_block = data.get("env")
    if isinstance(env_block, dict):
        for key, value in env_block.items():
            found[key] = (f"env.{key}", value if isinstance(value, str) else None)
    for section, fields in ENV_VARS.items():
        block = data.get(section)
        if isinstance(block, dict):
            for key, value in block.items():
                var = fields.get(key) or f"{section.upper()}_{key.upper().replace('-', '_')}"
                found[var] = (f"{section}.{key}", value if isinstance(value, str) else None)
    return found


def _near_miss_settings(ctx: Doctor) -> list[Path]:
    """Files next to where settings are looked for whose names are close to the expected ones."""
    found = []
    for candidate in SETTINGS_CANDIDATES:
        expected = ctx.home / candidate[2:] if candidate.startswith("~/") else ctx.cwd / candidate
        folder = expected.parent
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.name != expected.name and difflib.SequenceMatcher(None, path.name, expected.name).ratio() > 0.8:
                if path not in found:
                    found.append(path)
    return found


def check_key(ctx: Doctor) -> CheckResult:
    """Whitespace, placeholders, two different keys, or none at all (offline half of mistake #1)."""
    channel, res = ctx.channel, ctx.resolution
    problems: list[str] = []
    fixes: list[str] = []
    shown: list[str] = []
    for name in SECRET_FIELDS:
        raw = res.raw.get(name)
        if raw is None:
            continue
        label = "API key" if name == "api_key" else "auth token"
        shown.append(f"{label} {fingerprint(raw)} from {res.sources[name]}")
        if raw != raw.strip() or any(c.isspace() for c in raw.strip()):
            what = "a newline" if ("\n" in raw or "\r" in raw) else "whitespace"
            problems.append(f"the {label} from {res.sources[name]} contains {what}")
            fixes.append(f"remove the {what.removeprefix('a ')} from {ctx.where(name)} (tokenload strips it; your app may not)")
        if raw.strip() and is_placeholder(raw):
            problems.append(f"the {label} from {res.sources[name]} is a placeholder, not a key")
            fixes.append(f"put the key you created into {ctx.where(name)}")
    spec = SPECS[channel.protocol]
    if spec.key_header and channel.api_key and channel.auth_token and channel.api_key != channel.auth_token:
        names = ENV_VARS[spec.family]
        problems.append(f"{names['api_key']} and {names['auth_token']} are both set, to different values; both are sent")
        fixes.append(f"keep one: {names['auth_token']} (Bearer) for relays, {names['api_key']} ({spec.key_header}) for "
                     f"{urlsplit(spec.default_base_url).hostname}")
    if not channel.secrets and not is_local(channel.base_url):
        names = ENV_VARS[family(channel.protocol)]
        wanted = " or ".join(names[n] for n in SECRET_FIELDS if n in names)
        problems.append(f"no key is configured for {urlsplit(channel.base_url).netloc}")
        fixes.append(f"set {wanted} (exported) or pass --auth-token / --api-key")
    saw = "; ".join(shown) or "no key (a local channel needs none)"
    details = {"keys": shown}
    if problems:
        return CheckResult("key", "key hygiene", FAIL, "; ".join(problems), "; ".join(fixes), details)
    return CheckResult("key", "key hygiene", OK, saw, details=details)


def check_base_url(ctx: Doctor) -> CheckResult:
    """Reachable, answers like an API (not HTML, not 404), no redirect, https off the local network (mistake #2)."""
    channel = ctx.channel
    url = channel.url
    details: dict[str, Any] = {"url": url}

    def fail(saw: str, fix: str) -> CheckResult:
        return CheckResult("base_url", "base URL", FAIL, saw, fix, details)

    with ctx.client() as http:
        try:
            response = knock(ctx, http, channel.base_url)
        except httpx.HTTPError as exc:
            saw = classify_exception(exc, url, timeout_s=ctx.limits.timeout_s)[1]
            fix = (f"use {urlunsplit(('http',) + urlsplit(channel.base_url)[1:])} in {ctx.where('base_url')}"
                   if "plain http" in saw else f"check the host and port in {ctx.where('base_url')} and that the channel is up")
            return fail(saw, fix)
        kind = answer_kind(response)
        details.update(status=response.status_code, answer=kind)
        if kind == "redirect":
            location = urljoin(url, response.headers.get("location", ""))
            details["location"] = location
            suffix = url[len(channel.base_url.rstrip("/")):]  # the API path the client appended
            suggested = location[: -len(suffix)] if location.endswith(suffix) else location
            return fail(f"POST {url} is redirected (HTTP {response.status_code}) to {location}; clients do not follow it",
                        f"set {ctx.where('base_url')} to {suggested}")
        if kind == "gateway":
            page = body_message(response.content, response.headers.get("content-type", ""))
            return fail(f"POST {url} answered HTTP {response.status_code} with a proxy's error page ({page}): "
                        "the channel behind it is down or unreachable",
                        "retry later, or tell the channel's operator; the base URL itself reached a server")
        if kind != "api":
            message = body_message(response.content, response.headers.get("content-type", ""))
            what = f"an HTML page ({message.removeprefix('HTML page: ')!r})" if kind == "html" else repr(message)
            saw = f"POST {url} answered HTTP {response.status_code} with {what}, not an API response"
            answered = next((b for b in base_variants(channel.base_url) if _answers(ctx, http, b)), None)
            if answered and SPECS[channel.protocol].root_in_base:
                answered += SPECS[channel.protocol].root  # the form OpenAI SDKs expect in OPENAI_BASE_URL
            details["suggested_base_url"] = answered
            if answered:
                return fail(f"{saw}; {answered} answers like an API", f"set {ctx.where('base_url')} to {answered}")
            speaks = _other_protocol(ctx, http)
            if speaks is not None:
                protocol, base = speaks
                details.update(speaks=protocol, suggested_base_url=base)
                at = "" if base == channel.base_url else f" at {base}"
                return fail(f"{saw}; POST {endpoint_url(base, protocol, channel.model)} answers like an API: this "
                            "endpoint speaks "
                            f"{protocol}{at}, not {channel.protocol}",
                            f"this endpoint speaks {protocol}: use --protocol {protocol}"
                            + (f" with --base-url {base}" if at else ""))
            return fail(saw + "; no common variant (/api added, /v1 removed, path dropped) answers like an API",
                        ek.FIXES[ek.BAD_BASE_URL] + "; copy the API base URL from the channel's documentation")
    if urlsplit(url).scheme == "http" and not is_local(url):
        return fail(f"{url} is plain http on a public host: the key travels unencrypted",
                    f"use https:// in {ctx.where('base_url')}")
    return CheckResult("base_url", "base URL", OK,
                       f"POST {url} answered like an API (HTTP {response.status_code})", details=details)


def _answers(ctx: Doctor, http: httpx.Client, base: str, protocol: str | None = None) -> bool:
    try:
        return answer_kind(knock(ctx, http, base, protocol)) == "api"
    except httpx.HTTPError:
        return False


def _other_protocol(ctx: Doctor, http: httpx.Client) -> tuple[str, str] | None:
    """(protocol, base URL) of another protocol whose endpoint answers like an API at the base or a variant of it:
    a wrong --protocol (Responses asked of an Anthropic-only relay) looks like a wrong path otherwise."""
    base = ctx.channel.base_url
    for candidate in (base, *base_variants(base)):
        for protocol in PROTOCOLS:
            if protocol != ctx.channel.protocol and _answers(ctx, http, candidate, protocol):
                return protocol, candidate
    return None


def check_auth(ctx: Doctor) -> CheckResult:
    """A one-token request: ok only when it succeeded; 401/403 with the server's message and the fix (mistake #1).

    Any other failure proves nothing about the key (a relay may check the model
    first, or answer a wrong key with a 400 or a 500), so it is "could not
    verify", with the status and the message; it does not stop the model check,
    which reads the same answer.
    """
    record, timeline = ctx.tiny_exchange()
    channel = ctx.channel
    status = record["http_status"]
    if accepted(record):
        sent = _sent_as(ctx) or "no key"
        how = "a one-token request succeeded" if record["status"] == "ok" else \
            f"HTTP {status}, though the stream broke: see streaming"
        return CheckResult("auth", "auth", OK, f"the channel accepted {sent} ({how})", details={"http_status": status})
    if record["error_kind"] == ek.NOT_FOUND_MODEL:
        return CheckResult("auth", "auth", UNVERIFIED,
                           f"could not verify: the channel refused the model before the key was proved ({_said(record)})",
                           "fix the model first (see the model check), then run doctor again",
                           {"http_status": status}, blocking=False)
    if record["error_kind"] != ek.AUTH:
        return unverified(ctx, "auth", "auth", (record, timeline), blocking=False)
    saw = f"HTTP {status}: {record['error_message']}"
    if not channel.secrets:
        names = ENV_VARS[family(channel.protocol)]
        saw += " (no key was given)"
        fix = f"this channel needs a key: set {' or '.join(names[n] for n in SECRET_FIELDS if n in names)}"
    elif status == 403:
        fix = "the key is valid but not allowed here: check its permissions, group or quota with the channel's operator"
    else:
        fix = f"{ek.FIXES[ek.AUTH]} (sent {_sent_as(ctx)})"
        spec = SPECS[channel.protocol]
        if spec.key_header and not (channel.api_key and channel.auth_token):
            names = ENV_VARS[spec.family]
            other = f"{names['auth_token']} (Bearer)" if channel.api_key else f"{names['api_key']} ({spec.key_header})"
            fix += f"; if the channel expects the other header, set {other} instead"
    return CheckResult("auth", "auth", FAIL, saw, fix, {"http_status": status})


def _sent_as(ctx: Doctor) -> str:
    channel = ctx.channel
    key_header = SPECS[channel.protocol].key_header
    headers = channel.auth_headers()
    parts = []
    if key_header in headers and channel.api_key:
        parts.append(f"{key_header} {fingerprint(channel.api_key)}")
    if "authorization" in headers:
        token = channel.auth_token if key_header else (channel.api_key or channel.auth_token)
        parts.append(f"Bearer {fingerprint(token or '')}")
    return " and ".join(parts)


def check_model(ctx: Doctor) -> CheckResult:
    """Served only when a request with it succeeded or the model list names it; unknown -> the list and a
    close match (mistake #3)."""
    record, timeline = ctx.tiny_exchange()
    model = ctx.channel.model
    if accepted(record):
        how = "a one-token request succeeded" if record["status"] == "ok" else \
            f"HTTP {record['http_status']}, though the stream broke: see streaming"
        return CheckResult("model", "model", OK, f"{model} is served by this channel ({how})")
    if record["error_kind"] != ek.NOT_FOUND_MODEL:
        models = ctx.models()
        if models and model in models:
            return CheckResult("model", "model", OK,
                               f"{model} is in the channel's model list, though the one-token request failed "
                               f"({_said(record)})", details={"models": models})
        return unverified(ctx, "model", "model", (record, timeline))
    models = ctx.models()
    saw = f"{model} is not served: HTTP {record['http_status']}: {record['error_message']}"
    details: dict[str, Any] = {"models": models}
    if not models:
        return CheckResult("model", "model", FAIL, saw + f"; the channel offers no model list at {_models_path(ctx)}",
                           f"ask the channel's operator for the exact model id and set it in {ctx.where('model')}", details)
    close = closest_model(model, models)
    details["closest"] = close
    if close is None:
        return CheckResult("model", "model", FAIL, f"{saw}; the channel serves {', '.join(models)}",
                           f"set {ctx.where('model')} to one of the models this channel serves: {', '.join(models)} "
                           "(none is close to the one given)", details)
    return CheckResult("model", "model", FAIL, f"{saw}; the channel serves {', '.join(models)}",
                       f"set {ctx.where('model')} to {close} (the closest match)", details)


def closest_model(model: str, models: list[str]) -> str | None:
    """The served id most like `model` (case ignored), or None when none is alike enough to suggest."""
    by_lower = {m.lower(): m for m in models}
    close = difflib.get_close_matches(model.lower(), list(by_lower), n=1, cutoff=MODEL_SIMILARITY)
    return by_lower[close[0]] if close else None


def check_latency(ctx: Doctor) -> CheckResult:
    """TTFT, TPOT and the projected total against the limits; a short prompt to tell prompt from load (mistakes #4-6)."""
    lim = ctx.limits
    record, _ = ctx.probe()
    ttft, tpot, n = record["ttft_s"], record["tpot_s"], record["output_tokens"]
    cached = record["cache_read_input_tokens"]
    details: dict[str, Any] = {"ttft_s": ttft, "tpot_s": tpot, "output_tokens": n, "input_tokens": record["input_tokens"],
                               "cached_tokens": cached}
    if ttft is None:
        kind = record["error_kind"] or ek.MALFORMED_STREAM
        saw = f"the probe got no token: {kind} ({_said(record)})"
        if kind in STREAM_KINDS and not upstream_failure(record["http_status"], record["error_message"] or ""):
            return CheckResult("latency", "latency", SKIP, saw + "; see the streaming check", details=details)
        if error_class(kind) in ("config", "input"):
            return CheckResult("latency", "latency", FAIL, saw, ek.FIXES[kind], details)
        return unverified(ctx, "latency", "latency", ctx.probe())
    # a token or so "cached" on every request (llama.cpp's shared first token) is no cache read worth naming
    meaningful = cached is not None and cached >= CACHE_NOTE_SHARE * (record["input_tokens"] or 0) and cached > 1
    from_cache = f" ({cached} of them from the server's prompt cache)" if meaningful else ""
    parts = [f"TTFT {_s(ttft)} with a {record['input_tokens']}-token prompt{from_cache}"]
    problems, fixes = [], []
    if lim.ttft_s is not None and ttft > lim.ttft_s:
        short = stream_exchange(ctx.channel, f"{fresh_nonce()} {_SHORT_PROMPT}", 1)[0]["ttft_s"]
        details["ttft_short_prompt_s"] = short
        parts.append(f"{_s(short)} with a short prompt")
        problems.append(f"TTFT above {lim.ttft_s:g} s")
        if short is not None and short <= lim.ttft_s and short < 0.5 * ttft:
            fixes.append("the prompt length drives TTFT here: shorten the input (or keep a stable, cacheable prefix)")
        else:
            fixes.append("a short prompt is slow too, so it is the model size or channel load: try a smaller model, "
                         "or compare at off-peak times (tokenload run at both, then tokenload compare)")
    if tpot is not None:
        parts.append(f"TPOT {tpot:.4f} s/token over {n} tokens")
        if lim.tpot_s is not None and tpot > lim.tpot_s:
            problems.append(f"TPOT above {lim.tpot_s:g} s/token")
            fixes.append("decode speed is set by model size and the channel's hardware: a smaller model"
                         f"{_smaller_models(ctx)} may meet the need")
        n_out = lim.expected_output_tokens
        total = ttft + tpot * n_out
        details["projected_e2e_s"] = total
        parts.append(f"a {n_out}-token answer takes TTFT + TPOT x {n_out} = {ttft:.3f} + {tpot:.4f} x {n_out} = "
                     f"{total:.1f} s")
        if lim.e2e_s is not None and not problems and total > lim.e2e_s:
            cap = max(1, int((lim.e2e_s - ttft) / tpot))
            held = [term for term, limit in (("TTFT", lim.ttft_s), ("TPOT", lim.tpot_s)) if limit is not None]
            normal = f" although {' and '.join(held)} {'are' if len(held) > 1 else 'is'} within the SLO" if held else ""
            problems.append(f"total above {lim.e2e_s:g} s{normal}: the output is long")
            fixes.append(f"cap max tokens at about {cap} (TTFT + TPOT x {cap} = {lim.e2e_s:g} s)")
            if lim.tpot_s is None:  # TPOT is not judged on its own: a faster model is the other way
                fixes.append(f"or a lower TPOT: a smaller model{_smaller_models(ctx)} decodes faster")
    saw = ", ".join(parts)
    if problems:
        return CheckResult("latency", "latency", FAIL, f"{'; '.join(problems)}: {saw}", "; ".join(fixes), details)
    if lim.ttft_s is None and lim.tpot_s is None and lim.e2e_s is None:
        saw += " (no SLO given, none judged: --slo-ttft, --slo-tpot, --slo-e2e judge them)"
    return CheckResult("latency", "latency", OK, saw, details=details)


def _smaller_models(ctx: Doctor) -> str:
    size = model_size(ctx.channel.model)
    models = ctx.models() or []
    smaller = [m for m in models if size is not None and (model_size(m) or size) < size]
    return f" (this channel serves {', '.join(smaller)})" if smaller else ""


def check_streaming(ctx: Doctor) -> CheckResult:
    """Tokens arrive one by one (no buffering proxy) and the stream ends with its final event."""
    lim = ctx.limits
    record, timeline = ctx.probe()
    times = timeline.chunk_times
    details: dict[str, Any] = {"chunks": len(times), "stop_reason": record["stop_reason"]}
    kind = record["error_kind"]
    if kind is not None and upstream_failure(record["http_status"], record["error_message"] or ""):
        return unverified(ctx, "streaming", "streaming", (record, timeline))
    if (kind is not None and times) or kind in STREAM_KINDS:
        saw = f"{kind} after {len(times)} token chunks: {record['error_message']}"
        return CheckResult("streaming", "streaming", FAIL, saw, ek.FIXES[kind], details)
    if kind is not None:
        return CheckResult("streaming", "streaming", SKIP, f"the probe failed before any token ({kind}); see latency",
                           details=details)
    span = times[-1] - times[0] if times else 0.0
    details["token_span_s"] = span
    ttft = record["ttft_s"] or 0.0
    if len(times) >= 4 and span <= lim.burst_s and ttft >= 5 * lim.burst_s:
        saw = (f"all {len(times)} token chunks arrived within {span * 1000:.1f} ms, {ttft:.2f} s after the request: "
               "something between you and the model buffers the stream")
        fix = ("turn off response buffering on the relay or reverse proxy (nginx: proxy_buffering off, or the "
               "X-Accel-Buffering: no header), or connect to the channel directly")
        return CheckResult("streaming", "streaming", FAIL, saw, fix, details)
    return CheckResult("streaming", "streaming", OK,
                       f"{len(times)} token chunks over {span:.2f} s, ended cleanly (stop reason {record['stop_reason']})",
                       details=details)


def check_rate_limits(ctx: Doctor) -> CheckResult:
    """The rate limits the channel announced on doctor's newest request (values only); a 429 or a limit used up
    says so, and when to retry: never ok while the channel refuses."""
    from tokenload.limits import parse_rate_headers

    record, timeline = ctx.last_exchange()
    headers = timeline.response_headers or {}
    now = time.time()
    info = parse_rate_headers(headers, now)
    details: dict[str, Any] = {k: getattr(info, k)
                               for k in ("requests_limit", "requests_remaining", "tokens_limit", "tokens_remaining")}
    parts = [f"{limit:,} {what}/min ({'?' if left is None else f'{left:,}'} left)"
             for what, limit, left in (("requests", info.requests_limit, info.requests_remaining),
                                       ("tokens", info.tokens_limit, info.tokens_remaining)) if limit is not None]
    allows = "the channel allows " + " and ".join(parts) if parts else ""
    lower = "lower the load: set [load] max_rps or max_tokens_per_min under these limits"

    def used_up(saw: str, wait: tuple[float, str] | None) -> CheckResult:
        details["retry_after_s"] = wait[0] if wait else None
        when = f"retry in {wait[0]:.0f} s ({wait[1]})" if wait else "the channel did not say when to retry"
        fix = (f"wait {wait[0]:.0f} s before sending again" if wait else "wait a minute before sending again") + \
            f"; for a load test, {lower}"
        return CheckResult("rate_limits", "rate limits", FAIL, f"the rate limit is used up: {when}; {saw}", fix,
                           details, blocking=False)

    if record["error_kind"] == ek.RATE_LIMITED or record["http_status"] == 429:
        saw = f"the channel refused with {_said(record)}"
        return used_up(saw + (f"; {allows}" if allows else ""), refusal_wait(headers, now))
    wait = info.server_wait()
    if wait is not None:
        return used_up(allows or "the channel announced no limits",
                       (wait, "retry-after" if info.retry_after_s is not None else "the limit's reset header"))
    if not parts and not accepted(record):
        return CheckResult("rate_limits", "rate limits", UNVERIFIED,
                           f"could not verify: the request failed ({_said(record)}) and announced no limits",
                           details=details, blocking=False)
    if not parts:
        return CheckResult("rate_limits", "rate limits", OK, "the channel sent no rate-limit headers", details=details,
                           blocking=False)
    return CheckResult("rate_limits", "rate limits", OK, allows, details=details, blocking=False)


def check_fidelity(ctx: Doctor) -> CheckResult:
    """Does the channel do what it says? Read from the latency probe's answer; a relay can lie in five ways.

    It ignores max_tokens (more tokens than asked), misreports the stop reason (a
    natural end at exactly max_tokens), reports usage below the token deltas it
    streamed (each delta carries at least one token; more usage than deltas is
    normal, a delta may carry several), holds the response headers until the first
    token (TTFB = TTFT: the client cannot see the network apart from the model), or
    names another model than the one asked for (a dated id that extends the one
    asked for is the same model).
    """
    record, timeline = ctx.probe()
    lim = ctx.limits
    if record["status"] != "ok":
        return CheckResult("fidelity", "channel fidelity", SKIP, "the latency probe failed (see latency)",
                           blocking=False)
    asked, streamed, counted = lim.probe_tokens, record["chunks"], record["output_tokens"]
    from_server = record["output_tokens_source"] == "server"
    got = max(streamed, counted if from_server else 0)
    stop = record["stop_reason"]
    ttfb, ttft = record["ttfb_s"], record["ttft_s"]
    served = [m for m in ctx.served_models if not _same_model(m, ctx.channel.model)]
    details: dict[str, Any] = {"max_tokens": asked, "streamed": streamed, "usage_output_tokens": counted if from_server
                               else None, "stop_reason": stop, "ttfb_s": ttfb, "ttft_s": ttft,
                               "served_models": ctx.served_models}
    found: list[str] = []
    fixes: list[str] = []
    tiny = ctx.tiny()
    tiny_got = max(tiny["chunks"], tiny["output_tokens"] if tiny["output_tokens_source"] == "server" else 0)
    details["one_token_request_got"] = tiny_got
    if got > asked or tiny_got > 1:
        said = (f"asked for {asked}, got {got} tokens" if got > asked else "") + \
            ("; " if got > asked and tiny_got > 1 else "") + (f"asked for 1, got {tiny_got}" if tiny_got > 1 else "")
        found.append(f"it ignores max_tokens: {said}")
        fixes.append("expect longer (and costlier) answers than you cap; ask the relay's operator to pass max_tokens on")
    if got == asked and stop in NATURAL_STOPS - {"completed"}:  # Responses servers say completed for both
        found.append(f"it misreports the stop reason: {stop} (a natural end) at exactly max_tokens ({asked})")
        fixes.append("do not trust the stop reason through this channel to tell a cut answer from a finished one")
    eos = counted == streamed + 1 and stop in NATURAL_STOPS  # an end-of-sequence token counted, never streamed
    if from_server and counted < streamed and not eos:
        found.append(f"its usage disagrees with the stream: {counted} output tokens reported, {streamed} token "
                     "deltas streamed")
        fixes.append("token counts (and bills) from this channel undercount; compare with the streamed deltas")
    judged_headers = held = False
    if ttfb is not None and ttft is not None and ttft >= HEADER_HOLD_MIN_TTFT_S:
        judged_headers, held = True, ttft - ttfb <= HEADER_HOLD_SHARE * ttft
    if held:
        found.append(f"it holds the response headers until the first token (TTFB {_s(ttfb)}, TTFT {_s(ttft)}): "
                     "a relay buffers the response start")
        fixes.append("time to first token, not TTFB, is what users feel here; TTFB says nothing of the network")
    if served:
        found.append(f"the answer names model {', '.join(served)}, not {ctx.channel.model} as asked")
        fixes.append("ask the channel's operator which model really serves this id")
    if found:
        return CheckResult("fidelity", "channel fidelity", FAIL, "; ".join(found), "; ".join(fixes), details,
                           blocking=False)
    usage = "usage agrees with the stream" if from_server else "no usage reported"
    headers = (f"headers before the first token (TTFB {_s(ttfb)}, TTFT {_s(ttft)})" if judged_headers
               else f"TTFT {_s(ttft)} too short to tell whether headers wait for the first token")
    return CheckResult("fidelity", "channel fidelity", OK,
                       f"max_tokens {asked} honoured ({got} tokens, stop reason {stop}), {usage}, {headers}",
                       details=details, blocking=False)


def _same_model(served: str, asked: str) -> bool:
    """`claude-sonnet-4` served as `claude-sonnet-4-20250514` (or the reverse) is the same model."""
    a, b = served.lower(), asked.lower()
    return a.startswith(b) or b.startswith(a)


def check_caching(ctx: Doctor) -> CheckResult:
    """Two identical requests with a long, never-seen prefix: does the second read it from the prompt cache?

    Coding assistants resend the same long prefix every turn; a channel that honours
    caching answers those turns sooner and cheaper. Anthropic needs `cache_control`
    breakpoints (sent here); OpenAI caches long prefixes automatically. Evidence is
    the usage fields (`cache_read_input_tokens`, `cached_tokens`): the repeat must
    read a real share of its input, not the token or so some servers report on
    every request; a channel that reports none is judged by whether the second
    TTFT fell well below the first. The prefix shrinks to fit a context limit the
    channel names when it refuses the first one; the repeat is sent only after the
    first request succeeded.
    """
    lim = ctx.limits
    seed = int.from_bytes(os.urandom(4), "big")

    def ask(tokens: int) -> tuple[RequestRecord, Timeline]:
        prefix = synth_prompt(tokens, seed=seed)
        conversation = Conversation((("user", "Reply with OK."),), system=prefix, cache_control=True)
        return stream_exchange(ctx.channel, conversation, 1)

    def skipped(saw: str, exchange: tuple[RequestRecord, Timeline] | None = None) -> CheckResult:
        story, fix = failure_story(ctx, *exchange) if exchange else ("", None)
        return CheckResult("caching", "prompt caching", UNVERIFIED, f"could not verify: {saw}{story}", fix,
                           details=details, blocking=False)

    tokens = lim.cache_prefix_tokens
    details: dict[str, Any] = {"prefix_tokens_sent": tokens}
    fitted = ""
    first_exchange = ask(tokens)
    first = first_exchange[0]
    if first["error_kind"] == ek.CONTEXT_LENGTH:
        limit = context_limit(first["error_message"] or "")
        details["context_limit"] = limit
        if limit is None:
            return skipped(f"the channel refused a {tokens:,}-token prefix as longer than its context and named no "
                           f"limit ({_said(first)}); the repeat was not sent")
        tokens = int(limit * CACHE_PREFIX_SHARE_OF_CONTEXT)
        details["prefix_tokens_sent"] = tokens
        fitted = (f" (the channel's context is {limit:,} tokens, as its refusal of a {lim.cache_prefix_tokens:,}-token "
                  f"prefix said, so the probe used {tokens:,})")
        first_exchange = ask(tokens)
        first = first_exchange[0]
    if first["status"] != "ok":
        return skipped(f"the first caching request failed and the repeat was not sent{fitted}: ", first_exchange)
    second_exchange = ask(tokens)
    second = second_exchange[0]
    details.update({"prefix_tokens": first["input_tokens"], "ttft_first_s": first["ttft_s"],
                    "ttft_second_s": second["ttft_s"], "cache_read_first": first["cache_read_input_tokens"],
                    "cache_read_second": second["cache_read_input_tokens"],
                    "cache_creation_first": first["cache_creation_input_tokens"]})
    if second["status"] != "ok":
        return skipped(f"the repeat request failed{fitted}: ", second_exchange)
    read = second["cache_read_input_tokens"]
    size = second["input_tokens"] or first["input_tokens"] or tokens
    fix = ("prompt caching is lost between you and the model: ask the relay operator to pass cache_control through "
           "(Anthropic) and to keep a conversation on one backend; until then, long prompts pay full prefill every turn")
    timing = f"TTFT {_s(second['ttft_s'])} vs {_s(first['ttft_s'])}"

    def result(status: str, saw: str) -> CheckResult:
        return CheckResult("caching", "prompt caching", status, saw + fitted, fix if status != OK else None, details,
                           blocking=False)

    ttft1, ttft2 = first["ttft_s"], second["ttft_s"]
    faster = (ttft1 is not None and ttft2 is not None and ttft2 <= CACHE_TTFT_GAIN * ttft1
              and ttft1 - ttft2 >= CACHE_TTFT_MIN_GAIN_S)
    if read is not None:
        if read >= CACHE_HIT_SHARE * size:
            return result(OK, f"the repeat request read {read:,} of {size:,} input tokens from the cache ({timing})")
        if faster:
            return result(OK, f"the repeat's TTFT fell from {_s(ttft1)} to {_s(ttft2)}, so the prefix was probably "
                              f"read from a cache, although the usage reports {read:,} cached tokens (a relay may pass "
                              "on zeros)")
        trivial = f" (only {read:,}: a token or so every request reports, not a cache hit)" if read else ""
        return result(FAIL, f"an identical {size:,}-token prefix sent twice: the second read {read:,} tokens from the "
                            f"cache{trivial} ({timing})")
    if faster:
        return result(OK, f"no cache usage reported, but the repeat's TTFT fell from {_s(ttft1)} to {_s(ttft2)}")
    return result(FAIL, f"no cache usage reported and the repeat of a {size:,}-token prefix was not faster "
                        f"(TTFT {_s(ttft2)} vs {_s(ttft1)})")


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    run: Callable[[Doctor], CheckResult]
    requires: tuple[str, ...] = ()
    # sends requests of its own: only worth it once the one-token request was accepted
    sends: bool = False
    # describes the channel rather than a mistake the user can fix (see CheckResult)
    informational: bool = False


CHECKS: tuple[Check, ...] = (
    Check("config", "configuration", check_config),
    Check("key", "key hygiene", check_key),
    Check("base_url", "base URL", check_base_url, ("config",)),
    Check("auth", "auth", check_auth, ("base_url",)),
    Check("model", "model", check_model, ("auth",)),
    Check("latency", "latency", check_latency, ("model",), sends=True),
    Check("streaming", "streaming", check_streaming, ("model",), sends=True),
    Check("fidelity", "channel fidelity", check_fidelity, ("model",), sends=True, informational=True),
    Check("rate_limits", "rate limits", check_rate_limits, ("auth",), informational=True),
    Check("caching", "prompt caching", check_caching, ("model",), sends=True, informational=True),
)


# A KV cache this full (0..1) during the checks counts as a busy server.
BUSY_KV_CACHE = 0.9


def check_server_load(history: list[tuple[float, dict[str, float]]], found: list[str],
                      problem: str | None = None) -> CheckResult:
    """`doctor --server-metrics URL`: was the server itself busy while the checks ran (other traffic)?

    The checks send one request at a time, so more than one request running, any
    waiting, or a KV cache at least `BUSY_KV_CACHE` full means other traffic
    shared the server, and the latency measured above includes it. Informational.
    """
    title, name = "server load", "server_load"
    seen = [g for _, g in history]
    gauged = [g for g in seen if {"running", "waiting", "kv_cache_usage"} & g.keys()]
    if not gauged:
        why = (f"no scrape of its metrics succeeded during the checks ({problem})" if not seen
               else "its metrics publish no running, waiting or KV-cache gauge")
        return CheckResult(name, title, UNVERIFIED, f"could not tell whether the server was busy: {why}",
                           details={"scrapes": len(seen)}, informational=True)

    def peak(term: str) -> float | None:
        values = [g[term] for g in gauged if term in g]
        return max(values) if values else None

    running, waiting, kv = peak("running"), peak("waiting"), peak("kv_cache_usage")
    details = {"scrapes": len(gauged), "servers": found, "running_max": running, "waiting_max": waiting,
               "kv_cache_usage_max": kv}
    parts = [f"at most {running:g} running" if running is not None else None,
             f"{waiting:g} waiting" if waiting else ("none waiting" if waiting is not None else None),
             f"KV cache up to {kv:.0%}" if kv is not None else None]
    seen_text = ", ".join(p for p in parts if p) + f" ({', '.join(found) or 'its metrics'}, {len(gauged)} scrapes)"
    busy = (running or 0) > 1 or (waiting or 0) > 0 or (kv or 0) >= BUSY_KV_CACHE
    if busy:
        return CheckResult(name, title, FAIL, f"the server was busy during the checks: {seen_text}",
                           "other traffic shares this server, so the latency above includes its queue: check again "
                           "when it is idle, or measure it under your own load with tokenload run",
                           details=details, informational=True)
    return CheckResult(name, title, OK, f"the server was not busy during the checks: {seen_text}; the checks' "
                       "own request was the only one, so the latency above is the server's own", details=details,
                       informational=True)


def run_checks(ctx: Doctor) -> list[CheckResult]:
    """Every check in order; one whose prerequisite failed is skipped with the reason."""
    results: dict[str, CheckResult] = {}
    for check in CHECKS:
        blocker = next((results[r] for r in check.requires if results[r].blocks), None)
        if blocker is None and check.sends and not accepted(ctx.tiny()):
            result = CheckResult(check.name, check.title, SKIP,
                                 "needs a request that succeeds first (the one-token request failed: see auth)")
        elif blocker is not None and blocker.status == UNVERIFIED:
            result = CheckResult(check.name, check.title, SKIP,
                                 f"needs a request that succeeds first (the {blocker.title} check could not verify)")
        elif blocker is not None:
            result = CheckResult(check.name, check.title, SKIP, f"needs the {blocker.title} check to pass first")
        else:
            result = check.run(ctx)
        results[check.name] = _redacted(ctx, replace(result, informational=check.informational))
    return list(results.values())


def _redacted(ctx: Doctor, result: CheckResult) -> CheckResult:
    """The result with every key doctor knows of masked, in every string it carries."""
    as_text = json.dumps(result.details)
    return replace(result, saw=ctx.redact(result.saw), fix=ctx.redact(result.fix) if result.fix else None,
                   details=json.loads(ctx.redact(as_text)))


def unreadable(error: ConfigError, env: Mapping[str, str]) -> list[CheckResult]:
    """The report when the configuration could not be read at all (exit 2)."""
    first = CheckResult("config", "configuration", FAIL, redact(f"the configuration cannot be read: {error}", [], env),
                        "fix the file or value named above; nothing else can be checked until it reads")
    rest = [CheckResult(c.name, c.title, SKIP, "needs a configuration that can be read") for c in CHECKS[1:]]
    return [first, *rest]


# The check that explains each configuration error kind a load run can meet.
CHECK_FOR_KIND: dict[str, str] = {ek.BAD_BASE_URL: "base_url", ek.AUTH: "auth", ek.NOT_FOUND_MODEL: "model"}


def explain(channel: Channel, kind: str, timeout_s: float = 5.0,
            sources: Mapping[str, str] | None = None) -> CheckResult | None:
    """Doctor's own check for a configuration error a load run hit: what it sees and the exact fix.

    The fix names what set each field (`sources`, as `resolve` gives them); without
    them every field counts as given by flag (`set --base-url to ...`), as for
    `tokenload run`. None when the kind has no check or the check passes now (the
    channel changed, or the error came from elsewhere).
    """
    name = CHECK_FOR_KIND.get(kind)
    if name is None:
        return None
    raw = {f: v for f in SECRET_FIELDS if (v := getattr(channel, f, None))}
    sources = dict(sources) if sources else {f: "flag" for f in Resolution.FIELD_LABELS}
    ctx = Doctor(Resolution(channel, sources, [], [], raw), {}, Path.cwd(), Path.home(), Limits(timeout_s=timeout_s))
    check = next(c for c in CHECKS if c.name == name)
    result = _redacted(ctx, check.run(ctx))
    return result if result.status == FAIL else None


def explain_failure(resolution: Resolution, env: Mapping[str, str], record: RequestRecord, timeline: Timeline,
                    timeout_s: float) -> tuple[str, str | None]:
    """(what a failed request means, the fix) in doctor's words, for `probe`.

    A configuration error gets the check that explains it (the exact base URL,
    "no key was given" and which variable to set, the served models); anything
    else gets the story doctor tells for a request that proved nothing (a relay
    whose backend is down, a 429 and its wait, a refused connection or a
    timeout, without an HTTP status that never came).
    """
    ctx = Doctor(resolution, env, Path.cwd(), Path.home(), Limits(timeout_s=timeout_s))
    name = CHECK_FOR_KIND.get(record["error_kind"] or "")
    if name is not None:
        result = _redacted(ctx, next(c for c in CHECKS if c.name == name).run(ctx))
        if result.status == FAIL:
            return result.saw, result.fix
    story, fix = failure_story(ctx, record, timeline)
    return ctx.redact(story), ctx.redact(fix) if fix else None


def diagnose_channel(
    *,
    flags: ChannelFlags,
    env: Mapping[str, str],
    cwd: Path,
    home: Path,
    limits: Limits | None = None,
) -> tuple[list[CheckResult], Channel | None]:
    """Resolve and check a channel; `(results, None)` when the configuration could not be read."""
    try:
        resolution = resolve(env=env, cwd=cwd, home=home, **flags)
    except ConfigError as exc:
        return unreadable(exc, env), None
    ctx = Doctor(resolution, env, cwd, home, limits or Limits())
    return run_checks(ctx), ctx.channel
