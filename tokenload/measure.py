"""Per-request measurement: a timeline of what happened, and pure functions over it.

A `Timeline` is filled while a response streams in (by `tokenload.stream`); it
holds raw `time.perf_counter()` stamps and counts, nothing derived. `measure()`
turns it into the record's fields. Keeping derivation pure makes every
definition testable on a hand-written timeline:

- `ttft_s`: first output token of any kind (text, thinking, tool input) - t0.
- `ttft_text_s`: first visible text token - t0.
- `e2e_s`: last output token - t0 (trailing usage/stop events excluded).
- `tpot_s`: (last token - first token) / (output_tokens - 1), when output_tokens > 1;
  when the server counted exactly one token more than it streamed and the answer
  stopped naturally, that token is the end-of-sequence token (llama.cpp counts it,
  streams nothing for it), so N is the streamed count. An answer that is only that
  token is flagged `eos_only`: it has no first token, hence no latency to average.
- `itl_*`: gaps between consecutive content chunks, as they arrived.
- t0: the moment the request's last byte was handed to the kernel (the client's `sendall`
  returned; httpx: its request body was written), so TTFT, e2e and the other latencies are
  the server's time plus the wire, never the client's own wait to get the request out. Until
  then t0 holds when the user handed the request to the transport (the intended start); a
  request that never went out (refused, connect timeout) keeps that.
- `send_lag_s`: from that intended start to t0: waiting for a pooled connection, setting one
  up (`connect_s` is part of it), the event loop's turn and a `sendall` the server's full
  receive window held back. A burst of new users shows up here, not in TTFT; None when the
  request never went out.
- `connect_s`: TCP + TLS setup (0 on a reused connection), part of `send_lag_s`.
- `first_read_tokens`: how many tokens carry the first token's stamp (the first included): those read with
  it. A read is stamped with its newest byte's arrival, and the kernel merges small writes still unread
  into one buffer stamped with the newest, so a first token read after the server's next token write
  had arrived carries that write's arrival: above 1, `ttft_s` is an upper bound (exact only if the
  server wrote those tokens together), too long by at most the gap to the newest of them.
- `ttft_exact`: both ends of `ttft_s` carry the kernel's stamps: t0 its stamp of the request's last byte
  leaving (plain HTTP where the kernel stamps sends, Linux 6.12+) and the first token its arrival, read
  alone (`first_read_tokens` 1); no pause of the client (a garbage collection, a busy core) can be in it.
  False: one end may hold the client's own delay; None without a first token.
- `input_tokens`: the whole prompt the server processed, cached part included (OpenAI's
  `prompt_tokens`; Anthropic's `input_tokens` + cache reads + cache writes), so every protocol
  counts the same thing; the cached parts stay in their own columns. A 0 is not a count (a
  prompt has at least one token; relays send 0 as a placeholder): the local estimate stands in.
- `truncated`: the stream ended for length (`LENGTH_STOPS`) with fewer output tokens, as the
  server counted them, than the `max_tokens` asked: the server cut the answer (its context
  slot was full), not the client's limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

from tokenload.protocolspec import SPECS
from tokenload.record import RequestRecord

TOKEN_TEXT = "text"
TOKEN_THINKING = "thinking"
TOKEN_OTHER = "other"  # tool-use input and similar output that is neither text nor thinking
# Stop reasons that mean the model ended on its own (an end-of-sequence token), and that the answer hit an
# output limit, in every protocol.
NATURAL_STOPS = frozenset(spec.natural_stop for spec in SPECS.values())
LENGTH_STOPS = frozenset(spec.length_stop for spec in SPECS.values())


@dataclass(slots=True)
class Timeline:
    """Raw observations of one request; filled incrementally, never derived."""

    t0: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)
    t_headers: float | None = None
    t_first_byte: float | None = None
    t_first_event: float | None = None
    t_first_token: float | None = None
    t_first_text: float | None = None
    t_last_token: float | None = None
    t_end: float | None = None
    http_status: int | None = None
    chunk_times: list[float] = field(default_factory=list)
    text_chunks: int = 0
    thinking_chunks: int = 0
    other_chunks: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_read_tokens: int | None = None  # prompt tokens the server read from its prompt cache
    cache_creation_tokens: int | None = None  # prompt tokens written to the cache (Anthropic reports it)
    stop_reason: str | None = None
    complete: bool = False
    malformed: int = 0
    error_kind: str | None = None
    error_message: str | None = None
    request_id: str | None = None
    connect_s: float | None = None  # TCP + TLS setup before t0; 0.0 on a reused connection
    send_lag_s: float | None = None  # from the intended start (the old t0) to the request's last byte sent (t0)
    # t0 is the kernel's stamp of the request's last byte leaving and the body's reads carry kernel arrival stamps
    # (plain HTTP where the kernel stamps sends): no pause of this process can be in the TTFT
    stamped: bool = False
    reconnects: int = 0  # resends on a fresh connection after a reused one died before any response byte
    # The response headers (names lower-cased), kept for the rate-limit headers the load side and doctor read.
    response_headers: dict[str, str] | None = None
    on_text: Callable[[str, str], None] | None = None  # (text, kind), for live display
    # A search's TTFT deadline: `on_late(streaming)` runs (in the event loop) once the request has gone `late_s`
    # past t0 without a first token, so the search counts the miss while the request is still in flight
    # (`streaming`: how many of the process's requests were streaming meanwhile; None: not counted this time).
    late_s: float | None = None
    on_late: Callable[[int | None], None] | None = None
    # With an SLO of TTFT alone, `on_time()` runs instead when the first token came by `late_s`: the request
    # has met the SLO unless it fails later, and a steering verdict need not wait for its last token.
    on_time: Callable[[], None] | None = None

    def token(self, t: float, kind: str, text: str = "") -> None:
        """One content delta arrived at `t` (counted before any display callback runs)."""
        if self.t_first_token is None:
            self.t_first_token = t
        if kind == TOKEN_TEXT:
            self.text_chunks += 1
            if self.t_first_text is None:
                self.t_first_text = t
        elif kind == TOKEN_THINKING:
            self.thinking_chunks += 1
        else:
            self.other_chunks += 1
        self.t_last_token = t
        self.chunk_times.append(t)
        if self.on_text is not None:
            self.on_text(text, kind)

    def sent(self, t: float, intended: float, connect_s: float | None, stamped: bool = False) -> None:
        """The request's last byte was out at `t` (`perf_counter`): t0 is then.

        `intended` is when the request was handed to the transport (its `t0` until
        now, passed in because a resend on a fresh connection sends twice); `stamped`:
        `t` is the kernel's stamp of the byte leaving, not the moment the write returned.
        """
        self.t0 = t
        self.started_at = time.time() - (time.perf_counter() - t)
        self.send_lag_s = max(0.0, t - intended)
        self.connect_s = connect_s
        self.stamped = stamped

    def fail(self, kind: str, message: str) -> None:
        """Record the first error only: later ones are consequences of it."""
        if self.error_kind is None:
            self.error_kind = kind
            self.error_message = message

    @property
    def chunks(self) -> int:
        return len(self.chunk_times)


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


def quantile(ordered: list[float], q: float) -> float:
    """numpy's default (linear) percentile of a sorted list: numpy costs more per call than a
    whole stream's worth of this, and it runs once per request on the load generator."""
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def measure(tl: Timeline, estimated_input_tokens: int | None = None, max_tokens: int | None = None) -> RequestRecord:
    """The record's per-request fields from a timeline (no run/user context); `max_tokens` as asked."""
    if tl.output_tokens is not None:
        output_tokens, output_source = tl.output_tokens, "server"
    else:
        output_tokens, output_source = tl.chunks, "chunks"
    if tl.input_tokens:
        input_tokens, input_source = tl.input_tokens, "server"
    elif estimated_input_tokens is not None:
        input_tokens, input_source = estimated_input_tokens, "estimate"
    else:
        input_tokens, input_source = None, None
    streamed = tl.chunks
    eos_unstreamed = (tl.output_tokens is not None and tl.output_tokens == streamed + 1
                      and tl.stop_reason in NATURAL_STOPS)
    decoded = streamed if eos_unstreamed else output_tokens
    tpot = None
    if decoded > 1 and tl.t_first_token is not None and tl.t_last_token is not None:
        tpot = (tl.t_last_token - tl.t_first_token) / (decoded - 1)
    # t0 is stamped when the write returned; an answer that came sooner (headers sent before the request was
    # read) carries an earlier kernel arrival stamp. Nothing arrives before the request went out, so the origin
    # is whichever came first, and no latency reads below zero.
    t0 = tl.t0 if tl.t_headers is None else min(tl.t0, tl.t_headers)
    itl_p50 = itl_p99 = itl_max = None
    times = tl.chunk_times
    if len(times) > 1:
        gaps = sorted([b - a for a, b in pairwise(times)])
        itl_p50, itl_p99, itl_max = quantile(gaps, 0.5), quantile(gaps, 0.99), gaps[-1]
    return {
        "status": "ok" if tl.error_kind is None else "error",
        "error_kind": tl.error_kind,
        "error_message": tl.error_message,
        "http_status": tl.http_status,
        "started_at": tl.started_at,
        "ttfb_s": _since(tl.t_headers, t0),
        "ttft_s": _since(tl.t_first_token, t0),
        "ttft_text_s": _since(tl.t_first_text, t0),
        "tpot_s": tpot,
        "e2e_s": _since(tl.t_last_token, t0),
        "duration_s": _since(tl.t_end, t0),
        "input_tokens": input_tokens,
        "input_tokens_source": input_source,
        "output_tokens": output_tokens,
        "output_tokens_source": output_source,
        "reasoning_tokens": tl.reasoning_tokens,
        "cache_read_input_tokens": tl.cache_read_tokens,
        "cache_creation_input_tokens": tl.cache_creation_tokens,
        "thinking_chunks": tl.thinking_chunks,
        "chunks": tl.chunks,
        "itl_p50_s": itl_p50,
        "itl_p99_s": itl_p99,
        "itl_max_s": itl_max,
        "stop_reason": tl.stop_reason,
        "malformed_events": tl.malformed,
        "server_request_id": tl.request_id,
        "connect_s": tl.connect_s,
        "send_lag_s": tl.send_lag_s,
        "reconnects": tl.reconnects,
        "first_read_tokens": times.count(times[0]) if times else None,
        "ttft_exact": None if tl.t_first_token is None else tl.stamped and times.count(times[0]) == 1,
        "eos_only": eos_unstreamed and streamed == 0,
        "truncated": (tl.error_kind is None and tl.stop_reason in LENGTH_STOPS and tl.output_tokens is not None
                      and max_tokens is not None and tl.output_tokens < max_tokens),
    }


def formula(ttft_s: float | None, tpot_s: float | None, output_tokens: int, e2e_s: float | None) -> dict[str, float] | None:
    """Check `total = TTFT + TPOT x N` (simple) and `TTFT + TPOT x (N - 1)` (exact)."""
    if ttft_s is None or tpot_s is None or e2e_s is None or e2e_s <= 0:
        return None
    simple = ttft_s + tpot_s * output_tokens
    exact = ttft_s + tpot_s * (output_tokens - 1)
    return {
        "predicted_simple_s": simple,
        "predicted_exact_s": exact,
        "error_simple_pct": 100.0 * (simple - e2e_s) / e2e_s,
        "error_exact_pct": 100.0 * (exact - e2e_s) / e2e_s,
    }
