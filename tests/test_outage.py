"""A channel that goes down mid-run: an outage, counted in the SLO and named as such, never a misconfiguration
or a breakpoint.

The simulator serves 4 users, then is killed (SIGKILL, as a crash): the records, the live stop and the verdict
are checked against the moment of the kill.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from loadkit import run_command, truth_frame, write_scenario

from tokenload import errors as ek
from tokenload.analysis import analyze_run
from tokenload.analysis.outage import find_outage
from tokenload.analysis.report import verdict_rows
from tokenload.sim import launch
from tokenload.slo import Slo

KILL_SCENARIO = """
[prompt]
tokens = 16
[output]
max_tokens = 16
[load]
kind = "constant"
users = 4
step_s = 30
[stop]
drain_s = 1
storm_s = 2
storm_probes = 1
"""

# Every level meets this SLO: a probe fails only when the channel is gone.
SEARCH_SCENARIO = """
[prompt]
tokens = 16
[output]
max_tokens = 16
[load]
kind = "search"
over = "users"
min = 2
max = 64
probe_warmup_s = 0.5
[slo]
ttft_s = 5
target = 0.9
[stop]
drain_s = 1
storm_s = 2
storm_probes = 1
"""


def _kill_after(tmp_path: Path, body: str, served: int, profile: str = "fast") -> tuple[float, str, Path]:
    """Run `body` against the simulator, SIGKILL it once it has served `served` requests: (the kill's time,
    the run's stderr, the simulator's truth file); the run's directory is tmp_path/run."""
    scenario = write_scenario(tmp_path, body)
    truth = tmp_path / "truth.jsonl"
    with launch(["--profile", profile, "--truth", str(truth)]) as sim:
        assert sim.process is not None
        run = subprocess.Popen(run_command(scenario, sim.base_url, tmp_path / "run"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "TERM": "dumb"})
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (not truth.exists() or len(truth.read_text().splitlines()) < served):
                time.sleep(0.1)
            sim.process.kill()
            killed_at = time.time()
            _, err = run.communicate(timeout=90)
        finally:
            run.kill()
    return killed_at, err, truth


def _frame(kind: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """10 answers at 2 users (step 1), then a new level (step 2, 4 users) whose first 8 requests all fail `kind`."""
    rows = [{"step": 1, "active_users": 2, "started_at": 100.0 + i, "finished_at": 100.5 + i, "status": "ok",
             "error_kind": None, "ttft_s": 0.1, "e2e_s": 0.5, "in_flight": False} for i in range(10)]
    rows += [{"step": 2, "active_users": 4, "started_at": 111.0 + i / 10, "finished_at": 111.01 + i / 10,
              "status": "error", "error_kind": kind, "ttft_s": None, "e2e_s": None, "in_flight": False}
             for i in range(8)]
    table = pd.DataFrame({"load_level": [2, 4], "load_unit": ["users", "users"]}, index=[1, 2])
    return pd.DataFrame(rows), table


def test_a_port_that_stops_listening_at_a_level_too_new_to_have_served_is_an_outage() -> None:
    """A search's next probe (or a ramp's step) refused from its first request: no load closes a port, so the
    run's earlier answers show the channel was up; the same failures as timeouts are left to the load's rules."""
    df, table = _frame(ek.CONNECTION_REFUSED)
    outage = find_outage(df, table, Slo(), 90.0)
    assert outage is not None and outage["at_s"] == 21.0 and outage["served_before"] == 10
    assert "(step 2 at 4 users; 10 requests had succeeded in the run before)" in outage["verdict"]
    assert find_outage(*_frame(ek.TIMEOUT_FIRST_TOKEN), Slo(), 90.0) is None


@pytest.mark.slow
def test_a_search_whose_channel_went_down_claims_no_boundary_from_the_outages_failures(tmp_path: Path) -> None:
    """Before: "capacity 8 users (9 fails: TTFT p90 0.172 s > 0.2 s; ...)", the 9-user probe failed by the
    outage's errors read as the channel's limit. Now the level being probed when the channel went down is not
    decided, the capacity is a lower bound, and the probe says why it failed."""
    profile = tmp_path / "slower.toml"
    profile.write_text('extends = "fast"\ndecode_base_s = 0.02\n')
    _, err, _ = _kill_after(tmp_path, SEARCH_SCENARIO, served=60, profile=str(profile))
    summary = analyze_run(tmp_path / "run", write=False)
    assert summary["outage"] is not None, err[-2000:]
    search = summary["search"]
    assert search is not None
    failed = [p for p in search["probes"] if p["verdict"] == "fail"]
    assert failed and all(p.get("after_outage") for p in failed), failed  # every level meets the SLO
    level = search["outage_level"]
    assert level == min(p["level"] for p in failed) and search["first_failing"] is None, search
    assert search["verdict"].startswith(f"capacity at least {search['capacity']} users ({level} not decided: the "
                                        "channel went down while it was probed"), search["verdict"]
    assert " fails:" not in search["verdict"]
    said = {topic: finding for topic, finding, _ in verdict_rows(summary)}
    assert any("fail after the channel went down" in text for topic, text in said.items() if topic.startswith("Probe"))


@pytest.mark.slow
def test_a_server_killed_mid_run_is_an_outage_not_a_misconfiguration(tmp_path: Path) -> None:
    """Before: "channel misconfigured: bad_base_url", the refusals left out of the SLO, a breakpoint "below 4
    users". Now: the refusals are `connection_refused` (load), backed off, counted in the SLO; the breaker stops the
    run; the verdict says the channel went down at the kill's moment and names no breakpoint."""
    killed_at, err, truth = _kill_after(tmp_path, KILL_SCENARIO, served=40)
    run_dir = tmp_path / "run"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    df = pd.read_parquet(run_dir / "requests.parquet")
    measured = df[df.phase == "measure"]
    served = len(truth_frame(truth))
    assert (measured.status == "ok").sum() <= served
    assert ek.BAD_BASE_URL not in set(df.error_kind.dropna()), df.error_kind.value_counts()
    refused = measured[measured.error_kind == ek.CONNECTION_REFUSED]
    assert len(refused) >= 4, (measured.error_kind.value_counts(), err[-2000:])
    assert refused.backoff_s.notna().all() and len(refused) < 40  # backed off: a few waves, not thousands
    assert manifest["stop_reason"].startswith("error storm"), manifest["stop_reason"]

    summary = analyze_run(run_dir, write=False)
    finished = measured[~measured.in_flight]
    assert summary["slo"]["judged"] == len(finished) and not summary["slo"]["not_judged"]
    outage = summary["outage"]
    assert outage is not None and outage["errors_by_kind"].get(ek.CONNECTION_REFUSED) == len(refused)
    assert abs(outage["at_s"] - (killed_at - manifest["started_at"])) < 1.0, (outage, killed_at)
    assert summary["breakpoint"] is None and "went down" in summary["breakpoint_note"]
    said = {topic: finding for topic, finding, _ in verdict_rows(summary)}
    assert said["Outage"].startswith(f"the channel went down at {outage['at_s']:.1f} s (step 1 at 4 users")
    assert "misconfigured" not in json.dumps(said) and "home page" not in said["First fix"]
