"""`manifest.json`: what `tokenload run` writes beside the records when it finalises a run directory.

Written by `tokenload.load.rundirs.finalise`, read by the analysis, history and the commands. Blocks another
module owns in detail (the resolved scenario, the scheduler lag, the server metrics' sources) are plain
objects here; their own modules define them.

`MANIFEST_VERSION` goes up when a key is renamed or removed, or its meaning changes.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypedDict

MANIFEST_VERSION: Final = 1


class _StopRecord(TypedDict):
    rule: str  # its name in `tokenload.load.stoprules.RULES`
    reason: str  # the sentence, as `stop_reason`


class StopRecord(_StopRecord, total=False):
    """`stop`: the live rule that ended the run, by name and fields beside its sentence.

    The auto-stops (`[stop] breakpoint_*`) also name their scenario key, the step they judged, the
    condition in words, and the limit.
    """

    key: str  # the [stop] key: breakpoint_ttft_p95_s, breakpoint_error_rate
    step: int
    condition: str  # "TTFT p95 2.50 s > 1 s"
    value: float
    limit: float


class Host(TypedDict):
    hostname: str
    platform: str
    cpus: int | None


class RecordCounts(TypedDict):
    total: int
    in_flight: int
    per_worker: dict[str, int]
    written_per_worker: dict[str, int | None]
    courier: dict[str, Any]


class _Manifest(TypedDict):
    schema_version: Literal[1]
    run_id: str | None
    scenario: dict[str, Any]  # the scenario as resolved (`Scenario.to_dict`)
    channel: dict[str, Any] | None  # without secrets (`Channel.public`)
    versions: dict[str, str]
    host: Host
    started_at: float | None  # unix s
    ended_at: float
    started_at_iso: str | None
    ended_at_iso: str | None
    stop_reason: str | None
    stop: StopRecord | None
    drain: dict[str, Any] | None  # `tokenload.load.drain.Drain`
    workers_lost: list[str]
    plan: list[dict[str, Any]]  # the phases (`tokenload.load.plan.Phase`)
    steps: list[dict[str, Any]]  # each phase as run, with its start
    storms: list[dict[str, Any]]  # the error-storm breaker's pauses
    records: RecordCounts
    scheduler_lag: dict[str, Any]  # `tokenload.load.lag.summarise`
    open_loop_lateness: dict[str, Any]
    warnings: list[str]


class Manifest(_Manifest, total=False):
    """manifest.json."""

    server_metrics: dict[str, Any]  # what the sampler found (`tokenload.servermetrics.scrape.collect`)
