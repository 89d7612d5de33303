"""One probe's verdict from its requests: a sequential decision on the SLO attainment and the error rate.

At every request counted (with workers, once a second) a probe looks at the 95% Wilson intervals of its
attainment (the share of judged requests that met every SLO term) and of its load-error rate. It fails when
either lies wholly on the wrong side of its bound (after `MIN_FAIL_REQUESTS`: the first answers at a new level
still meet the queue the change of level left), passes when the attainment's lies wholly above `target`
(after `MIN_REQUESTS`, so one lucky early answer decides nothing), and is undecided when `max_probe_s` runs
out first: a level at the boundary can need more requests than a probe may spend, and the search says so.

A pass that only steers the search is decided at 70% (`STEER_Z`; on the way up, `RISING_REQUESTS` hits in a
row): the levels probed after it test it again, so a wrong steer costs probes, never the answer. The level
named the capacity must pass at 95% (`confident`: a second trial's own 80%, `AGREE_Z`, and both trials pooled
at 95%), the guard against a verdict that repeated looks at a growing sample decided by chance.

A request still without its first token at the SLO's `ttft_s` is counted as a miss then (`Evidence.late`),
and, when TTFT is the only term, one whose first token came in time as a hit (`Evidence.on_time`), so a
level's requests are judged `ttft_s` after they were sent, not when their streams end. In one process a late
request also counts the streams running while it waited (`Evidence.streams`): the slot count `bisect` uses.

The rules in full: docs/scenarios.md, "Breakpoint search"; what they cost: docs/benchmarks.md.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenload.slo import COLUMN, Slo, missed_terms, verdict

Verdict = Literal["pass", "fail", "undecided"]
# A request's SLO verdict counted while it was in flight (`Evidence.late`, `Evidence.on_time`).
LATE, ON_TIME = "late", "on_time"
Z95 = 1.959963984540054
STEER_Z = 1.0364333894937898  # a two-sided 70% interval: enough to steer, never to name the capacity
AGREE_Z = 1.2815515655446004  # a two-sided 80% interval: a second trial's own, beside the 95% of both pooled
MIN_REQUESTS = 10
# On the way up, a level whose first this many requests all met the SLO is left for the next (`rising`).
RISING_REQUESTS = 5
# A fail needs this many judged requests too: the first answers after a level change meet the queue it left.
MIN_FAIL_REQUESTS = 5
# A level whose 95% interval holds the target and lies within this much of it either side is at the edge (`at_edge`).
EDGE_MARGIN = 0.05


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """95% Wilson score interval of a proportion (sound at small n and near 0 or 1); None without data."""
    if n <= 0:
        return None
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def late_first_token(slo: Slo, ttft_s: float | None, waited_s: float | None) -> bool:
    """A request's first token came (`ttft_s`), or had not come after `waited_s`, past the SLO's TTFT."""
    limit = slo.ttft_s
    if limit is None:
        return False
    if ttft_s is not None and not math.isnan(ttft_s):
        return ttft_s > limit
    return waited_s is not None and not math.isnan(waited_s) and waited_s > limit


def cut_wait(record: dict[str, Any]) -> float | None:
    """How long a stream the run cut open (`in_flight`) had been waiting: until the cut (`cut_at`, or its
    `duration_s`); None when its record does not say."""
    duration = record.get("duration_s")
    if duration is not None and not math.isnan(duration):
        return float(duration)
    started, cut = record.get("started_at"), record.get("cut_at")
    if started is None or cut is None or math.isnan(started) or math.isnan(cut):
        return None
    return float(cut) - float(started)


@dataclass
class Evidence:
    """What one probe's measured requests showed so far (counted where the requests finish, or where their
    first token decided them: `late`, `on_time`)."""

    judged: int = 0  # successes and load-class failures (configuration and input errors are not judged)
    met: int = 0  # judged requests that met every SLO term
    load_errors: int = 0
    missed_by: Counter[str] = field(default_factory=Counter)  # SLO term ("ttft", ..., "errors") -> misses
    error_kinds: Counter[str] = field(default_factory=Counter)  # load-class error kind -> count
    early: int = 0  # in flight with a first token in time, under an SLO of TTFT alone: met unless they fail later
    # how many requests were streaming each time one was late (a run in one process: `served`) -> times
    streams: Counter[int] = field(default_factory=Counter)

    @property
    def attainment(self) -> float | None:
        return self.met / self.judged if self.judged else None

    @property
    def with_early(self) -> tuple[int, int]:
        """(met, judged) with the early hits counted as met. In a trial's share of a growing count (`minus`), a hit
        the trial before counted early that failed here takes one met away: never below zero."""
        met = max(0, self.met + self.early)
        return met, max(met, self.judged + self.early)

    @property
    def served(self) -> int | None:
        """How many requests the channel streamed at once while others waited for their first token: the 90th
        percentile of the counts of streaming requests taken when a request was late (None: no count). Above a
        slot-limited channel's capacity its slots stream while requests queue, so this is its slot count; a
        channel slowed by something else than a queue shows about as many as were sent. Not the median (a
        slot busy with a prompt before its first token streams nothing yet), nor the maximum (which one count
        taken between a stream's last token and the read of its end would raise)."""
        n = self.streams.total()
        return sorted(self.streams.elements())[math.ceil(0.9 * n) - 1] if n else None

    def to_dict(self) -> dict[str, Any]:
        return {"judged": self.judged, "met": self.met, "load_errors": self.load_errors,
                "missed_by": dict(self.missed_by), "error_kinds": dict(self.error_kinds), "early": self.early,
                "streams": [[k, n] for k, n in self.streams.items()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evidence:
        return cls(judged=int(data.get("judged", 0)), met=int(data.get("met", 0)),
                   load_errors=int(data.get("load_errors", 0)), missed_by=Counter(data.get("missed_by") or {}),
                   error_kinds=Counter(data.get("error_kinds") or {}), early=int(data.get("early", 0)),
                   streams=Counter({int(k): int(n) for k, n in data.get("streams") or []}))

    def minus(self, earlier: Evidence) -> Evidence:
        """The evidence gathered since `earlier` (a snapshot of the same, growing counts)."""
        return Evidence(self.judged - earlier.judged, self.met - earlier.met, self.load_errors - earlier.load_errors,
                        self.missed_by - earlier.missed_by, self.error_kinds - earlier.error_kinds,
                        self.early - earlier.early, self.streams - earlier.streams)

    def merge(self, other: Evidence) -> None:
        self.judged += other.judged
        self.met += other.met
        self.load_errors += other.load_errors
        self.missed_by.update(other.missed_by)
        self.error_kinds.update(other.error_kinds)
        self.early += other.early
        self.streams.update(other.streams)

    def late(self, streaming: int | None = None) -> None:
        """A request still waiting for its first token past the SLO's `ttft_s`: a TTFT miss whatever follows,
        counted while it is in flight (the load side arms the deadline) so a failing level fails after its
        first late requests instead of after they finish, tokens later. Its record is not counted again.
        `streaming`: how many requests were streaming meanwhile (`served`), counted where every stream is seen."""
        self.judged += 1
        self.missed_by["ttft"] += 1
        if streaming is not None:
            self.streams[streaming] += 1

    def on_time(self) -> None:
        """A request whose first token came within `ttft_s`, the SLO's only threshold: met unless it fails
        later. Held in `early` until its record is counted (`count(..., ON_TIME)`)."""
        self.early += 1

    def count(self, slo: Slo, record: dict[str, Any], counted: str | None = None) -> None:
        """Add one finished request (a record's fields) judged against `slo`; `counted`: its verdict was counted
        in flight (`LATE`: not again; `ON_TIME`: now for good). A stream the run cut (in flight at a step down or
        the end) counts only as far as its first token decided it, as the run counted it live: late, or in time
        under an SLO of TTFT alone."""
        if counted == LATE:
            return
        if counted == ON_TIME:
            self.early -= 1
        if record.get("in_flight"):
            ttft = record.get("ttft_s")
            if late_first_token(slo, ttft, cut_wait(record)):
                self.late()
            elif slo.first_token_decides and ttft is not None and not math.isnan(ttft):
                self.judged += 1
                self.met += 1
            return
        status, kind = record["status"], record.get("error_kind")
        values = {m: record.get(column) for m, column in COLUMN.items()}
        met = verdict(slo, status, kind, values)
        if met is None:
            return
        self.judged += 1
        if status != "ok":
            self.load_errors += 1
            self.missed_by["errors"] += 1
            self.error_kinds[kind or "unknown"] += 1
        elif met:
            self.met += 1
        else:
            self.missed_by.update(missed_terms(slo, values))


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    attainment: float | None
    ci: tuple[float, float] | None
    error_rate: float | None
    binding: str | None  # the SLO term missed most ("errors" when the error rate decided), for a fail
    confident: bool = True  # a pass whose 95% interval (not only the steering one) lies above the target
    n: int = 0  # the requests it counted: finished ones, and for all but a confident pass the early hits
    early: int = 0  # of `n`, early hits (`Evidence.early`)
    edge: bool = False  # undecided because the level's attainment is within `EDGE_MARGIN` of the target


def at_edge(ci: tuple[float, float], target: float) -> bool:
    """The 95% interval holds the target and lies within `EDGE_MARGIN` of it either side: the level meets the
    SLO about as often as the target asks, and more requests would buy a pass or a fail on one side of a
    margin nobody can act on (a level at 0.917 against 0.9 needs ~1,000 requests to pass at 95%, ~300 to be
    at the edge)."""
    return target - EDGE_MARGIN <= ci[0] < target <= ci[1] <= target + EDGE_MARGIN


def binding_term(evidence: Evidence) -> str | None:
    """The SLO term that failed most often (ties: the earlier in ttft, tpot, itl, e2e, errors)."""
    order = ("ttft", "tpot", "itl", "e2e", "errors")
    ranked = sorted((t for t in order if evidence.missed_by.get(t)), key=lambda t: (-evidence.missed_by[t], order.index(t)))
    return ranked[0] if ranked else None


def decide(evidence: Evidence, slo: Slo, elapsed_s: float, max_probe_s: float,
           min_requests: int = MIN_REQUESTS, steer: bool = False, prior: tuple[int, int] = (0, 0),
           rising: bool = False) -> Decision | None:
    """The probe's verdict now, or None to keep gathering evidence.

    `steer`: a pass at 70% will do, or with `rising` (no level failed yet) `RISING_REQUESTS` hits without a
    miss. `prior`: (met, judged) of the level's earlier passing trial, pooled with this one's for the 95% pass
    of a second trial. The early hits (`Evidence.early`) count everywhere but in a confident pass's own 80%,
    which counts finished requests only: a channel that cuts streams after their first token cannot be named
    able to carry a level on first tokens alone.
    """
    met, n = evidence.with_early
    early = n - evidence.judged
    ci = wilson_interval(met, n)
    errors = wilson_interval(evidence.load_errors, n)
    attainment = met / n if n else None
    error_rate = evidence.load_errors / n if n else None
    if ci is not None and errors is not None and n >= MIN_FAIL_REQUESTS:
        if errors[0] > slo.max_error_rate:
            return Decision("fail", attainment, ci, error_rate, "errors", n=n, early=early)
        if ci[1] < slo.target:
            return Decision("fail", attainment, ci, error_rate, binding_term(evidence), n=n, early=early)
        finished = evidence.judged
        own = wilson_interval(evidence.met, finished, AGREE_Z)
        pooled = wilson_interval(met + prior[0], n + prior[1])
        if finished >= min_requests and own is not None and own[0] >= slo.target and pooled is not None \
                and pooled[0] >= slo.target:
            return Decision("pass", attainment, ci, error_rate, None, n=n, early=early)
        steering = wilson_interval(met, n, STEER_Z)
        if steer and ((n >= min_requests and steering is not None and steering[0] >= slo.target)
                      or (rising and n >= RISING_REQUESTS and met == n)):
            return Decision("pass", attainment, ci, error_rate, None, confident=False, n=n, early=early)
        if n >= min_requests and pooled is not None and at_edge(pooled, slo.target):
            return Decision("undecided", attainment, ci, error_rate, binding_term(evidence), n=n, early=early,
                            edge=True)
    if elapsed_s >= max_probe_s:
        return Decision("undecided", attainment, ci, error_rate, binding_term(evidence), n=n, early=early)
    return None
