"""A search's record on disk, and continuing a stopped search in a new run (`tokenload run --resume`).

The record is `search.json` in the run directory: written by the run after
every probe, read by the analysis. A run stopped by Ctrl-C, a crash or its
budget leaves the probes it decided there; `--resume OLD_RUN_DIR` copies them
into the new run's directory, so the new run asks the search for its next
level and repeats no decided probe. The scenario must search the same range
with the same SLO target: a different question would make the old verdicts
answers to something else.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenload.errors import ConfigError
from tokenload.search.bisect import Search
from tokenload.workload.scenario import Scenario

SEARCH_FILE = "search.json"


def new_search(scenario: Scenario) -> Search:
    """The empty search a `[load] kind = "search"` scenario asks for."""
    spec = scenario.load.search
    assert spec is not None
    return Search(over="users" if spec.over == "users" else "rate", min_level=spec.min_level,
                  max_level=spec.max_level, resolution=spec.resolution, target=scenario.slo.target,
                  confirm=spec.confirm, max_probes=spec.max_probes)


def resumed(previous: Path, scenario: Scenario) -> Search:
    """The search recorded in `previous`, checked against `scenario`, ready to go on (its stop cleared)."""
    if scenario.load.search is None:
        raise ConfigError(f"--resume continues a breakpoint search, but scenario {scenario.name} has "
                          f"[load] kind = {scenario.load.kind!r}; run a kind = \"search\" scenario or drop --resume")
    path = previous / SEARCH_FILE
    try:
        old = Search.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise ConfigError(f"--resume {previous}: no {SEARCH_FILE} there; give the run directory of a stopped "
                          "search run") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--resume {previous}: cannot read {SEARCH_FILE} ({exc}); start a new search "
                          "without --resume") from None
    fresh = new_search(scenario)
    for name in ("over", "min_level", "max_level", "resolution", "target"):
        was, now = getattr(old, name), getattr(fresh, name)
        if was != now:
            raise ConfigError(f"--resume {previous}: that search used {name} = {was}, this scenario {now}; resume "
                              "with the same scenario and SLO, or start a new search without --resume")
    old.stopped = None
    old.confirm, old.max_probes = fresh.confirm, fresh.max_probes
    return old


def write(run_dir: Path, search: Search) -> None:
    """Seed a new run's directory with the search it continues."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SEARCH_FILE).write_text(json.dumps(search.to_dict(), indent=2) + "\n", encoding="utf-8")
