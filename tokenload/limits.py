"""What a channel says of its rate limits: every common header dialect read into one `RateInfo`.

A channel that answers 429 (rate limited), 529 or 503 (overloaded) says how long
to wait, in one of several dialects:

- `retry-after` (seconds, or an HTTP date) and `retry-after-ms` (the OpenAI SDK's
  finer form; it wins when both are sent);
- Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`
  (reset: an RFC 3339 time);
- OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset: a
  duration such as `1s`, `6m0s`, `20ms`);
- any of these behind a relay's prefix: LiteLLM passes its backend's headers on as
  `llm_provider-<name>`, and its own router's 429 carries only `llm_provider-retry-after`.
  A header without the prefix wins over the prefixed one (it is the relay's own word).

Values only: no header that could hold a secret is kept. The load generator
paces itself with them (`tokenload.load.pacing`) and `doctor` reports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


_ANTHROPIC = "anthropic-ratelimit-"


_OPENAI = "x-ratelimit-"
# Prefixes under which relays pass on the rate-limit headers of the provider behind them.
_RELAY_PREFIXES = ("llm_provider-",)


@dataclass(frozen=True, slots=True)
class RateInfo:
    """What one response said about the channel's rate limits (None = not said)."""

    requests_limit: int | None = None
    requests_remaining: int | None = None
    requests_reset_s: float | None = None
    tokens_limit: int | None = None
    tokens_remaining: int | None = None
    tokens_reset_s: float | None = None
    retry_after_s: float | None = None

    @property
    def empty(self) -> bool:
        return all(v is None for v in (self.requests_limit, self.requests_remaining, self.tokens_limit,
                                       self.tokens_remaining, self.retry_after_s))

    def server_wait(self) -> float | None:
        """How long the server asked us to wait: retry-after, else the reset of an exhausted limit."""
        if self.retry_after_s is not None:
            return self.retry_after_s
        resets = [reset for remaining, reset in ((self.requests_remaining, self.requests_reset_s),
                                                 (self.tokens_remaining, self.tokens_reset_s))
                  if remaining is not None and remaining <= 0 and reset is not None]
        return max(resets) if resets else None


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(float(value.strip()))
    except ValueError:
        return None


def _seconds_until(stamp: str, now: float) -> float | None:
    """An RFC 3339 / HTTP date, as seconds from `now` (unix time), never negative."""
    try:
        when = datetime.fromisoformat(stamp.strip().replace("Z", "+00:00"))
    except ValueError:
        try:
            when = parsedate_to_datetime(stamp)
        except (TypeError, ValueError):
            return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


def parse_duration(text: str) -> float | None:
    """OpenAI's reset form (`1s`, `6m0s`, `1h2m3.5s`, `20ms`) or plain seconds, in seconds."""
    text = text.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


def _reset(value: str | None, now: float) -> float | None:
    if value is None:
        return None
    seconds = parse_duration(value)
    return seconds if seconds is not None else _seconds_until(value, now)


def parse_rate_headers(headers: dict[str, str] | None, now: float) -> RateInfo:
    """The rate-limit facts in a response's headers (names lower-case), `now` in unix seconds.

    Anthropic's token limit is the combined `tokens` one when sent, else `input-tokens`
    (the one a long prompt exhausts first).
    """
    if not headers:
        return RateInfo()
    relayed = {name[len(prefix):]: value for name, value in headers.items()
               for prefix in _RELAY_PREFIXES if name.startswith(prefix)}
    if relayed:
        headers = {**relayed, **headers}
    retry: float | None = None
    if "retry-after-ms" in headers:
        ms = parse_duration(headers["retry-after-ms"])
        retry = None if ms is None else ms / 1000
    if retry is None and "retry-after" in headers:
        raw = headers["retry-after"]
        retry = parse_duration(raw)
        if retry is None:
            retry = _seconds_until(raw, now)
    if any(name.startswith(_ANTHROPIC) for name in headers):
        tokens = "tokens" if f"{_ANTHROPIC}tokens-limit" in headers else "input-tokens"
        kinds = {"requests": "requests", "tokens": tokens}
        names = {(what, field): f"{_ANTHROPIC}{kinds[what]}-{field}" for what in kinds
                 for field in ("limit", "remaining", "reset")}
    else:
        names = {(what, field): f"{_OPENAI}{field}-{what}" for what in ("requests", "tokens")
                 for field in ("limit", "remaining", "reset")}
    requests, tokens_ = ((_int(headers.get(names[what, "limit"])), _int(headers.get(names[what, "remaining"])),
                          _reset(headers.get(names[what, "reset"]), now)) for what in ("requests", "tokens"))
    return RateInfo(*requests, *tokens_, retry)
