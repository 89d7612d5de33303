"""Live token statistics per run: TTFT, TPOT, ITL and e2e percentiles, tokens/s, error kinds.

Locust's own statistics count requests (one Locust request per LLM request);
token metrics are not requests, so they live here instead of as pseudo-requests
in Locust's table. Every process that runs users feeds its `TokenStats` from
the request event's `context` (the full record); the master merges what the
workers send.

Why a histogram and not raw values: workers ship their numbers to the master
every few seconds, and a run of hours would otherwise ship and keep every
value. Buckets are logarithmic with 1% width (values from 10 us to 10^4 s), so
a percentile is within 0.5% of the raw one, and merging is adding counts:
associative, so a worker's deltas merge the same in any order. Reported
percentiles (summary.json) still come from the raw records; these are the live
view and what the stop rules read.

Distributed: a worker keeps only what it has not sent yet. Its deltas ride on
Locust's `report_to_master` (every 3 s) and, at the worker's `test_stop`, on a
`TOKENSTATS_MESSAGE` of their own (Locust sends no stats report on stop). Each
delta is keyed by run id, so a late delta of a finished run never lands in the
next one, and a delta is cleared only once handed to the outgoing message:
nothing is lost or counted twice.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenload.errors import LOAD_KINDS, error_class
from tokenload.load import roles
from tokenload.load.messages import REPORT_KEY, TOKENSTATS_MESSAGE
from tokenload.load.stoprules import Counts, LiveThreshold
from tokenload.load.warmup import WARMUP
from tokenload.search.evidence import LATE, Evidence
from tokenload.slo import Slo
from tokenload.thresholds import Threshold

if TYPE_CHECKING:  # importing Locust patches the interpreter with gevent: only where Locust runs
    from locust.env import Environment

# Keys of the request event's `context` that carry one request's record and its chunk arrival times.
RECORD_KEY, CHUNK_TIMES_KEY = "tokenload_record", "tokenload_chunk_times"
# In a request event's context: how the request's SLO verdict was counted in flight (`evidence.LATE`,
# `evidence.ON_TIME`), or None.
COUNTED_KEY = "tokenload_counted"
SERIES_S = 2.0  # width of one point of the charts over time
# A point of the time series is kept whole (its histograms) until it is this much older than the newest point,
# long after the last worker delta for it came (every 3 s); then only what the charts draw of it is kept, so the
# master's memory does not grow with the run's length by a point's histograms (about 1.6 KB) every 2 s.
SERIES_KEEP_S = 60.0
METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 95, 99)

_LO = 1e-5
_GROWTH = 1.01
_LOG_GROWTH = math.log(_GROWTH)
_TOP = int(math.log(1e4 / _LO) / _LOG_GROWTH)
# Up to this many gaps a stream's ITL is counted in plain Python: numpy's fixed cost per call (~20 us) is more
# than that many gaps' worth, and it was paid on every request of the load generator's loop.
_SHORT = 64


def _bucket(value: float) -> int:
    if value <= _LO:
        return 0
    return min(_TOP, int(math.log(value / _LO) / _LOG_GROWTH))


class Hist(Counter[int]):
    """Counts of values (seconds) in 1%-wide logarithmic buckets."""

    def add(self, value: float) -> None:
        self[_bucket(value)] += 1

    def add_gaps(self, times: Sequence[float]) -> None:
        """Count the positive gaps between consecutive `times` (a stream's inter-token latencies)."""
        if len(times) <= _SHORT:
            for a, b in pairwise(times):
                if b > a:
                    self[_bucket(b - a)] += 1
        else:
            self.add_many(np.diff(np.asarray(times)))

    def add_many(self, values: np.ndarray) -> None:
        """Count the positive `values`, vectorised (for many at once: `add_gaps` of a long stream)."""
        values = values[values > 0]
        if len(values):
            idx = np.minimum(_TOP, (np.log(np.maximum(values, _LO) / _LO) / _LOG_GROWTH).astype(np.int64))
            keys, counts = np.unique(idx, return_counts=True)
            for k, c in zip(keys.tolist(), counts.tolist()):
                self[k] += c

    @property
    def n(self) -> int:
        return sum(self.values())

    def percentile(self, pct: float) -> float | None:
        """The value below which `pct`% of the counts fall (bucket's geometric middle); None when empty."""
        total = self.n
        if not total:
            return None
        rank = pct / 100 * total
        seen = 0
        for key in sorted(self):
            seen += self[key]
            if seen >= rank:
                return _LO * _GROWTH ** (key + 0.5)
        return None

    def beyond(self, bound: float, above: bool) -> int:
        """How many counts lie wholly above `bound` (`above`), else wholly below it: a bucket the bound cuts
        counts on neither side, so a decision on these counts never rests on a value it could not see."""
        if above:
            return sum(c for k, c in self.items() if k > 0 and _LO * _GROWTH ** k >= bound)
        return sum(c for k, c in self.items() if k < _TOP and _LO * _GROWTH ** (k + 1) <= bound)

    def pairs(self) -> list[list[int]]:
        return [[k, v] for k, v in self.items()]

    @classmethod
    def from_pairs(cls, pairs: Iterable[Sequence[int]]) -> Hist:
        hist = cls()
        for k, v in pairs:
            hist[int(k)] += int(v)
        return hist


@dataclass
class Cell:
    """Counts for one group of requests (a load step, or one point of the time series)."""

    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    users: int = 0
    first_at: float = math.inf  # earliest send (wall time)
    last_at: float = 0.0  # latest finish (wall time)
    kinds: Counter[str] = field(default_factory=Counter)
    hists: dict[str, Hist] = field(default_factory=lambda: {m: Hist() for m in METRICS})
    evidence: Evidence = field(default_factory=Evidence)  # measured requests against the run's SLO

    def observe(self, record: dict[str, Any], chunk_times: Sequence[float] | None, slo: Slo | None = None,
                counted: str | None = None) -> None:
        """Count one finished request (its token arrival times give the ITL; None: not counted here), judged
        against `slo` unless it was a warm-up request (`counted`: as `Evidence.count`)."""
        if slo is not None and record.get("phase") != WARMUP:
            self.evidence.count(slo, record, counted)
        self.requests += 1
        self.users = max(self.users, int(record.get("active_users") or 0))
        self.first_at = min(self.first_at, record["started_at"])
        self.last_at = max(self.last_at, record.get("finished_at") or record["started_at"])
        self.input_tokens += record.get("input_tokens") or 0
        self.output_tokens += record.get("output_tokens") or 0
        if record["status"] != "ok":
            self.errors += 1
            self.kinds[record.get("error_kind") or "unknown"] += 1
            return
        for metric in ("ttft", "tpot", "e2e"):
            value = record.get(f"{metric}_s")
            if value is not None:
                self.hists[metric].add(value)
        if chunk_times is not None:
            self.hists["itl"].add_gaps(chunk_times)

    def merge(self, other: Cell) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.users = max(self.users, other.users)
        self.first_at = min(self.first_at, other.first_at)
        self.last_at = max(self.last_at, other.last_at)
        self.kinds.update(other.kinds)
        for metric in METRICS:
            self.hists[metric].update(other.hists[metric])
        self.evidence.merge(other.evidence)

    def to_wire(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "users": self.users,
                "first_at": None if math.isinf(self.first_at) else self.first_at, "last_at": self.last_at,
                "kinds": dict(self.kinds), "hists": {m: h.pairs() for m, h in self.hists.items()},
                "evidence": self.evidence.to_dict()}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Cell:
        first = data.get("first_at")
        return cls(requests=data["requests"], errors=data["errors"], input_tokens=data["input_tokens"],
                   output_tokens=data["output_tokens"], users=data["users"],
                   first_at=math.inf if first is None else first, last_at=data["last_at"],
                   kinds=Counter(data["kinds"]),
                   hists={m: Hist.from_pairs(data["hists"].get(m, [])) for m in METRICS},
                   evidence=Evidence.from_dict(data.get("evidence") or {}))

    @property
    def span_s(self) -> float:
        return max(0.0, self.last_at - self.first_at) if self.requests else 0.0

    def summary(self, elapsed_s: float | None = None) -> dict[str, Any]:
        """Counts, rates and percentiles (seconds) of this cell, the record's names.

        Rates are over `elapsed_s` when the caller knows the wall time the cell covers (a step's, a run's), else
        over its first send to its last finish: 5 requests failing within 6 ms read 845 req/s that way.
        """
        span = max(elapsed_s or 0.0, self.span_s)
        out: dict[str, Any] = {
            "requests": self.requests, "errors": self.errors, "users": self.users,
            "error_rate": self.errors / self.requests if self.requests else 0.0,
            "rps": self.requests / span if span else None,
            "input_tok_s": self.input_tokens / span if span else None,
            "output_tok_s": self.output_tokens / span if span else None,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "error_kinds": dict(self.kinds.most_common()),
            "load_errors": sum(n for k, n in self.kinds.items() if k in LOAD_KINDS),
        }
        for metric in METRICS:
            for pct in PERCENTILES:
                out[f"{metric}_p{pct}_s"] = self.hists[metric].percentile(pct)
        return out


def live_thresholds(cell: Cell, thresholds: Sequence[Threshold]) -> tuple[LiveThreshold, ...]:
    """What the live statistics say of each `abort_on_fail` threshold (`stoprules.threshold_breached` decides):
    a percentile bound's counts beyond it, the errors (input errors aside), the requests that missed the SLO."""
    out = []
    for t in thresholds:
        assert t.bound is not None
        below = t.op in ("<", "<=")
        pct = t.percentile
        if pct is not None:
            hist = cell.hists[pct[0]]
            n, beyond = hist.n, hist.beyond(t.bound, above=below)
            allowed = 1 - pct[1] / 100 if below else pct[1] / 100
            what = f"{pct[0].upper()} {'at or above' if below else 'at or below'} {t.bound:g} s"
        elif t.name == "error_rate":
            n, allowed, what = cell.requests, t.bound, "requests failed"
            beyond = sum(c for kind, c in cell.kinds.items() if error_class(kind) != "input")
        else:  # slo_attainment
            n, allowed, what = cell.evidence.judged, 1 - t.bound, "judged requests missed the SLO"
            beyond = cell.evidence.judged - cell.evidence.met
        out.append(LiveThreshold(t.expr, n, beyond, allowed, what))
    return tuple(out)


def _cell(cells: dict[int, Cell], key: int) -> Cell:
    """The cell at `key`, made on first use: `setdefault(key, Cell())` built and dropped a Cell (seven
    counters) twice on every request the load generator finished."""
    cell = cells.get(key)
    if cell is None:
        cell = cells[key] = Cell()
    return cell


@dataclass
class Point:
    """An old point of the time series: what the charts draw of it (its percentiles as they were when it was
    kept whole; requests and tokens that still come for it are added)."""

    percentiles: tuple[float | None, ...]  # TTFT p50, p95, TPOT p50, p95
    output_tokens: int
    requests: int

    @classmethod
    def of(cls, cell: Cell) -> Point:
        return cls(tuple(cell.hists[m].percentile(p) for m in ("ttft", "tpot") for p in (50, 95)),
                   cell.output_tokens, cell.requests)


@dataclass
class RunStats:
    """One run's cells: per load step, per time-series point, and the whole run."""

    steps: dict[int, Cell] = field(default_factory=dict)
    series: dict[int, Cell] = field(default_factory=dict)
    points: dict[int, Point] = field(default_factory=dict)  # the series' points older than SERIES_KEEP_S

    def observe(self, record: dict[str, Any], chunk_times: Sequence[float] | None, slo: Slo | None = None,
                counted: str | None = None) -> None:
        """Count a finished request, judged against `slo` in its step (`counted`: as `Evidence.count`)."""
        step = int(record.get("step") or 0)
        _cell(self.steps, step).observe(record, chunk_times, slo, counted)
        point = int((record.get("finished_at") or record["started_at"]) // SERIES_S)
        old = self.points.get(point)
        if old is not None:
            old.requests += 1
            old.output_tokens += record.get("output_tokens") or 0
            return
        new = point not in self.series
        _cell(self.series, point).observe(record, None)
        if new:
            self._keep_recent()

    def merge(self, other: RunStats) -> None:
        for key, cell in other.steps.items():
            if key in self.steps:
                self.steps[key].merge(cell)
            else:
                self.steps[key] = cell
        for key, cell in other.series.items():
            if key in self.points:
                self._late(key, cell)
            elif key in self.series:
                self.series[key].merge(cell)
            else:
                self.series[key] = cell
        self._keep_recent()

    def _late(self, key: int, cell: Cell) -> None:
        """Requests that finished in an old point, counted after it was let go."""
        self.points[key].requests += cell.requests
        self.points[key].output_tokens += cell.output_tokens

    def _keep_recent(self) -> None:
        """Let go of the histograms of the points older than SERIES_KEEP_S before the newest."""
        if len(self.series) <= SERIES_KEEP_S / SERIES_S:
            return
        oldest = max(self.series) - SERIES_KEEP_S / SERIES_S
        for key in [k for k in self.series if k < oldest]:
            self.points[key] = Point.of(self.series.pop(key))

    def total(self) -> Cell:
        out = Cell()
        for cell in self.steps.values():
            out.merge(cell)
        return out

    def to_wire(self) -> dict[str, Any]:
        return {"steps": [[k, c.to_wire()] for k, c in self.steps.items()],
                "series": [[k, c.to_wire()] for k, c in self.series.items()]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RunStats:
        return cls(steps={int(k): Cell.from_wire(c) for k, c in data["steps"]},
                   series={int(k): Cell.from_wire(c) for k, c in data["series"]})

    def timeline(self) -> dict[str, list[Any]]:
        """The charts' points: time (unix s), TTFT/TPOT p50/p95 (s) and tokens/s per point."""
        out: dict[str, list[Any]] = {k: [] for k in ("t", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s",
                                                      "output_tok_s", "rps")}
        for key in sorted([*self.points, *self.series]):
            point = self.points.get(key) or Point.of(self.series[key])
            out["t"].append(key * SERIES_S)
            for name, value in zip(("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s"), point.percentiles):
                out[name].append(value)
            out["output_tok_s"].append(point.output_tokens / SERIES_S)
            out["rps"].append(point.requests / SERIES_S)
        return out


class TokenStats:
    """One process's token statistics, by run id.

    On the master (and a local runner) it is cumulative; on a worker it holds
    only what has not been sent to the master yet (`take_wire`).
    """

    def __init__(self, slo: Slo | None = None) -> None:
        self.runs: dict[str, RunStats] = {}
        self.slo = slo  # each finished request is judged against it where it finished (a search decides by it)
        # Called after each request counted here (a search in one process decides its probe then: `shapes`).
        self.watch: Callable[[], None] | None = None

    def run(self, run_id: str) -> RunStats:
        stats = self.runs.get(run_id)
        if stats is None:
            stats = self.runs[run_id] = RunStats()
        return stats

    def observe(self, record: dict[str, Any], chunk_times: Sequence[float] | None = None,
                counted: str | None = None) -> None:
        self.run(str(record.get("run_id") or "")).observe(record, chunk_times, self.slo, counted)
        if self.watch is not None:
            self.watch()

    def in_flight(self, run_id: str, step: int, counted: str, streaming: int | None = None) -> None:
        """A measured request of `step` was decided by its first token while in flight: still without it past
        the SLO's TTFT (`LATE`: `Evidence.late`, with how many requests were `streaming` meanwhile), or with it
        in time under an SLO of TTFT alone (`ON_TIME`)."""
        evidence = _cell(self.run(run_id).steps, step).evidence
        if counted == LATE:
            evidence.late(streaming)
        else:
            evidence.on_time()
        if self.watch is not None:
            self.watch()

    def take_wire(self) -> dict[str, Any]:
        """Everything not sent yet, as msgpack-friendly data, and forget it."""
        runs, self.runs = self.runs, {}
        return {run_id: stats.to_wire() for run_id, stats in runs.items()}

    def merge_wire(self, data: dict[str, Any]) -> None:
        for run_id, wire in data.items():
            self.run(run_id).merge(RunStats.from_wire(wire))


TOKENS: roles.Part[TokenStats] = roles.Part("token statistics")


def install(environment: Environment, slo: Slo | None = None) -> TokenStats:
    """Feed this process's `TokenStats` from the request events and merge workers' deltas on the master."""
    role = roles.of(environment)
    stats = role.put(TOKENS, TokenStats(slo))
    events = environment.events

    def on_request(context: dict[str, Any] | None = None, **_: Any) -> None:
        record = context.get(RECORD_KEY) if context else None
        if context and record is not None:
            stats.observe(record, context.get(CHUNK_TIMES_KEY), context.get(COUNTED_KEY))

    events.request.add_listener(on_request)
    if role.follows:
        def on_report(client_id: str, data: dict[str, Any], **_: Any) -> None:
            data[REPORT_KEY] = stats.take_wire()

        def on_stop(**_: Any) -> None:
            role.to_master(TOKENSTATS_MESSAGE, stats.take_wire())

        events.report_to_master.add_listener(on_report)
        events.test_stop.add_listener(on_stop)
    elif role.has_workers:
        def on_worker_report(client_id: str, data: dict[str, Any], **_: Any) -> None:
            stats.merge_wire(data.get(REPORT_KEY) or {})

        events.worker_report.add_listener(on_worker_report)
        role.listen(TOKENSTATS_MESSAGE, lambda environment, msg, **_: stats.merge_wire(msg.data or {}))
    return stats


def current_run(environment: Environment) -> RunStats:
    """The merged token statistics of the run in progress (or the last one) on this master or local process.

    What the stop rules read: `current_run(env).total()` for the whole run so far,
    `current_run(env).steps[step]` for one load step (`.summary()` for rates and percentiles).
    """
    stats = roles.of(environment).need(TOKENS)
    opts = environment.parsed_options
    return stats.run(str(getattr(opts, "run_id", "") or ""))


@dataclass(frozen=True)
class Snapshot:
    """Cumulative counters of the current run at one moment (from `tokenstats.current_run`)."""

    counts: Counts
    ttft: Hist
    tpot: Hist

    @property
    def requests(self) -> int:
        return self.counts.requests

    @property
    def failures(self) -> int:
        return self.counts.failures

    @classmethod
    def take(cls, environment: Environment) -> Snapshot:
        total = current_run(environment).total()
        load_failures = sum(n for kind, n in total.kinds.items() if error_class(kind) == "load")
        counts = Counts(total.requests, total.errors, load_failures, total.input_tokens + total.output_tokens)
        return cls(counts, Hist(total.hists["ttft"]), Hist(total.hists["tpot"]))

    def since(self, earlier: Snapshot) -> dict[str, Any]:
        """Counts and TTFT/TPOT percentiles (s) between `earlier` and this snapshot."""
        counts = self.counts.minus(earlier.counts)
        out: dict[str, Any] = {"requests": counts.requests, "failures": counts.failures,
                               "load_failures": counts.load_failures, "load_error_rate": counts.load_error_rate}
        out["error_rate"] = out["failures"] / out["requests"] if out["requests"] else 0.0
        for name, now, before in (("ttft", self.ttft, earlier.ttft), ("tpot", self.tpot, earlier.tpot)):
            diff = Hist(now - before)
            for pct in (50, 95):
                out[f"{name}_p{pct}_s"] = diff.percentile(pct)
        return out
