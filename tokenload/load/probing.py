"""A `[load] kind = "search"` run: the shape's probes, each held until its evidence decides it.

The master (or local runner) owns one `Prober`. Each probe is a step of the run
(its records carry the step number): the shape asks `next_phase()` for the
level to hold, looks at the probe's live evidence once a tick (`look`; a run in
one process also at every request counted: `ScenarioShape._decide_now`), and on
a decision records the probe in the search and asks again. The evidence is
the probe step's `Evidence` in the run's live token statistics: every process
judges each measured request against the SLO where it finished (warm-up
requests of each probe, sent in its first `probe_warmup_s`, are not counted),
and workers' counts reach the master with their stats reports.

The search's state is written to `RUN_DIR/search.json` after every probe (and
read back at start, so `tokenload run --resume` continues a stopped search);
the analysis turns it into summary.json's `search`.

A probe that failed on the channel's rate limit (its load errors mostly 429s)
is not a capacity verdict: the search stops and says the rate limit bound it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tokenload import errors as ek
from tokenload.load.plan import Phase
from tokenload.load.records import write_json
from tokenload.load.tokenstats import Cell
from tokenload.search.bisect import Probe, Rephase, Search
from tokenload.search.evidence import Decision, Evidence, decide
from tokenload.search.resume import SEARCH_FILE, new_search
from tokenload.slo import Slo
from tokenload.workload.scenario import Scenario

# A failing probe whose load errors are mostly rate limits (429) is the channel's quota, not its capacity.
RATE_LIMIT_SHARE = 0.5
# Before a re-phased trial every user stops for this long: one tick of the shape, and the channel frees the
# streams cut at their next token.
REPHASE_PAUSE_S = 1.0
# A pass stands once its evidence still passes this long (or half the SLO's TTFT, if longer) after it first
# did: a queue serves first what was sent first, so a round of requests sent together has its hits judged
# before its misses, a tenth of a second or more on a busy machine (24 slots, identical answers: 32 users
# passed on the five first hits of a round whose eight misses came next).
PASS_SETTLE_S = 0.1


class Prober:
    """The search as the shape plays it: which level now, and is the current probe decided yet."""

    def __init__(self, scenario: Scenario, run_dir: Path, run_id: str) -> None:
        self.scenario = scenario
        self.slo: Slo = scenario.slo
        spec = scenario.load.search
        assert spec is not None
        self.spec = spec
        self.path = run_dir / SEARCH_FILE
        self.run_id = run_id
        self.search = self._load() or new_search(scenario)
        self.step = 0
        self.current: Phase | None = None
        self.pausing = False  # the current phase is the pause before a re-phased trial (`Search.rephased`)
        self._rephased: Rephase | None = None  # how the current probe started after such a pause
        self._request_s = 1.0  # the latest median request time of a decided probe: a spread start's span
        self._passing_since: float | None = None  # when the current probe's evidence first passed
        self._started_at = 0.0
        self._start_s = 0.0
        self.decided = False  # the current probe is recorded; `next_phase` has not moved on yet
        self.write()

    def _load(self) -> Search | None:
        """A search already under way in this run directory (`--resume` copied it here)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return Search.from_dict(data)

    def next_phase(self, elapsed_s: float) -> Phase | None:
        """The next probe's phase starting now on the shape's clock, or None when the search is over."""
        level = self.search.next_level()
        if level is None:
            self.current = None
            if self.search.out_of_probes:
                self.search.exhaust()
                self.write()
            return None
        self.decided = False
        self._passing_since = None
        self.step += 1
        rephased = self.search.rephased(level)
        if rephased and not self.pausing and self.current is not None:
            # every user stops (their streams cut) and the next phase starts them all anew
            self.pausing = True
            self.current = Phase(self.step, elapsed_s, elapsed_s + REPHASE_PAUSE_S, 0, None)
            return self.current
        self.pausing, self._rephased = False, rephased
        self._start_s = elapsed_s
        self._started_at = time.time()
        users, rate = (int(level), None) if self.spec.over == "users" else (self.scenario.load.max_users, level)
        # re-phased, every user starts in Locust's first batch; spread, each sends its first request at a random
        # moment of a request's time, so that the slots' phases spread
        spawn = max(self.scenario.load.spawn_rate, users) if rephased else None
        spread = self._request_s if rephased == "spread" else 0.0
        self.current = Phase(self.step, elapsed_s, elapsed_s + self.spec.max_probe_s, users, rate, spawn, spread)
        return self.current

    def look(self, cell: Cell | None, elapsed_s: float) -> bool:
        """Decide the current probe if its evidence allows (True: it is decided and recorded, now or before)."""
        phase = self.current
        if phase is None or self.decided:
            return self.decided
        if self.pausing:  # a pause decides nothing: it is over when its time is
            return elapsed_s >= phase.end_s
        level = float(phase.users if phase.rate is None else phase.rate)
        cell = cell or _EMPTY
        evidence = cell.evidence
        decision = decide(evidence, self.slo, elapsed_s - self._start_s, self.spec.max_probe_s,
                          min_requests=self.search.min_requests(level), steer=not self.search.full_evidence(level),
                          prior=self.search.prior(level), rising=self.search.rising)
        if decision is not None and decision.verdict == "pass":
            # a pass stands once it still does a moment later: the misses of the requests sent with its hits
            self._passing_since = elapsed_s if self._passing_since is None else self._passing_since
            if elapsed_s - self._passing_since < max(PASS_SETTLE_S, (self.slo.ttft_s or 0.0) / 2):
                return False
        else:
            self._passing_since = None
            if decision is None:
                return False
        self._record(phase, decision, cell, evidence, elapsed_s)
        self._request_s = cell.hists["e2e"].percentile(50) or self._request_s
        self.decided = True
        return True

    def _record(self, phase: Phase, decision: Decision, cell: Cell, evidence: Evidence, elapsed_s: float) -> None:
        level = float(phase.users if phase.rate is None else phase.rate)
        trial = 1 + sum(1 for p in self.search.probes if p.level == level)
        tokens = cell.input_tokens + cell.output_tokens
        self.search.record(Probe(
            level=level, verdict=decision.verdict, trial=trial, n=decision.n, early=max(0, decision.early),
            served=evidence.served, edge=decision.edge, rephased=self._rephased,
            attainment=decision.attainment,
            ci=list(decision.ci) if decision.ci is not None else None, error_rate=decision.error_rate,
            binding=decision.binding, duration_s=round(elapsed_s - self._start_s, 3), tokens=tokens,
            step=phase.step, confident=decision.confident, started_at=self._started_at, decided_at=time.time(),
            run_id=self.run_id,
            error_kinds=dict(evidence.error_kinds), missed_by=dict(evidence.missed_by)))
        rate_limited = evidence.error_kinds.get(ek.RATE_LIMITED, 0)
        if decision.verdict == "fail" and decision.binding == "errors" and evidence.load_errors \
                and rate_limited >= RATE_LIMIT_SHARE * evidence.load_errors:
            span = max(elapsed_s - self._start_s, 1e-9)
            per_min = cell.requests / span * 60
            self.search.stopped = (f"limited by the channel's rate limit at about {per_min:.0f} requests/min "
                                   f"({rate_limited} of {evidence.load_errors} load errors were 429s); "
                                   "that is a quota, not the channel's capacity")
        self.write()

    def stop(self, reason: str) -> None:
        """The run ends before the search did (budget, duration, Ctrl-C): say so in the record."""
        if self.search.stopped is None and self.search.next_level() is not None:
            self.search.stopped = f"run stopped before the search ended: {reason}"
            self.write()

    def end_reason(self) -> str:
        if self.search.stopped is not None:
            return f"search stopped: {self.search.stopped}"
        return "search complete"

    def write(self) -> None:
        write_json(self.path, self.search.to_dict())

    def live(self) -> dict[str, Any]:
        """For the live line: the probes so far and the current one."""
        return {"probes": len(self.search.probes), "capacity": self.search.capacity,
                "first_failing": self.search.first_failing,
                "probing": None if self.current is None else (self.current.rate or self.current.users)}


_EMPTY = Cell()
