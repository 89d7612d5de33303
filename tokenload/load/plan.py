"""A run's load plan: the `Phase`s every `[load]` kind compiles to, and the one in force at a moment.

Every kind compiles to a list of phases (step number, start, end, users,
arrival rate), so step ramps, constant load and open-loop arrivals share one
shape class and one set of stop conditions:

- `steps`: closed loop, users 1, 2, 4, ... each held `step_s`.
- `constant`: closed loop, one level for `step_s`.
- `poisson`: open loop; a fixed pool of `max_users` sends requests at scheduled
  arrival times (rate per phase), so a slow channel cannot slow the arrivals
  down (no coordinated omission). Users record how late each send was.
- `trace`: open loop; one phase as long as the trace (at its mean rate) in which
  the users send each recorded request at its offset / speed.
- `search`: no plan ahead; the prober (`probing.py`) appends each probe's phase.

A module of its own so the shape that plays the plan, the control that
publishes each phase and the prober share the type without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenload.workload.scenario import OPEN_LOOP_KINDS, Scenario


@dataclass(frozen=True, slots=True)
class Phase:
    """One level of load: closed loop when `rate` is None, else open-loop arrivals/s."""

    step: int
    start_s: float
    end_s: float
    users: int
    rate: float | None = None
    spawn_rate: float | None = None  # users started per second into this phase; None: the scenario's
    spread_s: float = 0.0  # its new users' first requests go out spread over this long (a search's re-phased probe)


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
    """The phase in force `elapsed_s` into the plan (None once it is over)."""
    for phase in plan:
        if elapsed_s < phase.end_s:
            return phase
    return None
