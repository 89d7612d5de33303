"""The drain: how long a stopping run lets its open streams finish, and why that long.

A fixed drain either cuts a slow channel's last step short (its streams are
censored and its high percentiles read too low) or waits long on a fast one for
a stream that hangs. So unless the scenario sets `[stop] drain_s` (a hard
value) the drain is derived when the plan ends, from what the run observed:
`DRAIN_FACTOR` x the longest e2e or TTFT of the last step, or the run's p99 e2e
when that is longer (the last step's slowest streams often have not finished
yet), never below `[stop] drain_min_s` and never above `DRAIN_CAP_S`. When no
request has finished at all, the run's length so far stands in: every open
stream is at most that old. A fast channel pays nothing for a long drain: Locust
ends it as soon as every user's stream is done.

A search that ended (its answer found, or its budget spent) does not drain at
all (`ANSWERED`): its verdicts are in `search.json`, and a stream still in
flight would only spend the channel's tokens on requests no verdict reads; they
are cut and recorded as cancelled. A Ctrl-C drains for the floor: the person asked to stop. The master sends the
derived value to its workers (`DRAIN_MESSAGE`) before it tells them to stop; the
value and its reason go to `control.json`, so the manifest records them and
`tokenload run` sets its kill deadline from them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tokenload.load.tokenstats import Cell

DRAIN_FACTOR = 2.0
DRAIN_CAP_S = 600.0
# After the drain, how long processes get to flush and exit before they are waited for no more.
DRAIN_GRACE_S = 10.0


@dataclass(frozen=True)
class Drain:
    """A drain length and where it came from (`scenario`, `--stop-timeout`, `floor` or `derived`)."""

    drain_s: float
    source: str
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ANSWERED = Drain(0.0, "search", "the search has ended: a stream still in flight would only spend tokens")


def initial(drain_s: float | None, floor_s: float, flag_s: float | None) -> Drain:
    """The drain before the plan ends: Locust's `--stop-timeout`, else `[stop] drain_s`, else the floor."""
    if flag_s:
        return Drain(flag_s, "--stop-timeout", "Locust's --stop-timeout")
    if drain_s is not None:
        return Drain(drain_s, "scenario", "[stop] drain_s")
    return Drain(floor_s, "floor", "[stop] drain_min_s (the plan has not ended)")


def derive(floor_s: float, last_step: int, step_cell: Cell | None, run_cell: Cell, elapsed_s: float) -> Drain:
    """The drain for a plan that just ended, from its live statistics (seconds; see the module doc)."""
    candidates: list[tuple[float, str]] = []
    if step_cell is not None:
        longest = [v for v in (step_cell.hists["e2e"].percentile(100), step_cell.hists["ttft"].percentile(100))
                   if v is not None]
        if longest:
            candidates.append((max(longest), f"the longest e2e/TTFT of step {last_step}"))
    p99 = run_cell.hists["e2e"].percentile(99)
    if p99 is not None:
        candidates.append((p99, "the run's p99 e2e"))
    basis, label = max(candidates) if candidates else (elapsed_s, "the run's length (no request had finished)")
    value = DRAIN_FACTOR * basis
    seconds = max(floor_s, min(DRAIN_CAP_S, value))
    why = f"{DRAIN_FACTOR:g} x {label} ({basis:.2f} s) = {value:.1f} s"
    if seconds > value:
        why += f", raised to the floor [stop] drain_min_s = {floor_s:g} s"
    elif seconds < value:
        why += f", capped at {DRAIN_CAP_S:g} s"
    return Drain(round(seconds, 3), "derived", why)
