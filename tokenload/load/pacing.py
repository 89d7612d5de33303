"""Being kind to the channel: rate-limit headers, back-off after a push-back, and our own rate caps.

A channel that answers 429 (rate limited), 529 or 503 (overloaded) says how long
to wait, in one of several dialects:

- `retry-after` (seconds, or an HTTP date) and `retry-after-ms` (the OpenAI SDK's
  finer form; it wins when both are sent);
- Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`
  (reset: an RFC 3339 time);
- OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset: a
  duration such as `1s`, `6m0s`, `20ms`);
- any of them behind a relay's `llm_provider-` prefix (LiteLLM's router sends a 429 with
  only `llm_provider-retry-after: 60`, and those 60 s are waited, not 1, 2, 4 ...).

`parse_rate_headers` reads any of them into one `RateInfo` (values only: no
header that could hold a secret is kept). `Pacer` is one process's gate in
front of every send: it holds all users of the process after a push-back (the
server's wait, else a capped exponential back-off: 1, 2, 4 ... 60 s over
consecutive waves of push-backs; a channel that went down and refuses connections gets the same
back-off), holds them until the reset when a response says
nothing is left, spaces sends under `[load] max_rps` / `max_tokens_per_min` (this
process's share), and, once the channel has limited us, under the request limit it
announced. Nothing is retried here: a pushed-back request stays recorded as what it
was, with the wait it caused (`backoff_s`), and every request records how long it
was held at the gate (`held_s`), so the analysis can tell "the channel was slow"
from "we were told to wait".

Everything here is bookkeeping on a clock passed in: the user does the sleeping.
"""

from __future__ import annotations

from tokenload import errors as ek
from tokenload.limits import RateInfo

# Capped exponential back-off when the server names no wait: BACKOFF_BASE_S x 2^(n-1), at most BACKOFF_CAP_S.
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 60.0
# A server wait longer than this is not honoured in full (a daily quota's reset would stall the run for hours).
MAX_WAIT_S = 300.0
PUSHBACK_STATUSES = frozenset({429, 503, 529})


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

    def observe(self, pushback: bool, info: RateInfo, now: float, down: bool = False) -> float | None:
        """A response came back: learn its limits; returns the back-off when it pushed back, else None.

        `down`: the channel refused the connection after it had answered (it went down): the same back-off,
        without taking it for a rate limit (an error storm's breaker then decides whether the run goes on)."""
        if info.requests_limit:
            self.learned_rpm = info.requests_limit
        if info.tokens_limit:
            self.learned_tpm = info.tokens_limit
        if pushback or down:
            self.limited = self.limited or pushback
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
