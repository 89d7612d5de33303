"""Every message tokenload's load processes send each other over Locust's channel, and what it carries.

A master runs the plan and no users; its workers run the users (`roles.py`).
Locust carries custom messages between them; each name below is one kind,
sent one way, and the TypedDict beside it is its payload (msgpack: plain data).
A local process sends none of them: it is master and worker in one.
"""

from __future__ import annotations

from typing import Any, TypedDict

# master -> workers
STEP_MESSAGE = "tokenload_step"  # a phase begins (`control.RunControl.enter`): Step
PAUSE_MESSAGE = "tokenload_pause"  # the error-storm breaker holds or releases every send: Pause
DRAIN_MESSAGE = "tokenload_drain"  # how long to let open streams finish at the coming stop (`drain.py`): Drain
LIVE_MESSAGE = "tokenload_live_users"  # the step's real user count once a worker was lost (`census.py`): LiveUsers
RUN_MESSAGE = "tokenload_run"  # the run to take part in, at a worker's hello and every start (`series.py`): Announcement
ACK_MESSAGE = "tokenload_ack"  # a courier batch or state arrived (`courier.py`): Ack
# workers -> master
HELLO_MESSAGE = "tokenload_hello"  # a worker connected and waits for RUN_MESSAGE; no payload
BUDGET_MESSAGE = "tokenload_budget_spent"  # this worker's share of the limits is used up: BudgetSpent
FAILFAST_MESSAGE = "tokenload_config_errors"  # configuration errors in a row, at each one: ConfigErrors
BATCH_MESSAGE = "tokenload_batch"  # one spooled segment of records, or the worker's state (`courier.py`): Batch
TOKENSTATS_MESSAGE = "tokenload_tokenstats"  # the last token statistics, at the test's stop (`tokenstats.py`)
# ... and the key that carries them, every 3 s, in Locust's own report from each worker to its master.
REPORT_KEY = "tokenload_tokenstats"


class _StepRequired(TypedDict):
    step: int
    start_s: float
    end_s: float
    users: int
    rate: float | None  # the whole run's rate; each worker takes rate / workers
    workers: int
    started_at: float  # wall time of the phase's start on the shape's clock
    plan_ends_at: float
    spawn_rate: float | None  # the phase's own rate of starting users (a search's re-phased probe); None: the scenario's
    spread_s: float  # its new users' first requests spread over this long (`Phase.spread_s`)


class Step(_StepRequired, total=False):
    budget: dict[str, list[int | None]]  # worker id -> its [max_requests, max_tokens] share (None: unlimited)


class Pause(TypedDict):
    paused: bool


class Drain(TypedDict):
    drain_s: float


class LiveUsers(TypedDict):
    step: int
    users: int


class Announcement(TypedDict):
    run_id: str
    run_dir: str  # the master's path; a worker with its own --run-dir maps it to a sibling of that
    number: int  # the start it belongs to (1 headless; 2, 3, ... for later starts in the web UI)
    scenario: dict[str, Any]  # the master's resolved scenario (`Scenario.to_dict`)
    channel: dict[str, Any] | None  # the channel without secrets


class _AckRequired(TypedDict):
    run_id: str
    seq: int | None  # the batch's segment number; None for a state


class Ack(_AckRequired, total=False):
    sealed: bool  # the run is finalised: it takes nothing more
    state_at: float | None  # the state acknowledged (its `updated_at`): every batch it counts is in
    segments: int  # how many batches that state counts


class BudgetSpent(TypedDict):
    worker: str
    reason: str | None
    sent: int
    tokens: int


class ConfigErrors(TypedDict):
    worker: str
    streak: int
    last: dict[str, Any] | None  # the latest error: kind, HTTP status, message


class Batch(TypedDict):
    run_id: str
    worker: str
    seq: int | None  # None: the state alone
    data: bytes | None  # the segment file's Arrow IPC bytes
    state: dict[str, Any]  # the worker's state file (records written, lag, done)
