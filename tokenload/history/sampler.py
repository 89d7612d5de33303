"""The loop behind `tokenload watch`: a few small requests now and then, for days, within a budget.

Each sample sends `requests` sequential streaming requests with a fixed prompt
and output length (the same single-request client `probe` uses), then commits
the sample and its rows in one transaction under a fresh sample id: a watcher
killed mid-sample loses that sample only, and a restart never repeats one.

Kindness and thrift come first. A sample stops at its first failed request (a
channel that is down, or pushes back with 429/529, is recorded as errors and
asked again only at the next sample). The daily token budget is a hard ceiling:
the worst case a sample can cost (each request's input as the server last
counted it, else a generous local estimate, plus max_tokens) is booked in the
database before it starts, in the same transaction that checks what is left of
the day, or the sample is skipped and logged; a request whose worst case no
longer fits what is left of the booking (the server counted more input than
estimated) is skipped too. The ledger is the database, so a restart (or a second watcher of the
same channel on the same file) spends from the same budget.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenload.channel import Channel
from tokenload.dayclock import DAY_S, utc_offset_s
from tokenload.errors import ConfigError, HarnessError
from tokenload.exporter import LiveMetrics
from tokenload.history.store import HistoryStore, Sample, fingerprint_of, row_tokens, searched
from tokenload.servermetrics import scrape
from tokenload.transport.httpx_client import stream_once, timeouts
from tokenload.workload.prompts import PromptSource, RequestPlan
from tokenload.workload.scenario import Scenario

JITTER = 0.1  # each interval is `every` +- 10%, so samples do not lock onto a channel's own cycles
ESTIMATE_MARGIN = 1.5  # a server's tokenizer may count more than our estimate; the budget must hold anyway


def probe_scenario(prompt_tokens: int = 64, max_tokens: int = 32) -> Scenario:
    """A fixed probe; the default (64 in, at most 32 out) is cheap, yet long enough for a TPOT."""
    return Scenario.from_dict({"prompt": {"tokens": prompt_tokens, "calibrate": False},
                               "output": {"max_tokens": max_tokens}, "load": {"kind": "constant"}},
                              "watch probe", Path.cwd(), "watch-probe")


def day_bounds(t: float, period_s: float = DAY_S) -> tuple[float, float]:
    """Start and end (unix seconds) of the local day of `period_s` that holds `t`."""
    start = t - (t + utc_offset_s(t)) % period_s
    return start, start + period_s


@dataclass
class SampleResult:
    """What one sampling round did, for the status line and the tests."""

    sample_id: str
    started_at: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    budget_left: int | None = None
    server: dict[str, float] | None = None  # the server's gauges when the sample began (--server-metrics)

    @property
    def errors(self) -> int:
        return sum(1 for r in self.rows if r["status"] != "ok")

    @property
    def tokens(self) -> int:
        return sum(row_tokens(r) for r in self.rows)

    def p50(self, column: str) -> float | None:
        values = [r[column] for r in self.rows if r["status"] == "ok" and r.get(column) is not None]
        return statistics.median(values) if values else None


@dataclass(frozen=True)
class Stress:
    """`--stress SCENARIO@03:00,14:00`: a load test at set hours of the (folded) local day."""

    scenario: Scenario
    hours: tuple[float, ...]
    runs_dir: Path

    def next_at(self, t: float, period_s: float) -> float:
        """The first stress time after `t` (unix seconds)."""
        start, _end = day_bounds(t, period_s)
        times = [start + h / 24 * period_s for h in self.hours]
        return min(x if x > t else x + period_s for x in times)

    def worst_overshoot(self) -> int:
        """Tokens a run may spend past its token budget: every user's request in flight, at its largest.

        `[stop] max_tokens` is checked as requests end, so the requests in flight
        when it runs out still finish; their worst case is kept out of the cap.
        """
        sc = self.scenario
        users = sc.load.max_users if sc.load.open_loop or sc.load.search is not None else max(sc.load.users)
        if sc.prompt.dataset:
            from tokenload.workload.datasets import load_dataset

            prompt = max(row.conversation.estimated_tokens() for row in load_dataset(sc.prompt.dataset))
        else:
            prompt = (sc.prompt.tokens.upper if sc.prompt.tokens else None) or 0
        output = sc.output.max_tokens.upper or 0
        if not prompt or not output:
            raise ConfigError(f"--stress {sc.name}: its prompt and output lengths need an upper bound "
                              "(a fixed value, a sweep or a max) so the daily token budget can hold")
        return users * (math.ceil(prompt * ESTIMATE_MARGIN) + 8 + output)


def parse_stress(text: str, runs_dir: Path) -> Stress:
    """`ramp@03:00,14:00` -> the scenario and the hours; ConfigError naming the fix otherwise."""
    from tokenload.workload.scenario import load_scenario

    name, sep, times = text.rpartition("@")
    hours = []
    for item in times.split(","):
        hh, colon, mm = item.strip().partition(":")
        if not (sep and name and colon and hh.isdigit() and mm.isdigit() and int(hh) < 24 and int(mm) < 60):
            raise ConfigError(f"--stress {text!r}: write SCENARIO@HH:MM[,HH:MM...], e.g. ramp@03:00,14:00")
        hours.append(int(hh) + int(mm) / 60)
    return Stress(load_scenario(name), tuple(sorted(hours)), runs_dir)


@dataclass(frozen=True)
class WatchPlan:
    every_s: float = 900.0
    requests: int = 3
    period_s: float = DAY_S
    max_tokens_per_day: int = 0  # 0 = no budget
    stress: Stress | None = None
    server_metrics: tuple[str, ...] = ()  # the server's /metrics: its gauges are kept with each sample


class Watcher:
    """Samples one channel into a store until `stop` is set."""

    def __init__(self, store: HistoryStore, channel: Channel, plan: WatchPlan, probe: Scenario | None = None, *,
                 on_sample: Callable[[SampleResult], None] | None = None,
                 stop: threading.Event | None = None, metrics: LiveMetrics | None = None) -> None:
        self.store = store
        self.channel = channel
        self.plan = plan
        self.fingerprint = fingerprint_of(channel)
        probe = probe or probe_scenario()
        self.prompts = PromptSource(probe, (channel.model,), random.getrandbits(30))
        self.extra_body = probe.output.extra_body()
        self.on_sample = on_sample or (lambda result: None)
        self.stop = stop or threading.Event()
        self.metrics = metrics  # `--prometheus-port`: every request as it ends, one user while a sample runs
        self._input_seen = 0  # the server's input count of the last request: the best cost estimate
        # A channel that answered before (this watcher, or a sample in the store) and now refuses went down: it
        # is not a wrong address (`connection_refused`, load, not `bad_base_url`, a misconfiguration).
        self._answered = any(s.requests > s.errors for s in store.samples(self.fingerprint))

    def budget_left(self, now: float) -> int | None:
        if not self.plan.max_tokens_per_day:
            return None
        start, end = day_bounds(now, self.plan.period_s)
        return self.plan.max_tokens_per_day - self.store.tokens_used(self.fingerprint, start, end)

    def _worst_case(self, plan: RequestPlan) -> int:
        guess = max(self._input_seen, math.ceil(plan.estimated_input_tokens * ESTIMATE_MARGIN) + 8)
        return guess + plan.max_tokens

    def sample(self) -> SampleResult:
        """One sampling round, committed before it returns."""
        started = time.time()
        result = SampleResult(f"{int(started)}-{uuid.uuid4().hex[:12]}", started)
        plans = [self.prompts.next() for _ in range(self.plan.requests)]
        allowance: int | None = None  # tokens booked for this sample
        if self.plan.max_tokens_per_day:
            worst = sum(self._worst_case(p) for p in plans)
            if self._book(result.sample_id, started, worst):
                allowance = worst
            else:
                result.skipped, plans = len(plans), []
        if plans and self.plan.server_metrics:  # what the server was doing when the sample arrived
            result.server, _problem = scrape.snapshot(self.plan.server_metrics)
        if self.metrics is not None and plans:
            self.metrics.set_active_users(1)
        with httpx.Client(timeout=timeouts(self.channel), follow_redirects=False) as client:
            for index, plan in enumerate(plans):
                if self.stop.is_set():
                    break
                # The server's count, learnt from the first request, may raise the worst case.
                if allowance is not None and self._worst_case(plan) > allowance:
                    result.skipped = len(plans) - index
                    break
                record = stream_once(self.channel, plan.conversation, plan.max_tokens, extra_body=self.extra_body,
                                     client=client, answered=self._answered)
                self._answered = self._answered or record.get("http_status") is not None
                row = self._row(record, result.sample_id, index, plan)
                result.rows.append(row)
                if self.metrics is not None:
                    self.metrics.observe((row,))
                if allowance is not None:
                    allowance -= row_tokens(row)
                counted = record.get("input_tokens")
                if record.get("input_tokens_source") == "server" and counted:
                    self._input_seen = counted
                if record["status"] != "ok":
                    break  # a channel in trouble gets one request per sample, not three
        if self.metrics is not None:
            self.metrics.set_active_users(0)
        if result.rows or result.skipped:
            kind = "probe" if result.rows else "skipped"
            note = f"{result.skipped} request(s) skipped: daily token budget" if result.skipped else None
            server = json.dumps(result.server, sort_keys=True) if result.server else None
            self.store.add_sample(Sample(result.sample_id, self.fingerprint, kind, started, tokens=result.tokens,
                                         requests=len(result.rows), errors=result.errors, note=note, server=server),
                                  result.rows)
        else:
            self.store.release(result.sample_id)  # stopped before the first request
        result.budget_left = self.budget_left(started)
        return result

    def _book(self, sample_id: str, t: float, tokens: int) -> bool:
        start, end = day_bounds(t, self.plan.period_s)
        return self.store.reserve(Sample(sample_id, self.fingerprint, "reserved", t, tokens=tokens),
                                  self.plan.max_tokens_per_day, start, end)

    def _row(self, record: Mapping[str, Any], sample_id: str, index: int, plan: RequestPlan) -> dict[str, Any]:
        row = dict(record)
        row.update(request_id=f"{sample_id}-{index}", run_id=sample_id, worker="watch", user_id="watch", step=0,
                   active_users=1, scheduled_at=record["started_at"], prompt_tokens_target=plan.prompt_tokens_target,
                   in_flight=False)
        if record.get("duration_s") is not None:
            row["finished_at"] = record["started_at"] + record["duration_s"]
        return row

    def next_due(self, now: float) -> float:
        """When the next sample is due: `every` (jittered) after this channel's last one in the store.

        This is what makes a restart resume the rhythm instead of sampling at once.
        """
        last = self.store.last_sample_at(self.fingerprint)
        if last is None:
            return now
        return last + self.plan.every_s * random.uniform(1 - JITTER, 1 + JITTER)

    def stress_run(self, stress: Stress) -> str:
        """Run the stress scenario now, within the day's budget, and ingest it; returns its status line."""
        from tokenload.history.store import ingest_run
        from tokenload.load.runner import run_scenario
        from tokenload.rundir import MANIFEST_FILE

        now = time.time()
        scenario = stress.scenario
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        booking = f"{int(now)}-{uuid.uuid4().hex[:12]}"
        left = self.budget_left(now)
        if left is not None:
            cap = left - stress.worst_overshoot()
            if cap <= 0 or not self._book(booking, now, left):
                self.store.add_sample(Sample(booking, self.fingerprint, "skipped", now,
                                             note=f"stress {scenario.name} skipped: daily token budget"), [])
                return f"{stamp}  stress {scenario.name} SKIPPED (budget: {left:,} tokens left today)"
            stop = dataclasses.replace(scenario.stop, max_tokens=min(scenario.stop.max_tokens or cap, cap))
            scenario = dataclasses.replace(scenario, stop=stop)
        run_dir = stress.runs_dir / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            try:
                run_scenario(scenario, self.channel, run_dir)
            except HarnessError as exc:  # Locust failed: its records up to then still count, and watching goes on
                if not (run_dir / MANIFEST_FILE).is_file():
                    return f"{stamp}  stress {scenario.name} FAILED: {exc}"
            _channel, added, _total = ingest_run(self.store, run_dir)
        finally:
            self.store.release(booking)  # the run's own sample now carries what it spent
        left = self.budget_left(time.time())
        budget = "" if left is None else f", {left:,} tokens left today"
        return f"{stamp}  stress {scenario.name}: {added} requests{_capacity(run_dir)} -> {run_dir}{budget}"

    def run(self, max_samples: int | None = None, on_stress: Callable[[str], None] | None = None) -> int:
        """Sample until `stop` is set (or `max_samples` are done); returns the samples taken.

        A stress run whose time comes up runs before the next sample.
        """
        taken = 0
        due = self.next_due(time.time())
        stress = self.plan.stress
        stress_due = stress.next_at(time.time(), self.plan.period_s) if stress else math.inf
        while not self.stop.is_set() and (max_samples is None or taken < max_samples):
            if self.stop.wait(max(0.0, min(due, stress_due) - time.time())):
                break
            if stress is not None and time.time() >= stress_due:
                line = self.stress_run(stress)
                (on_stress or print)(line)
                stress_due = stress.next_at(time.time(), self.plan.period_s)
                continue
            result = self.sample()
            taken += 1
            self.on_sample(result)
            due = result.started_at + self.plan.every_s * random.uniform(1 - JITTER, 1 + JITTER)
        return taken


