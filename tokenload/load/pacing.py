"""Being kind to the channel: rate-limit headers, back-off after a push-back, and our own rate caps.

A channel that answers 429 (rate limited), 529 or 503 (overloaded) says how long
to wait, in one of several dialects:

- `retry-after` (seconds, or an HTTP date) and `retry-after-ms` (the OpenAI SDK's
  finer form; it wins when both are sent);
- Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`
  (reset: an RFC 3339 time);
- OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset: a
  duration such as `1s`, `6m0s`, `20ms`).

`parse_rate_headers` reads any of them into one `RateInfo` (values only: no
header that could hold a secret is kept). `Pacer` is one process's gate in
front of every send: it holds all users of the process after a push-back (the
server's wait, else a capped exponential back-off: 1, 2, 4 ... 60 s over
consecutive waves of push-backs), holds them until the reset when a response says
nothing is left, spaces sends under `[load] max_rps` / `max_tokens_per_min` (this
process's share), and, once the channel has limited us, under the request limit it
announced. Nothing is retried here: a pushed-back request stays recorded as what it
was, with the wait it caused (`backoff_s`), and every request records how long it
was held at the gate (`held_s`), so the analysis can tell "the channel was slow"
from "we were told to wait".

Everything here is bookkeeping on a clock passed in: the user does the sleeping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime

from tokenload import errors as ek

# Capped exponential back-off when the server names no wait: BACKOFF_BASE_S x 2^(n-1), at most BACKOFF_CAP_S.
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 60.0
# A server wait longer than this is not honoured in full (a daily quota's reset would stall the run for hours).
MAX_WAIT_S = 300.0
PUSHBACK_STATUSES = frozenset({429, 503, 529})

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_ANTHROPIC = "anthropic-ratelimit-"
_OPENAI = "x-ratelimit-"


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


def backoff_s(info: RateInfo, streak: int) -> float:
    """The wait after the `streak`-th push-back in a row: the server's, else capped exponential."""
    wait = info.server_wait()
    if wait is not None:
        return min(wait, MAX_WAIT_S)
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, streak - 1))


def pushed_back(http_status: int | None, error_kind: str | None) -> bool:
    """The channel told us to slow down: 429, 503, 529, or an in-stream rate-limit or overload error."""
    return http_status in PUSHBACK_STATUSES or error_kind in (ek.RATE_LIMITED, ek.OVERLOADED)


class Pacer:
    """One process's gate in front of every send (see the module docstring).

    A sender first waits out any hold (`held`, asked again at least every second,
    so a lifted pause frees it at once), then books its slot under the caps
    (`book`) and sleeps until it. Spacing is strict (no burst above the rate), which
    keeps any minute under the cap. Caps and announced limits are for the whole
    run: each of `workers` processes takes an even share, as `Budget` does.
    Times are `time.monotonic()`.
    """

    def __init__(self, max_rps: float = 0.0, max_tokens_per_min: float = 0.0) -> None:
        self.max_rps = max_rps
        self.max_tokens_per_min = max_tokens_per_min
        self.workers = 1
        self.hold_until = 0.0
        self.streak = 0  # waves of push-backs in a row
        self.limited = False  # the channel has pushed back at least once: pace under its announced limits
        self.learned_rpm: int | None = None
        self.learned_tpm: int | None = None
        self._next_request = 0.0
        self._next_token = 0.0

    def _rates(self) -> tuple[float, float]:
        """(requests/s, tokens/s) this process may send; 0 = no cap."""
        learned = (self.learned_rpm or 0, self.learned_tpm or 0) if self.limited else (0, 0)
        rps = [r for r in (self.max_rps, learned[0] / 60) if r > 0]
        tps = [r for r in (self.max_tokens_per_min / 60, learned[1] / 60) if r > 0]
        return (min(rps) / self.workers if rps else 0.0), (min(tps) / self.workers if tps else 0.0)

    def held(self, now: float) -> float:
        """Seconds left of a hold (back-off, exhausted limit, breaker pause); 0 when none."""
        return max(0.0, self.hold_until - now)

    def book(self, tokens: int, now: float) -> float:
        """Book the next send slot under the caps for a request of about `tokens` tokens; seconds until it."""
        rps, tps = self._rates()
        if not rps and not tps:
            return 0.0
        at = max(now, self._next_request, self._next_token)
        if rps:
            self._next_request = at + 1 / rps
        if tps:
            self._next_token = at + tokens / tps
        return at - now

    def hold(self, until: float) -> None:
        """No send before `until` (a back-off, an exhausted limit, a breaker pause)."""
        self.hold_until = max(self.hold_until, until)

    def release(self) -> None:
        self.hold_until = 0.0

    def observe(self, pushback: bool, info: RateInfo, now: float) -> float | None:
        """A response came back: learn its limits; returns the back-off when it pushed back, else None."""
        if info.requests_limit:
            self.learned_rpm = info.requests_limit
        if info.tokens_limit:
            self.learned_tpm = info.tokens_limit
        if pushback:
            self.limited = True
            if now >= self.hold_until:  # push-backs that land during a hold were sent before it: one wave
                self.streak += 1
            wait = backoff_s(info, max(1, self.streak))
            self.hold(now + wait)
            return wait
        self.streak = 0
        exhausted = info.server_wait()
        if exhausted is not None:  # nothing left: wait for the reset rather than for a 429
            self.hold(now + min(exhausted, MAX_WAIT_S))
        return None
