"""The drain: derived from what the run observed unless `[stop] drain_s` fixes it (real Locust, the real simulator).

The simulator profile below streams 100 tokens at 50 ms each (about 5 s a request), so the last step's
requests, sent 3.5-5 s into a 7 s plan, are still open when the plan ends and need up to 3 s more. The
first user's second request starts 2 s before the plan ends (with 3 s steps, 1 s: on a busy machine the
first one ended after the plan and the last step had one request).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from loadkit import run_cli, write_scenario

from tokenload.load.drain import DRAIN_CAP_S, derive
from tokenload.load.tokenstats import Cell
from tokenload.sim import launch

SLOW_PROFILE = 'extends = "fast"\ndecode_base_s = 0.05\n'
RAMP = """
[prompt]
tokens = 32
[output]
max_tokens = 100
ignore_eos = true
[load]
kind = "steps"
users = [1, 2]
step_s = 3.5
[stop]
"""


def _cell(e2e: list[float], ttft: list[float] | None = None) -> Cell:
    cell = Cell()
    for value in e2e:
        cell.hists["e2e"].add(value)
    for value in ttft or []:
        cell.hists["ttft"].add(value)
    return cell


def test_derive_takes_the_longest_observed_latency_within_floor_and_cap() -> None:
    last, run = _cell([1.0, 4.0], ttft=[3.0]), _cell([0.5] * 200 + [1.0, 4.0])
    drain = derive(2.0, 2, last, run, 60.0)
    assert drain.drain_s == pytest.approx(8.0, rel=0.01) and drain.source == "derived"
    assert "longest e2e/TTFT of step 2" in drain.why
    # The last step has nothing finished yet: the run's p99 e2e stands in.
    assert derive(0.1, 3, None, run, 60.0).drain_s == pytest.approx(2 * run.hists["e2e"].percentile(99), rel=0.01)
    assert "floor" in (floor := derive(30.0, 2, last, run, 60.0)).why and floor.drain_s == 30.0
    capped = derive(2.0, 2, _cell([500.0]), _cell([500.0]), 900.0)
    assert capped.drain_s == DRAIN_CAP_S and "capped" in capped.why
    nothing = derive(2.0, 1, None, Cell(), 7.0)  # no request finished: every open one is at most 7 s old
    assert nothing.drain_s == 14.0 and "no request had finished" in nothing.why


def _ramp(tmp_path: Path, stop: str, *extra: str) -> tuple[pd.DataFrame, dict, dict]:
    from tokenload.analysis import analyze_run

    profile = tmp_path / "slow.toml"
    profile.write_text(SLOW_PROFILE)
    scenario = write_scenario(tmp_path, RAMP + stop)
    with launch(["--profile", str(profile)]) as sim:
        result = run_cli(scenario, sim.base_url, tmp_path / "run", *extra)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "run"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return pd.read_parquet(run_dir / "requests.parquet"), manifest, analyze_run(run_dir, write=False)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [0, 2])
def test_default_drain_lets_the_last_steps_slow_streams_finish(tmp_path: Path, processes: int) -> None:
    """With the floor at 2 s, a fixed 2-s drain cuts the last step (next test); the derived one waits
    for it, in one process and in forked workers (whose master stays until they have drained)."""
    extra = ("--processes", str(processes)) if processes else ()
    df, manifest, summary = _ramp(tmp_path, "drain_min_s = 2\n", *extra)
    assert len(df) >= 3 and (df.status == "ok").all() and not df.in_flight.any()
    assert (df.step == 2).sum() >= 2 and df.e2e_s.min() > 4  # the last step's streams outlived the plan by > 2 s
    drain = manifest["drain"]
    assert drain["source"] == "derived" and drain["drain_s"] > 8 and "2 x" in drain["why"]
    assert summary["run"]["completeness"]["censored"] == 0
    assert not manifest["workers_lost"]


@pytest.mark.slow
def test_an_explicit_drain_s_stays_a_hard_cut(tmp_path: Path) -> None:
    df, manifest, summary = _ramp(tmp_path, "drain_s = 2\n")
    assert manifest["drain"] == {"drain_s": 2.0, "source": "scenario", "why": "[stop] drain_s"}
    cut = int(df.in_flight.sum())
    assert cut > 0 and summary["run"]["completeness"]["censored"] == cut
    assert summary["steps"][-1]["censored"] == cut
