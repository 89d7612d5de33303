"""The search for the highest load level that meets the SLO: exponential probe, bisection, confirmation.

Levels are users (closed loop, integers) or requests/s (open loop). From `min` the level doubles until one
fails (or `max` passes), the bracket is then bisected until it is `resolution` wide, and the highest passing
level is held again: its first pass only steered the search, its second must reach 95% (`full_evidence`).
A second trial that fails is kept as a disagreement and the search goes on below it. Over users, a failing
level that showed the channel's slot count (`Probe.served`) is probed next when that count lies in the
bracket's lower half (`_hinted`): a slot-limited channel's cliff is at its slot count. An undecided probe
steers by its point estimate but never becomes the capacity or the first failing level.

Closed-loop users above the slots are not independent: each user's wait depends on the phase the users fell
into and persists from request to request, so one trial's requests are one phase's evidence however many
there are. Above the slots a level is probed after a pause with every user started anew (`rephased`), and the
capacity's second trial in another phase: it must pass in both. A level whose interval holds the target and
lies within `evidence.EDGE_MARGIN` of it is at the edge (`Probe.edge`): it counts as failing, and the verdict
names it instead of buying a pass or a fail on one side of a margin nobody can act on.

The state is plain data (`to_dict` / `from_dict`), written after each probe as `search.json`, so `tokenload
run --resume` continues without repeating decided probes. The rules in full: docs/scenarios.md, "Breakpoint
search"; the probes they save: docs/benchmarks.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenload.search.evidence import MIN_REQUESTS, Verdict

Over = Literal["users", "rate"]
Rephase = Literal["burst", "spread"]
# `shape`: past the capacity, a first failing level whose attainment is below this share of the target is a cliff.
CLIFF_SHARE = 0.5


@dataclass
class Probe:
    """One held level and what it showed (levels can be probed twice: the confirmation trial)."""

    level: float
    verdict: Verdict
    trial: int
    n: int
    attainment: float | None
    ci: list[float] | None
    error_rate: float | None
    binding: str | None
    duration_s: float
    tokens: int
    step: int = 0  # the run's step number of this probe (records carry it)
    confident: bool = True  # a pass at 95%, not only at the steering 70%
    early: int = 0  # of `n`, hits counted at their first token (`Evidence.early`) and not finished when decided
    served: int | None = None  # the channel's concurrency while requests waited (`Evidence.served`)
    edge: bool = False  # undecided because its attainment is within `evidence.EDGE_MARGIN` of the target
    rephased: Rephase | None = None  # it started after a pause, every user anew (`Search.rephased`)
    started_at: float = 0.0
    decided_at: float = 0.0  # unix time of the verdict: the requests counted by then are its evidence
    run_id: str = ""  # the run whose records hold this probe (a resumed search holds earlier runs' probes)
    error_kinds: dict[str, int] = field(default_factory=dict)
    missed_by: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Search:
    """The search's plan and record; `next_level()` is the question the load shape asks."""

    over: Over
    min_level: float
    max_level: float
    resolution: float
    target: float = 0.9  # the SLO's: steers undecided probes and tells a cliff from a gradual fall
    confirm: bool = True
    max_probes: int = 12
    probes: list[Probe] = field(default_factory=list)
    stopped: str | None = None  # why the search ended early (a rate limit, the token budget, ...)

    # -- levels -------------------------------------------------------------------------------------------
    def _round(self, level: float) -> float:
        if self.over == "users":
            return float(max(1, round(level)))
        return float(f"{level:.3g}")

    def _close(self, lo: float, hi: float) -> bool:
        """lo and hi are within the resolution: nothing worth probing between them."""
        if self.over == "users":
            return hi - lo <= max(1.0, self.resolution)
        return hi <= lo * (1 + self.resolution) + 1e-9

    def _between(self, lo: float, hi: float) -> float:
        mid = (lo + hi) / 2 if self.over == "users" else math.sqrt(lo * hi)
        level = self._round(mid)
        if level <= lo:
            level = self._round(lo + 1) if self.over == "users" else lo * (1 + self.resolution)
        return min(level, hi)

    # -- verdicts per level ---------------------------------------------------------------------------------
    def _latest(self) -> dict[float, Probe]:
        """Each level's latest probe (a confirmation trial overrides the first)."""
        out: dict[float, Probe] = {}
        for p in self.probes:
            out[p.level] = p
        return out

    def _failed(self, p: Probe) -> bool:
        """Failing for steering: a fail, a disagreement, a level at the edge, or an undecided probe below the
        target."""
        return p.verdict == "fail" or (p.verdict == "undecided" and (p.edge or (p.attainment is not None
                                                                                and p.attainment < self.target)))

    def bounds(self) -> tuple[float | None, float | None]:
        """(highest level passing for steering below every failing one, lowest failing level)."""
        latest = self._latest()
        fails = [lvl for lvl, p in latest.items() if self._failed(p)]
        hi = min(fails) if fails else None
        passes = [lvl for lvl, p in latest.items() if not self._failed(p) and (hi is None or lvl < hi)]
        return (max(passes) if passes else None), hi

    @property
    def capacity(self) -> float | None:
        """The highest decided passing level below every failing one (confirmed when a second trial ran)."""
        latest = self._latest()
        _, hi = self.bounds()
        passes = [lvl for lvl, p in latest.items() if p.verdict == "pass" and (hi is None or lvl < hi)]
        return max(passes) if passes else None

    @property
    def edges(self) -> list[float]:
        """Levels whose latest probe found them at the edge (`evidence.at_edge`), lowest first."""
        return sorted(lvl for lvl, p in self._latest().items() if p.verdict == "undecided" and p.edge)

    @property
    def first_failing(self) -> float | None:
        fails = [lvl for lvl, p in self._latest().items() if p.verdict == "fail"]
        return min(fails) if fails else None

    # -- the question --------------------------------------------------------------------------------------
    def next_level(self) -> float | None:
        """The level to probe next, or None when the search is over."""
        if self.stopped is not None or len(self.probes) >= self.max_probes:
            return None
        return self._planned()

    @property
    def out_of_probes(self) -> bool:
        """`max_probes` ended the search before it had found the boundary to its resolution and confirmed it."""
        return self.stopped is None and len(self.probes) >= self.max_probes and self._planned() is not None

    def _planned(self) -> float | None:
        """The level the search would probe next were there no cap on probes."""
        if not self.probes:
            return self._round(self.min_level)
        lo, hi = self.bounds()
        if hi is None:  # nothing failed yet: keep doubling up to max
            assert lo is not None
            if lo >= self.max_level:
                return self._confirmation()
            return min(self._round(lo * 2), self._round(self.max_level))
        if lo is None:  # the lowest level probed failed
            if hi <= self._round(self.min_level):
                return None
            return self._round(self.min_level)
        if self._retest(lo, hi):
            return lo
        if not self._close(lo, hi):
            return self._hinted(lo, hi) or self._between(lo, hi)
        return self._decided_above(hi) or self._confirmation()

    def _decided_above(self, hi: float) -> float | None:
        """The bracket closed on a level that stayed undecided below the target, far below the lowest decided
        failure (a hint jumped there): bisect between them, so that `first_failing` is a decided level near the
        boundary, as bisection from above would have left it. Not above a level at the edge: that is where the
        boundary lies, and the levels above it are at the edge or fail."""
        ff = self.first_failing
        if ff is None or hi >= ff or self._close(hi, ff) or self._latest()[hi].edge:
            return None
        return self._between(hi, ff)

    def _hinted(self, lo: float, hi: float) -> float | None:
        """The level the lowest failing probe's served concurrency points at, if it lies in the bracket's
        lower half: a slot-limited channel streams as many requests as it has slots while the rest wait, so
        under a TTFT SLO it cannot carry more users than that, and one user more already queues (probe the
        slot count, or the level above `lo` when that is it). Bisection otherwise: open loop, no request
        waited, a channel that queued yet passed at `lo`, or a hint in the upper half (a channel slowed by
        something other than a queue serves about as many as were sent, and following it there could cost a
        probe per user)."""
        served = self._latest()[hi].served
        if self.over != "users" or served is None or served < lo:
            return None
        level = max(float(served), lo + 1)
        return level if level < hi and level <= self._between(lo, hi) else None

    @property
    def rising(self) -> bool:
        """No level has failed yet (nor stayed undecided below the target): the search is still doubling."""
        return self.bounds()[1] is None

    def _retest(self, lo: float, hi: float) -> bool:
        """The lowest failing level's channel streamed fewer requests than `lo` while its requests waited
        (`served`): a slot-limited channel then queues `lo`'s users too, and `lo` passed on the way up, on the
        five first requests that steer there (which can come before the level's queue forms). Its second trial
        comes now, before any level above it (24 slots, identical answers: 32 passed on five early hits, 64
        failed with 22 streaming, and the bisection failed 48, 40, 36, 34 and 33 before 32's second trial
        failed too)."""
        if not self.confirm or self.over != "users":
            return False
        latest = self._latest()
        served, p = latest[hi].served, latest[lo]
        if served is None or served >= lo or p.verdict != "pass" or p.confident or p.trial != 1:
            return False
        first_fail = next(i for i, q in enumerate(self.probes) if self._failed(q))
        return self.probes.index(p) < first_fail

    def rephased(self, level: float) -> Rephase | None:
        """How a probe of `level` starts: after a pause, every user anew, all at once (`burst`) or spread over
        a request's time (`spread`); None: where the last probe left the users. Closed-loop users on a channel
        that queues them keep the phase they fell into, each user's wait persisting from request to request,
        and a level can pass in one phase and fail in another: on a server whose answers are alike, 5 users on 4
        slots meet a 2 s TTFT 100% of the time started one after another, 80% started together, and 25 to 30
        users on 24 slots passed where one user at a time was added but failed started together (a SLO shorter
        than the wait for the next slot turns it round: started apart, every request waits a little too long).
        So over users, a level above the streams the channel served while requests waited (`served`; at or
        below them no request waits in any phase) is first probed in a burst, and the capacity's second trial
        starts spread: it must pass in both. Where the first failing level fell off a cliff (nearly every
        request missed), a level above the slots is first probed where the users are, as that one did: only a
        pass there is tried again in a burst (the simulator's 96 slots: 97 users failed in 3 s, where a burst
        cost its 97 first requests, ~100k tokens of prompts, for the same fail)."""
        served = self.served
        if self.over != "users" or served is None or level <= served:
            return None
        trials = [p for p in self.probes if p.level == level]
        if not trials:
            return "burst" if self.shape() == "gradual" else None
        last = trials[-1]
        if last.verdict != "pass" or last.rephased == "spread":
            return None
        return "spread" if last.rephased == "burst" else "burst"

    def min_requests(self, level: float) -> int:
        """The judged requests a pass of `level` needs: `evidence.MIN_REQUESTS`, or over users above the streams
        the channel served while requests waited (`served`: the users queue), one round, a request per user. A
        queue serves first what was sent first, and a round's requests go out over a few tenths of a second: 125
        users on 96 slots passed on their first 36 hits, all sent before the round's 29 misses."""
        served = self.served
        if self.over == "users" and served is not None and level > served:
            return max(MIN_REQUESTS, int(level))
        return MIN_REQUESTS

    @property
    def served(self) -> int | None:
        """The most streams a failing level showed the channel serving while its requests waited: its slots (a
        count taken while slots were busy with prompts, which stream nothing yet, is lower)."""
        return max((p.served for p in self.probes if self._failed(p) and p.served is not None), default=None)

    def _confirmation(self) -> float | None:
        """The capacity's second trial, unless it already passed at 95%. The capacity, not the bracket's lower
        end: that may be an undecided level above the target, which steers but is never confirmed nor named."""
        level = self.capacity
        if level is None or not self.confirm:
            return None
        trials = [p for p in self.probes if p.level == level]
        if len(trials) >= 2 or trials[-1].confident:
            return None
        return level

    def full_evidence(self, level: float) -> bool:
        """A probe of `level` must pass at 95%: it is the boundary's second trial (or every pass must be)."""
        return not self.confirm or any(p.level == level and p.verdict == "pass" for p in self.probes)

    def prior(self, level: float) -> tuple[int, int]:
        """(met, judged) of `level`'s passing trials so far, early hits included (one that finishes during the
        second trial moves from early to finished there: counted once), pooled into its second trial's 95%."""
        met = judged = 0
        for p in self.probes:
            if p.level == level and p.verdict == "pass" and p.attainment is not None:
                met, judged = met + round(p.attainment * p.n), judged + p.n
        return met, judged

    def exhaust(self) -> None:
        """Say so when `max_probes` ended the search before it found and confirmed the boundary."""
        if self.out_of_probes:
            self.stopped = (f"max_probes ({self.max_probes}) ran out before the boundary was found to the "
                            "resolution and confirmed; raise [load] max_probes (or --resume this run with a "
                            "scenario that does)")

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)

    @property
    def disagreements(self) -> list[float]:
        """Levels whose two trials gave different decided verdicts."""
        out = []
        for level in sorted({p.level for p in self.probes}):
            verdicts = {p.verdict for p in self.probes if p.level == level and p.verdict != "undecided"}
            if len(verdicts) > 1:
                out.append(level)
        return out

    def shape(self) -> str | None:
        """"cliff" when the first failing level's attainment fell below half the target, else "gradual"."""
        ff = self.first_failing
        att = None if ff is None else self._latest()[ff].attainment
        if att is None:
            return None
        return "cliff" if att < CLIFF_SHARE * self.target else "gradual"

    # -- persistence ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"over": self.over, "min": self.min_level, "max": self.max_level, "resolution": self.resolution,
                "confirm": self.confirm, "max_probes": self.max_probes, "target": self.target,
                "stopped": self.stopped, "probes": [p.to_dict() for p in self.probes]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Search:
        return cls(over=data["over"], min_level=float(data["min"]), max_level=float(data["max"]),
                     resolution=float(data["resolution"]), target=float(data.get("target", 0.9)),
                     confirm=bool(data.get("confirm", True)), max_probes=int(data.get("max_probes", 12)),
                     stopped=data.get("stopped"), probes=[Probe(**p) for p in data.get("probes", [])])