def status_line(result: SampleResult) -> str:
    """One line per sample: time, TTFT and TPOT medians, errors, the server's gauges (if scraped), budget left."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(result.started_at))
    kinds = sorted({str(r["error_kind"]) for r in result.rows if r["status"] != "ok"})
    errors = f"{result.errors}/{len(result.rows)}" + (f" ({', '.join(kinds)})" if kinds else "")
    budget = "no budget" if result.budget_left is None else f"{result.budget_left:,} tokens left today"
    skipped = f"  SKIPPED {result.skipped} (budget)" if result.skipped else ""
    server = f"  server {scrape.describe(result.server)}" if result.server else ""
    return (f"{stamp}  TTFT p50 {seconds(result.p50('ttft_s'))}  TPOT p50 {seconds(result.p50('tpot_s'))}  "
            f"errors {errors}{server}  {budget}{skipped}")


def _capacity(run_dir: Path) -> str:
    """`, capacity 8 users (boundary in [8, 9])` for a searched stress run, else nothing."""
    search = searched(run_dir)
    if search is None:
        return ""
    unit = "users" if search.over == "users" else "req/s"
    lo, hi = search.capacity, search.bounds()[1]
    if lo is None:
        return f", capacity below {search.min_level:g} {unit}" if hi is not None else ", no capacity decided"
    return f", capacity {lo:g} {unit} (boundary in [{lo:g}, {'?' if hi is None else f'{hi:g}'}])"
