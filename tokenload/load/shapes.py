"""Load plans and the Locust `LoadTestShape` that plays them.

Every `[load]` kind compiles to a list of `Phase`s (step number, start, end,
users, arrival rate), so step ramps, constant load and open-loop Poisson share
one shape class and one set of stop conditions:

- `steps`: closed loop, users 1, 2, 4, ... each held `step_s`.
- `constant`: closed loop, one level for `step_s`.
- `poisson`: open loop; a fixed pool of `max_users` sends requests at scheduled
  arrival times (rate per phase), so a slow channel cannot slow the arrivals
  down (no coordinated omission). Users record how late each send was.
- `trace`: open loop; one phase as long as the trace (at its mean rate) in which
  the users send each recorded request at its offset / speed.

Steps sized by evidence: with `[load] min_requests = N` a closed-loop step
holds past its `step_s` until N requests of the step have finished, or until
`max_step_s`; a slow channel then still yields enough samples per level
instead of a verdict drawn from a handful. The plan's clock pauses while a step
is held, so the following steps keep their lengths; `[stop] duration_s` stays
a cap on wall time.

The shape runs only on the master (or the local runner). Each tick it checks
the stop conditions (`[stop]`: duration, request count, token budget, and the
breakpoint: a whole step over the error-rate or TTFT-p95 limit), and when a new
phase begins it publishes it to every process through `control.RunControl`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from locust import LoadTestShape

if TYPE_CHECKING:
    from tokenload.load.control import RunControl

from tokenload.load.tokenstats import Snapshot, current_run
from tokenload.workload.scenario import OPEN_LOOP_KINDS, Scenario


@dataclass(frozen=True, slots=True)
class Phase:
    """One level of load: closed loop when `rate` is None, else open-loop arrivals/s."""

    step: int
    start_s: float
    end_s: float
    users: int
    rate: float | None = None


def build_plan(scenario: Scenario) -> list[Phase]:
    """The scenario's phases, cut at `[stop] duration_s` when set (a search plans its probes as it goes: none)."""
    load = scenario.load
    if load.search is not None:
        return []
    levels: list[tuple[int, float | None]]
    if load.kind in OPEN_LOOP_KINDS:  # a trace is one phase at its mean rate
        levels = [(load.max_users, r) for r in load.rate]
    else:
        levels = [(u, None) for u in load.users]
    plan = [Phase(i + 1, i * load.step_s, (i + 1) * load.step_s, users, rate)
            for i, (users, rate) in enumerate(levels)]
    cap = scenario.stop.duration_s
    if cap:
        plan = [Phase(p.step, p.start_s, min(p.end_s, cap), p.users, p.rate) for p in plan if p.start_s < cap]
        last = plan[-1]
        if last.end_s < cap:  # a duration longer than the plan holds the last level
            plan[-1] = Phase(last.step, last.start_s, cap, last.users, last.rate)
    return plan


def phase_at(plan: list[Phase], elapsed_s: float) -> Phase | None:
    for phase in plan:
        if elapsed_s < phase.end_s:
            return phase
    return None


class ScenarioShape(LoadTestShape):
    """Plays the scenario's plan; `environment.tokenload` (a RunControl) is set by the plugin."""

    def __init__(self) -> None:
        super().__init__()
        self._reset()

    def _reset(self) -> None:
        self._phase: Phase | None = None
        self._held_s = 0.0  # how long the plan's clock has been paused for evidence
        self._entered_s = 0.0
        self._entry: int | None = None  # finished requests (all steps) when the current step began

    def reset_time(self) -> None:
        super().reset_time()
        self._reset()

    def _needs_evidence(self, elapsed: float) -> bool:
        """The current step has fewer finished requests than `min_requests` and may still be held."""
        load = self.runner.environment.tokenload.scenario.load  # type: ignore[union-attr]
        if not load.min_requests or self._phase is None or self._entry is None:
            return False
        if elapsed - self._entered_s >= load.step_cap_s:
            return False
        return self._finished() - self._entry < load.min_requests

    def _finished(self) -> int:
        """Requests finished so far in the run (successes and failures), from the run's token stats."""
        return Snapshot.take(self.runner.environment).requests  # type: ignore[union-attr]  # set while ticking

    def tick(self) -> tuple[int, float] | None:
        control = self.runner.environment.tokenload  # type: ignore[union-attr]
        elapsed = self.get_run_time()
        cap = control.scenario.stop.duration_s
        if cap and elapsed >= cap:
            control.finish("duration")
            return None
        if control.prober is not None:
            return self._tick_search(control, elapsed)
        plan_time = elapsed - self._held_s
        phase = phase_at(control.plan, plan_time)
        if self._phase is not None and phase != self._phase and plan_time > self._phase.end_s - 1e-6:
            held = self._needs_evidence(elapsed)
            if held or self._held_s:  # pause the plan's clock; on release, resume at the step's end
                self._held_s = elapsed - self._phase.end_s + (1e-6 if held else 0.0)
                plan_time = elapsed - self._held_s
                phase = self._phase if held else phase_at(control.plan, plan_time)
        reason = control.stop_reason(elapsed, phase, self._phase)
        if reason is not None or phase is None:
            control.finish(reason or "plan complete")
            return None
        if phase != self._phase:
            self._phase = phase
            self._entered_s = elapsed
            self._entry = self._finished()
            control.enter(phase, time.time() - plan_time)
        control.write_live()
        return phase.users, control.scenario.load.spawn_rate

    def _tick_search(self, control: RunControl, elapsed: float) -> tuple[int, float] | None:
        """A search: hold the current probe until its evidence decides it, then move to the next level."""
        prober = control.prober
        assert prober is not None
        phase = self._phase
        environment = self.runner.environment  # type: ignore[union-attr]  # set while ticking
        environment.tokenload_tokens.watch = self._decide_now  # type: ignore[union-attr]  # a master: never called
        if phase is None or prober.look(current_run(environment).steps.get(phase.step), elapsed):
            phase = prober.next_phase(elapsed)
            if phase is None:  # the search is over: its own words, not "plan complete"
                control.finish(prober.end_reason())
                return None
            if phase is not self._phase:  # else a second trial holds on in its first trial's step
                control.plan.append(phase)
        reason = control.stop_reason(elapsed, phase, self._phase)
        if reason is not None:
            control.finish(reason)
            return None
        if phase != self._phase:
            self._phase = phase
            control.enter(phase, time.time() - elapsed)
        control.write_live()
        return phase.users, control.scenario.load.spawn_rate

    def _decide_now(self) -> None:
        """A search in one process: decide the probe at the request that settles it, not at the next tick (up
        to a second later), and hold the closed-loop users until that tick starts the next probe: what they
        would send meanwhile counts for no probe. A second trial held on starts at once instead."""
        environment = self.runner.environment  # type: ignore[union-attr]  # set while running
        control = environment.tokenload  # type: ignore[union-attr]
        prober = control.prober
        phase = self._phase
        if prober is None or phase is None or prober.decided or control.stopped is not None:
            return
        elapsed = self.get_run_time()
        if not prober.look(current_run(environment).steps.get(phase.step), elapsed):
            return
        if prober.search.continues():
            prober.next_phase(elapsed)
        else:
            control.state.probe_decided = True
