"""The Locust `LoadTestShape` that plays a run's plan (`plan.py`: every `[load]` kind as `Phase`s).

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

from locust import LoadTestShape
from locust.env import Environment

from tokenload.load import roles
from tokenload.load.control import CONTROL, RunControl
from tokenload.load.plan import Phase, phase_at
from tokenload.load.tokenstats import TOKENS, Snapshot, current_run


class ScenarioShape(LoadTestShape):
    """Plays the scenario's plan; the run's control (`control.CONTROL`) is the plugin's, kept by the role."""

    def __init__(self) -> None:
        super().__init__()
        self._reset()

    def _reset(self) -> None:
        self._phase: Phase | None = None
        self._held_s = 0.0  # how long the plan's clock has been paused for evidence
        self._entered_s = 0.0
        self._entry: int | None = None  # finished requests (all steps) when the current step began

    @property
    def _environment(self) -> Environment:
        assert self.runner is not None  # Locust sets it before the first tick
        return self.runner.environment

    def _control(self) -> RunControl:
        return roles.of(self._environment).need(CONTROL)

    def reset_time(self) -> None:
        super().reset_time()
        self._reset()

    def _needs_evidence(self, elapsed: float) -> bool:
        """The current step has fewer finished requests than `min_requests` and may still be held."""
        load = self._control().scenario.load
        if not load.min_requests or self._phase is None or self._entry is None:
            return False
        if elapsed - self._entered_s >= load.step_cap_s:
            return False
        return self._finished() - self._entry < load.min_requests

    def _finished(self) -> int:
        """Requests finished so far in the run (successes and failures), from the run's token stats."""
        return Snapshot.take(self._environment).requests

    def tick(self) -> tuple[int, float] | None:
        control = self._control()
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
        environment = self._environment
        roles.of(environment).need(TOKENS).watch = self._decide_now  # a master: never called
        if phase is None or prober.look(current_run(environment).steps.get(phase.step), elapsed):
            phase = prober.next_phase(elapsed)
            if phase is None:  # the search is over: its own words, not "plan complete"
                control.finish(prober.end_reason())
                return None
            control.plan.append(phase)
        reason = control.stop_reason(elapsed, phase, self._phase)
        if reason is not None:
            control.finish(reason)
            return None
        if phase != self._phase:
            self._phase = phase
            control.enter(phase, time.time() - elapsed)
        control.write_live()
        return phase.users, phase.spawn_rate or control.scenario.load.spawn_rate

    def _decide_now(self) -> None:
        """A search in one process: decide the probe at the request that settles it, not at the next tick (up
        to a second later), and hold the closed-loop users until that tick starts the next probe: what they
        would send meanwhile counts for no probe."""
        environment = self._environment
        control = roles.of(environment).get(CONTROL)
        prober = control.prober if control is not None else None
        phase = self._phase
        if control is None or prober is None or phase is None or prober.decided or control.stopped is not None:
            return
        elapsed = self.get_run_time()
        if prober.look(current_run(environment).steps.get(phase.step), elapsed):
            control.state.probe_decided = True
