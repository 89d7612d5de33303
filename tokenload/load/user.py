"""The Locust user: one streaming request per task, measured and recorded in full.

`LLMUser` follows Locust's conventions (a `User` with a `@task` and a
`wait_time`), so `locust -f locustfiles/llm.py` works without tokenload. Each
task sends one request through the protocol adapter over the process's shared
`Transport`, fires exactly one Locust request (so Locust's request count, RPS
and failures mean LLM requests) carrying the record in its `context` for the
token statistics (`tokenstats`: TTFT, TPOT, ITL, e2e, tokens/s), and appends
the full record to the process's segment writer. Reported percentiles
come from those records, never from a live histogram.

Open-loop runs take their send times from `Arrivals`: one slot at a time, so a
free user sends at the scheduled time, and when every user is busy the next
free one sends late and records by how much (`scheduled_at`, `late_s`).
With `[stop] max_requests` / `max_tokens`, a user takes a ticket from its
process's `Budget` before each send and parks once the share is spent.

Every send first passes the process's `Pacer` (`tokenload.load.pacing`): a
429/529/503 holds all users of the process for the server's wait (or a capped
exponential back-off), and `[load] max_rps` / `max_tokens_per_min` space the
sends. The pushed-back request stays recorded as what it was, with the wait it
caused (`backoff_s`); each request records how long the gate held it (`held_s`)
and the rate-limit values its response carried. Nothing is retried unless
`[load] retry` says so, and then each retry is a new record whose `retry_of`
names the first request. Waits at the gate are interruptible like Locust's own
`wait_time`, so a run ends on time. After `[stop] config_errors` configuration
errors in a row the process's users park: the run is about to stop.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from functools import partial
from itertools import count
from typing import Any

import gevent
from greenlet import GreenletExit
from locust import User, task
from locust.exception import StopUser
from locust.user.task import LOCUST_STATE_RUNNING, LOCUST_STATE_STOPPING, LOCUST_STATE_WAITING

from tokenload import errors as ek
from tokenload.limits import parse_rate_headers
from tokenload.load import roles
from tokenload.load.arrivals import PARK_S, Arrivals, TraceArrivals
from tokenload.load.control import REQUEST_TYPE
from tokenload.load.pacing import pushed_back
from tokenload.load.records import CANCELLED, SegmentWriter
from tokenload.load.state import LoadState
from tokenload.load.tokenstats import CHUNK_TIMES_KEY, COUNTED_KEY, RECORD_KEY, TOKENS
from tokenload.load.warmup import DRAIN_POLL_S, MEASURE, Warmup
from tokenload.measure import TOKEN_TEXT
from tokenload.protocols.base import ProtocolAdapter
from tokenload.record import RequestRecord
from tokenload.search.evidence import LATE, ON_TIME
from tokenload.stream import StreamSession
from tokenload.transport.gevent_client import Transport
from tokenload.workload.prompts import PromptSource, RequestPlan
from tokenload.workload.sessions import Session
from tokenload.workload.traces import TraceRow

# How long a worker's user waits for the master's run message (sent right after the worker connects).
JOIN_WAIT_S = 30.0


class StreamError(Exception):
    """The request entry's failure in Locust's stats: the error kind and HTTP status only,
    so the error table groups by kind instead of one row per message."""


@dataclass
class ProcessContext:
    """Everything the users of one Locust process share (built once per process by the plugin)."""

    run_id: str
    worker: str
    tag: str
    protocol: str
    adapters: dict[str, ProtocolAdapter]
    transport: Transport
    prompts: PromptSource
    writer: SegmentWriter
    state: LoadState
    arrivals: Arrivals | TraceArrivals | None
    extra_body: dict[str, Any]
    think_time_s: float
    retry: int = 0
    warmup: Warmup | None = None
    late_s: float | None = None  # a search's SLO TTFT: a measured request without a first token by then is a miss
    on_time: bool = False  # ... and one with it in time is a hit (the SLO's only threshold is TTFT)

    def __post_init__(self) -> None:
        self._requests = count(1)
        self._users = count(1)

    def new_user_id(self) -> str:
        return f"{self.tag}-u{next(self._users)}"

    def new_request_id(self) -> str:
        return f"{self.tag}-{next(self._requests):07d}"


PROCESS: roles.Part[ProcessContext] = roles.Part("users' context")  # where users run: local or worker


class LLMUser(User):
    """Sends streaming requests to the scenario's channel, one at a time."""

    def wait_time(self) -> float:
        if self.parked:  # Locust stops a waiting user at once (a user inside a task gets the drain time)
            return PARK_S
        if self.ctx.arrivals is not None:
            return 0.0
        sessions = self.ctx.prompts.sessions
        if sessions is not None and self.session is not None and not self.session.over:
            return sessions.think_time_s
        return self.ctx.think_time_s

    def on_start(self) -> None:
        # A worker learns its run from the master's run message; a spawn message that overtook it waits for it.
        self.role = roles.of(self.environment)
        deadline = time.monotonic() + JOIN_WAIT_S
        while self.role.get(PROCESS) is None and time.monotonic() < deadline:
            gevent.sleep(0.05)
        self.ctx = self.role.need(PROCESS)
        self.user_id = self.ctx.new_user_id()
        self.parked = False
        self.session: Session | None = None
        self.sends = 0  # requests this user has sent (its first, at a search's step up, is warm-up)

    def _session(self) -> Session | None:
        """This user's conversation for the next request (a new one once the last is over); None without [session]."""
        sessions = self.ctx.prompts.sessions
        if sessions is None:
            return None
        if self.session is None or self.session.over:
            self.session = sessions.new(self.user_id)
        return self.session

    @task
    def stream(self) -> None:
        ctx = self.ctx
        state = ctx.state
        budget = state.budget
        if state.failfast.tripped or (budget is not None and not budget.admit()):
            self.parked = True  # the channel is misconfigured, or this process's share of the limits is spent
            return
        while ctx.arrivals is None and (state.probe_decided or self._surplus()
                                        or (ctx.warmup is not None and ctx.warmup.draining())):
            # a search's probe is decided (what it sent now would count for no probe), or it stepped down:
            # wait for the next probe, for Locust to stop the users it removed, or until the backlog is below
            # the level
            self._pause(DRAIN_POLL_S)
        if not self.sends and state.spread_s:  # a re-phased probe: its users' first requests spread over a span
            self._pause(random.uniform(0.0, state.spread_s))
        row: TraceRow | None = None
        if isinstance(ctx.arrivals, TraceArrivals):
            slot = ctx.arrivals.wait_row()
            scheduled, row = slot if slot is not None else (None, None)
        else:
            scheduled = ctx.arrivals.wait() if ctx.arrivals is not None else time.time()
        if scheduled is None:  # the open-loop plan is over: no more sends, wait for the stop
            self.parked = True
            return
        conversation = self._session()
        plan = ctx.prompts.next(conversation, row, self.user_id)
        answer: list[str] | None = None if conversation is None else []
        first: str | None = None
        record: RequestRecord | None = None
        for attempt in range(ctx.retry + 1):
            if attempt and (state.failfast.tripped or (budget is not None and not budget.admit())):
                break
            held = self._pace(plan.estimated_input_tokens + plan.max_tokens)
            record = self.send(plan, scheduled, held, first, answer)
            if record is None or not record["backoff_s"]:
                break
            first = first or record["request_id"]
        if conversation is not None and answer is not None:
            conversation.answered("".join(answer) if record is not None and record["status"] == "ok" else None)

    def _surplus(self) -> bool:
        """A search in one process stepped down, and Locust has yet to stop the users it removed (it does so a
        moment after the shape's tick; any of them may be this one): send nothing until it has. Else a user
        about to stop sends a request its stop cuts at once, which the channel still serves among the level's
        own. (On a worker the master sets its share: its users keep the step's backlog rule only.)"""
        warmup = self.ctx.warmup
        return (warmup is not None and warmup.drain and self.role.leads
                and self.role.user_count > self.ctx.state.users)

    def _pace(self, tokens: int) -> float:
        """Wait at the process's gate (holds, then caps); returns how long it took."""
        pacer = self.ctx.state.pacer
        start = time.monotonic()
        while True:
            held = pacer.held(time.monotonic())
            if held:
                self._pause(min(held, 1.0))  # ask again at least every second: a breaker pause may be lifted
                continue
            slot = pacer.book(tokens, time.monotonic())
            if slot > 0:
                self._pause(slot)
            if not pacer.held(time.monotonic()):  # else a push-back arrived meanwhile: wait it out, book again
                return time.monotonic() - start

    def _pause(self, seconds: float) -> None:
        """Sleep as Locust's `TaskSet.wait` does: a stopping run ends this user at once instead of after the drain."""
        if self._state == LOCUST_STATE_STOPPING:
            raise StopUser()
        self._state = LOCUST_STATE_WAITING
        gevent.sleep(seconds)
        if self._state == LOCUST_STATE_STOPPING:
            raise StopUser()
        self._state = LOCUST_STATE_RUNNING

    def send(self, plan: RequestPlan, scheduled_at: float, held_s: float = 0.0,
             retry_of: str | None = None, answer: list[str] | None = None) -> RequestRecord | None:
        """One request, recorded in full; returns its record (None when the run ended with it in flight).

        `answer`, for a session's turn, receives the answer's text as it streams (the next turn resends it).
        """
        ctx = self.ctx
        adapter = ctx.adapters[plan.model]
        state = ctx.state
        step, users, budget = state.step, state.users, state.budget
        phase = ctx.warmup.phase(first=not self.sends) if ctx.warmup is not None else MEASURE
        self.sends += 1
        sent_at = ctx.warmup.sent() if ctx.warmup is not None else 0.0
        if answer is not None:
            answer.clear()

        def keep_answer(text: str, kind: str) -> None:
            if kind == TOKEN_TEXT and answer is not None:
                answer.append(text)

        session = StreamSession(adapter, time.perf_counter(), estimated_input_tokens=plan.estimated_input_tokens,
                                max_tokens=plan.max_tokens, on_text=None if answer is None else keep_answer)
        counted: str | None = None  # how the request's SLO verdict was counted in flight, by its first token
        judged_at: float | None = None  # when it was counted (its record's judged_at)
        if ctx.late_s is not None and phase == MEASURE:
            def count_in_flight(how: str, streaming: int | None = None) -> None:
                nonlocal counted, judged_at
                counted, judged_at = how, time.time()
                self.role.need(TOKENS).in_flight(ctx.run_id, step, how, streaming)

            session.timeline.late_s, session.timeline.on_late = ctx.late_s, partial(count_in_flight, LATE)
            if ctx.on_time:
                session.timeline.on_time = partial(count_in_flight, ON_TIME)
        in_flight, cut_at = False, None
        try:
            request = adapter.prepare(plan.conversation, plan.max_tokens, ctx.extra_body)
            session.timeline.t0 = time.perf_counter()
            session.timeline.started_at = time.time()
            ctx.transport.stream(request, session)
        except GreenletExit:  # the user was stopped (a step down, the run's end) with this stream open
            in_flight, cut_at = True, time.time()  # keep what it got, and when it was cut
            raise
        except Exception as exc:  # a bug of ours: recorded as client_error, never hidden
            session.timeline.fail(ek.CLIENT_ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            if ctx.warmup is not None:
                ctx.warmup.finished(sent_at)
            record = session.record()
            if record["input_tokens_source"] == "estimate" and record["input_tokens"]:  # in the server's tokens
                record["input_tokens"] = ctx.prompts.calibration.scaled(record["input_tokens"])
            duration = record["duration_s"]
            info = parse_rate_headers(session.timeline.response_headers, time.time())
            pushback = not in_flight and pushed_back(record["http_status"], record["error_kind"])
            down = not in_flight and record["error_kind"] == ek.CONNECTION_REFUSED
            backoff = state.pacer.observe(pushback, info, time.monotonic(), down) if not in_flight else None
            record.update({
                "request_id": ctx.new_request_id(), "run_id": ctx.run_id, "worker": ctx.worker,
                "user_id": self.user_id, "step": step, "active_users": users, "scheduled_at": scheduled_at,
                "late_s": max(0.0, record["started_at"] - scheduled_at), "protocol": ctx.protocol,
                "model": plan.model, "max_tokens": plan.max_tokens, "prompt_tokens_target": plan.prompt_tokens_target,
                "in_flight": in_flight, "cut_at": cut_at, "finished_at": None if duration is None else record["started_at"] + duration,
                "backoff_s": backoff, "held_s": held_s, "retry_of": retry_of,
                "retry_after_s": info.server_wait() if pushback else None,
                "rl_requests_limit": info.requests_limit, "rl_requests_remaining": info.requests_remaining,
                "rl_tokens_limit": info.tokens_limit, "rl_tokens_remaining": info.tokens_remaining,
                "session_id": plan.session_id, "turn": plan.turn, "context_tokens": plan.estimated_input_tokens,
                "phase": phase,
                "judged_at": judged_at if judged_at is not None or in_flight or phase != MEASURE else time.time(),
                "judged_in_flight": counted,
            })
            if in_flight and record["status"] == "ok":
                record["status"] = CANCELLED
            ctx.writer.append(record)
            if budget is not None:
                budget.finished((record["input_tokens"] or 0) + (record["output_tokens"] or 0))
            if not in_flight:
                state.failfast.observe(record["error_kind"], record["http_status"], record["error_message"])
                ctx.prompts.observe(record, plan)
                self._fire(record, session.timeline.chunk_times, counted)
        return None if in_flight else record

    def _fire(self, r: RequestRecord, chunk_times: list[float], counted: str | None = None) -> None:
        """One Locust request per LLM request; the token metrics ride in `context` to `tokenstats`
        (`counted`: how its SLO verdict was counted in flight, by its first token)."""
        ok = r["status"] == "ok"
        exc = None if ok else StreamError(f"{r['error_kind']} (HTTP {r['http_status']})")
        tokens = (r["input_tokens"] or 0) + (r["output_tokens"] or 0)
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE, name=r["model"], response_time=(r["duration_s"] or 0.0) * 1000,
            response_length=tokens, exception=exc, context={RECORD_KEY: r, CHUNK_TIMES_KEY: chunk_times,
                                                                 COUNTED_KEY: counted})
