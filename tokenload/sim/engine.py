"""The behaviour model: continuous batching on replicas, driven by timer callbacks.

Each model has an `Engine` with `replicas` independent `Replica`s of `slots`
sequences each. An admitted sequence first prefills (prefills on one replica
run one after another, as chunked prefill shares the GPU) and writes its first
token when its prefill ends; it then joins the replica's decode batch, where
every decode step emits one token for each active sequence. A step lasts
`decode_base_s + decode_per_seq_s * (batch - 1)`, longer while a prefill is in
progress, all scaled by model size, `load` and noise. Requests beyond the free
slots wait in one FIFO queue per model; that wait is part of their TTFT.

One timer callback per replica step (not a task per token) is what lets one
core drive thousands of streams: a step is a plain loop over the batch.

Each engine keeps a `PrefixCache` of prompt prefixes: tokens read from it skip
prefill, so a conversation's later turns start faster, as on a channel that
honours prompt caching.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from datetime import datetime, timezone
from random import Random

from tokenload.sim.profile import Profile, effective_slots, load_at, model_scale
from tokenload.tokens import tokens_of

LATENESS_BUCKET_S = 0.0001
LATENESS_BUCKETS = 1000  # 0.1 ms resolution up to 100 ms; the last bucket is overflow


class Stats:
    """Counters the scheduler updates on the hot path, read by /metrics and benchmarks."""

    def __init__(self) -> None:
        self.lateness = [0] * (LATENESS_BUCKETS + 1)
        self.tokens = 0
        self.steps = 0
        self.step_seconds = 0.0


class Sequence:
    """One admitted request as the scheduler sees it; subclasses write the tokens.

    `emit(i)` writes output token i and returns False when the stream has ended
    early (client gone, injected disconnect or error event); `finish()` runs after
    the last token; `drop()` after an early end. Times are time.time() for the
    truth file. `on_end` runs once, before the response's last bytes go out, so
    the truth line exists by the time a client sees the end.
    """

    __slots__ = ("n_input", "n_cached", "n_out", "emitted", "stall_at", "stall_s", "resume_at",
                 "arrival", "admitted", "first_token", "last_token", "replica", "on_end")

    def __init__(self, n_input: int, n_out: int, stall_at: int = -1, stall_s: float = 0.0) -> None:
        self.n_input = n_input
        self.n_cached = 0  # prompt tokens read from the prefix cache: they skip prefill
        self.n_out = n_out
        self.emitted = 0
        self.stall_at = stall_at
        self.stall_s = stall_s
        self.resume_at = 0.0
        self.arrival = time.time()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.replica = -1
        self.on_end: Callable[[], None] | None = None

    def _ended(self) -> None:
        hook, self.on_end = self.on_end, None
        if hook is not None:
            hook()

    def emit(self, i: int) -> bool:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def drop(self) -> None:
        raise NotImplementedError


class Replica:
    """One engine instance: a decode batch of at most `slots` sequences."""

    def __init__(self, engine: Engine, index: int) -> None:
        self.engine = engine
        self.index = index
        self.occupied = 0
        self.prefilling = 0
        self.prefill_free_at = 0.0
        self.batch: list[Sequence] = []
        self._due = 0.0  # when the current step ends (set when the replica starts stepping)
        self._duration = 0.0
        self._stepping = False

    def admit(self, seq: Sequence) -> None:
        engine = self.engine
        now = time.monotonic()
        self.occupied += 1
        seq.admitted = time.time()
        seq.replica = self.index
        start = max(now, self.prefill_free_at)
        end = start + engine.prefill_time(seq.n_input - seq.n_cached)
        self.prefill_free_at = end
        self.prefilling += 1
        engine.loop.call_at(end, self._prefilled, seq, end)

    def _prefilled(self, seq: Sequence, due: float) -> None:
        """Prefill produces the first token, unless a stall holds it back."""
        self.prefilling -= 1
        if seq.stall_at == 0:
            seq.stall_at = -1
            seq.resume_at = time.monotonic() + seq.stall_s
        else:
            if not seq.emit(0):
                self._release(seq, finished=False)
                return
            self.engine.stats.lateness[min(int((time.monotonic() - due) / LATENESS_BUCKET_S), LATENESS_BUCKETS)] += 1
            self.engine.stats.tokens += 1
            seq.emitted = 1
            if seq.n_out == 1:
                self._release(seq, finished=True)
                return
        self.batch.append(seq)
        if not self._stepping:
            # An idle replica's first decode step starts with this first token and lasts a whole step, so
            # TPOT at batch 1 is `decode_base_s`. (On the grid of its last step it came at a random point less
            # than a step later: TPOT read 0.01895 s for 0.02.)
            self._stepping = True
            self._due = time.monotonic()
            self._schedule(self._due)

    def _schedule(self, now: float) -> None:
        """Next step one duration after the last; a step behind, the next tick of its grid.

        A running batch's steps stay on their grid, the way they do not wait for
        a newcomer (which joins at the next step). A grid starts at the first
        token that woke the replica, so replicas do not step in unison.
        """
        self._duration = duration = self.engine.step_time(len(self.batch), self.prefilling > 0)
        due = self._due + duration
        if due <= now:
            due = self._due + duration * math.ceil((now - self._due) / duration) if duration > 0 else now
        self._due = due
        self.engine.loop.call_at(due, self._step)

    def _step(self) -> None:
        stats = self.engine.stats
        hist = stats.lateness
        monotonic = time.monotonic
        now = monotonic()
        due = self._due
        per_bucket = 1 / LATENESS_BUCKET_S
        keep: list[Sequence] = []
        emitted = 0
        for seq in self.batch:
            if seq.resume_at > now:
                keep.append(seq)
                continue
            i = seq.emitted
            if i == seq.stall_at:
                seq.stall_at = -1
                seq.resume_at = now + seq.stall_s
                keep.append(seq)
                continue
            if not seq.emit(i):
                self._release(seq, finished=False)
                continue
            bucket = int((monotonic() - due) * per_bucket)
            hist[bucket if bucket < LATENESS_BUCKETS else LATENESS_BUCKETS] += 1
            emitted += 1
            seq.emitted = i + 1
            if i + 1 == seq.n_out:
                self._release(seq, finished=True)
            else:
                keep.append(seq)
        self.batch = keep
        stats.tokens += emitted
        stats.steps += 1
        stats.step_seconds += monotonic() - now
        self.engine.itl_observer(self._duration, emitted)
        if keep:
            self._schedule(monotonic())
        else:
            self._stepping = False

    def _release(self, seq: Sequence, finished: bool) -> None:
        self.occupied -= 1
        if finished:
            seq.finish()
        else:
            seq.drop()
        self.engine.slot_freed(self)


class PrefixCache:
    """An LRU cache of prompt prefixes in blocks of `BLOCK` tokens, like vLLM's automatic prefix caching.

    A block's key chains the previous block's key, so a block is found only when
    everything before it matches too. `use` reads the longest cached run of
    leading blocks and stores the rest at once (at arrival, not after prefill:
    a simplification that only matters for identical prefixes sent together).
    """

    BLOCK = 16

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens // self.BLOCK
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def use(self, texts: list[str]) -> tuple[int, int]:
        """(tokens read from the cache, tokens written to it) for a prompt prefix made of `texts`."""
        if not self.capacity:
            return 0, 0
        tokens = [tok for text in texts for tok in tokens_of(text)]
        blocks = self._blocks
        key, read, written, hit = 0, 0, 0, True
        for i in range(0, len(tokens) - self.BLOCK + 1, self.BLOCK):
            key = hash((key, *tokens[i:i + self.BLOCK]))
            if key in blocks:
                blocks.move_to_end(key)
                if hit:
                    read += self.BLOCK
                continue
            hit = False
            blocks[key] = None
            written += self.BLOCK
            if len(blocks) > self.capacity:
                blocks.popitem(last=False)
        return read, written


class Engine:
    """All replicas serving one model, with the model's shared waiting queue and prefix cache."""

    def __init__(self, profile: Profile, model: str, stats: Stats, rng: Random,
                 itl_observer: Callable[[float, int], None] | None = None) -> None:
        self.profile = profile
        self.model = model
        self.stats = stats
        self.rng = rng
        self.loop = asyncio.get_running_loop()
        self.model_scale = model_scale(profile, model)
        self.replicas = [Replica(self, k) for k in range(profile.replicas)]
        self.waiting: deque[Sequence] = deque()
        self.cache = PrefixCache(profile.prefix_cache_tokens)
        self.itl_observer = itl_observer or (lambda seconds, count: None)

    @property
    def scale(self) -> float:
        """Time factor of this model now: its size, times the load of the (simulated) hour."""
        return self.model_scale * load_at(self.profile, time.time())

    @property
    def slots(self) -> int:
        """Slots per replica left to us now: other tenants take more of them at busy hours."""
        return effective_slots(self.profile, load_at(self.profile, time.time()))

    def _noise(self) -> float:
        sigma = self.profile.noise
        return self.rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma else 1.0

    def prefill_time(self, n_input: int) -> float:
        p = self.profile
        return (p.prefill_base_s + p.prefill_per_token_s * n_input ** p.prefill_exponent) * self.scale * self._noise()

    def step_time(self, batch: int, prefilling: bool) -> float:
        p = self.profile
        step = (p.decode_base_s + p.decode_per_seq_s * max(batch - 1, 0)) * self.scale * self._noise()
        return step * (1 + p.prefill_interference) if prefilling else step

    @property
    def running(self) -> int:
        return sum(r.occupied for r in self.replicas)

    def submit(self, seq: Sequence) -> bool:
        """Admit now or queue; False when the queue is full (the caller answers overloaded)."""
        replica = min(self.replicas, key=lambda r: r.occupied)
        if replica.occupied < self.slots and not self.waiting:
            replica.admit(seq)
            return True
        if self.profile.max_queue and len(self.waiting) >= self.profile.max_queue:
            return False
        self.waiting.append(seq)
        return True

    def slot_freed(self, replica: Replica) -> None:
        while self.waiting and replica.occupied < self.slots:
            replica.admit(self.waiting.popleft())


