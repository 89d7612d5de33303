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
from tokenload.analysis.report import verdict_rows
from tokenload.sim import launch

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


@pytest.mark.slow
def test_a_server_killed_mid_run_is_an_outage_not_a_misconfiguration(tmp_path: Path) -> None:
    """Before: "channel misconfigured: bad_base_url", the refusals left out of the SLO, a breakpoint "below 4
    users". Now: the refusals are `connection_refused` (load), backed off, counted in the SLO; the breaker stops the
    run; the verdict says the channel went down at the kill's moment and names no breakpoint."""
    scenario = write_scenario(tmp_path, KILL_SCENARIO)
    truth = tmp_path / "truth.jsonl"
    with launch(["--profile", "fast", "--truth", str(truth)]) as sim:
        assert sim.process is not None
        run = subprocess.Popen(run_command(scenario, sim.base_url, tmp_path / "run"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "TERM": "dumb"})
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (not truth.exists() or len(truth.read_text().splitlines()) < 40):
                time.sleep(0.1)
            sim.process.kill()
            killed_at = time.time()
            _, err = run.communicate(timeout=90)
        finally:
            run.kill()
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
