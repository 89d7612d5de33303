"""The breakpoint search: a channel's capacity in a few probes, each decided by evidence, not by a clock.

Pure logic, no Locust and no sockets, so the run (the load shape asks it which
level to probe next and tells it what each probe showed) and the analysis (it
turns the search's record into summary.json's `search`) share one definition:

- `evidence`: one probe's verdict from its requests against the SLO: pass when
  the attainment's 95% interval lies above the target, fail when it lies below
  (or the load-error rate's interval lies above its limit), undecided when the
  probe's time ran out first;
- `bisect`: the search itself: an exponential probe up from `min` until a level
  fails, then bisection to the resolution, then the last passing level held
  again (a second trial) and disagreement reported; its state is plain JSON
  (`search.json` in the run directory), so a run can be resumed.

Imports only the SLO definition and the scenario model below it.
"""
