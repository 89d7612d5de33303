"""The per-request record: every column of requests.parquet, defined once, here.

TO ADD A COLUMN, ADD ONE LINE to `RequestRecord` below (`name: type`, with a
comment when the name does not say it all); the contract's own columns live in
`SpecRecord`. Everything else follows from these two classes:

- the Arrow schema of the segments and of requests.parquet (`arrow_schema()`,
  used by `tokenload.load.records.SCHEMA`), in this order: the contract's columns
  first, then the extras;
- `SPEC_COLUMNS`, the columns the analysis requires of a run directory;
- the type checker's view of every record the load side builds
  (`tokenload.measure`, `tokenload.stream`, `tokenload.load.user`), the
  analysis reads and `tokenload analyze --csv` exports.

Types map to Arrow as `str` -> string, `float` -> float64, `int` -> int64,
`Int32` -> int32, `bool` -> bool, a `Literal` of strings -> string; `| None`
is implied (every column is nullable: a failed request has no TTFT).

`RequestRecord` is a `TypedDict`, so a record is still a plain dict: no cost
on the load generator's hot path, while mypy checks every key and value type.
It is `total=False` because a record is built in stages (the measurement, then
the run and user context), and because older run directories lack the newer
columns.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypedDict, Union, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    import pyarrow as pa

Int32 = Annotated[int, "int32"]  # an int stored as Arrow int32 (plain `int` is int64)
Status = Literal["ok", "error", "cancelled"]
STORM_PROBE: Final = "storm_probe"  # the `phase` of the error-storm breaker's probe requests


class SpecRecord(TypedDict, total=False):
    """The contract's per-request columns, in its order: every run directory has them."""

    request_id: str
    run_id: str
    worker: str
    user_id: str
    step: Int32
    active_users: Int32
    scheduled_at: float
    started_at: float
    protocol: str
    model: str
    status: Status
    error_kind: str | None  # one of `tokenload.errors.ErrorKind`, None on success
    http_status: Int32 | None
    ttfb_s: float | None
    ttft_s: float | None
    ttft_text_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    input_tokens: int | None
    input_tokens_source: str | None  # server | estimate
    output_tokens: int
    output_tokens_source: str  # server | chunks
    max_tokens: int | None
    chunks: int
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_max_s: float | None
    stop_reason: str | None


class RequestRecord(SpecRecord, total=False):
    """One request as tokenload records it: the contract's columns, then tokenload's extras."""

    finished_at: float | None
    late_s: float | None  # how late an open-loop send left after its scheduled time (send_lag_s included)
    prompt_tokens_target: int | None
    in_flight: bool  # tokenload cut this stream open (a step down's stopped user, the run's end)
    cut_at: float | None  # when tokenload cut it (unix s): a censored latency is at least cut_at - started_at
    server_request_id: str | None
    error_message: str | None  # redacted: servers echo keys
    duration_s: float | None  # until the body ended, trailing usage/stop events included
    reasoning_tokens: int | None
    thinking_chunks: int
    malformed_events: int
    connect_s: float | None  # DNS + TCP + TLS before t0; 0 on a reused keep-alive connection
    # from the request handed to the transport to its last byte handed to the kernel (t0): the client's own
    # wait (pool, connect_s, event loop, a blocked write), never part of TTFT; None when it never went out
    send_lag_s: float | None
    reconnects: int  # resends on a fresh connection after a reused one died before any response byte
    # tokens stamped with the first token's time (read with it, the first included): above 1, the stamp is the
    # newest write's arrival and ttft_s an upper bound (the kernel merged writes the client read late)
    first_read_tokens: int | None
    # both ends of ttft_s carry the kernel's stamps (t0: the request's last byte leaving; the first token: its
    # arrival, read alone): exact. False: one end may hold the client's own delay (HTTPS, a kernel without send
    # stamps, first_read_tokens > 1); the analysis leaves it out of a step's TTFT percentiles when it can
    ttft_exact: bool | None
    eos_only: bool  # the answer was only the end-of-sequence token (counted, never streamed): no latency
    # ended for length below the max_tokens asked (server's count): the server cut it (a full context slot)
    truncated: bool
    # being kind to the channel (tokenload.load.pacing); rate-limit values only, never the headers
    backoff_s: float | None  # after a push-back (429/529/503) or a refusal once answered: how long this process held back
    held_s: float | None  # how long the process's gate (holds, caps) held this request before it was sent
    retry_of: str | None  # a retry ([load] retry): the request_id of the first request of its chain
    retry_after_s: float | None  # after a push-back: the wait the server asked for, as parsed
    rl_requests_limit: int | None  # the channel's requests per minute, as its response announced
    rl_requests_remaining: int | None
    rl_tokens_limit: int | None  # tokens per minute
    rl_tokens_remaining: int | None
    # workloads: prompt caching, sessions, warm-up
    cache_read_input_tokens: int | None  # prompt tokens the server read from its cache (OpenAI: cached_tokens)
    cache_creation_input_tokens: int | None  # prompt tokens written to the cache (Anthropic)
    session_id: str | None
    turn: int | None  # 1-based turn of a [session] conversation
    context_tokens: int | None  # the whole context sent (system prompt and history), local estimate
    # measure; warmup (a run's or a step's first requests, left out of every statistic); storm_probe (the
    # error-storm breaker's probe, sent while the users were paused: also left out)
    phase: Literal["warmup", "measure", "storm_probe"]
    # when the run's live statistics counted its SLO verdict: at its end, or in a search where its first token
    # decided it (late, or in time under an SLO of TTFT alone); None for warm-up and a stream cut undecided
    judged_at: float | None
    judged_in_flight: str | None  # late | on_time: its first token decided it in flight (`judged_at`); else None


SPEC_COLUMNS: tuple[str, ...] = tuple(SpecRecord.__annotations__)
COLUMNS: tuple[str, ...] = tuple(RequestRecord.__annotations__)

_UNIONS: tuple[Any, ...] = (Union, types.UnionType)


def column_types() -> dict[str, Any]:
    """Each column's Python type with `None` stripped: `int`, `Int32`, `Literal[...]`..."""
    hints = get_type_hints(RequestRecord, include_extras=True)
    out = {}
    for name in COLUMNS:
        hint = hints[name]
        if get_origin(hint) in _UNIONS:
            (hint,) = (a for a in get_args(hint) if a is not type(None))
        out[name] = hint
    return out


def arrow_schema() -> pa.Schema:
    """The Arrow schema of `RequestRecord` (pyarrow is imported here: the record type itself is free)."""
    import pyarrow as pa

    plain = {str: pa.string(), float: pa.float64(), int: pa.int64(), bool: pa.bool_()}
    fields = []
    for name, hint in column_types().items():
        if get_origin(hint) is Annotated:
            arrow = {"int32": pa.int32()}[get_args(hint)[1]]
        elif get_origin(hint) is Literal:
            arrow = plain[type(get_args(hint)[0])]
        else:
            arrow = plain[hint]
        fields.append(pa.field(name, arrow))
    return pa.schema(fields)