class RateLimiter:
    """Sliding one-minute windows of requests and tokens; answers a retry-after and the headers real channels send."""

    def __init__(self, rpm: int, tpm: int) -> None:
        self.rpm = rpm
        self.tpm = tpm
        self._requests: deque[float] = deque()
        self._tokens: deque[tuple[float, int]] = deque()
        self._token_sum = 0

    def _expire(self, now: float) -> None:
        while self._requests and self._requests[0] <= now - 60:
            self._requests.popleft()
        while self._tokens and self._tokens[0][0] <= now - 60:
            self._token_sum -= self._tokens.popleft()[1]

    def check(self, tokens: int) -> float | None:
        """Seconds to wait when over a limit (nothing is counted then), else None and count it."""
        now = time.monotonic()
        self._expire(now)
        if self.rpm and len(self._requests) >= self.rpm:
            return self._requests[0] + 60 - now
        if self.tpm and self._tokens and self._token_sum + tokens > self.tpm:
            return self._tokens[0][0] + 60 - now
        self._requests.append(now)
        self._tokens.append((now, tokens))
        self._token_sum += tokens
        return None

    def state(self) -> dict[str, float]:
        """Limit, remaining and seconds until the oldest entry leaves the window, per limit that is on."""
        now = time.monotonic()
        self._expire(now)
        out: dict[str, float] = {}
        if self.rpm:
            out.update(requests_limit=self.rpm, requests_remaining=max(0, self.rpm - len(self._requests)),
                       requests_reset_s=self._requests[0] + 60 - now if self._requests else 0.0)
        if self.tpm:
            out.update(tokens_limit=self.tpm, tokens_remaining=max(0, self.tpm - self._token_sum),
                       tokens_reset_s=self._tokens[0][0] + 60 - now if self._tokens else 0.0)
        return out


def rate_limit_headers(state: dict[str, float], anthropic: bool) -> list[tuple[str, str]]:
    """`RateLimiter.state()` in the vendor's own header form.

    Anthropic: `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`, reset an RFC 3339 time.
    OpenAI: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, reset a duration such as `1.5s`.
    """
    headers: list[tuple[str, str]] = []
    for what in ("requests", "tokens"):
        if f"{what}_limit" not in state:
            continue
        limit, remaining, reset = (state[f"{what}_{k}"] for k in ("limit", "remaining", "reset_s"))
        if anthropic:
            at = datetime.fromtimestamp(math.ceil(time.time() + reset), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            headers += [(f"anthropic-ratelimit-{what}-limit", f"{limit:.0f}"),
                        (f"anthropic-ratelimit-{what}-remaining", f"{remaining:.0f}"),
                        (f"anthropic-ratelimit-{what}-reset", at)]
        else:
            headers += [(f"x-ratelimit-limit-{what}", f"{limit:.0f}"),
                        (f"x-ratelimit-remaining-{what}", f"{remaining:.0f}"),
                        (f"x-ratelimit-reset-{what}", f"{reset:.3f}s")]
    return headers


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
