"""Stop limits and a killed worker: real Locust, the real simulator, loopback (the web UI: test_webui.py)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from loadkit import run_command, truth_frame, write_scenario

from tokenload.sim import launch

pytestmark = pytest.mark.slow


def _failing_profile(tmp_path: Path) -> Path:
    """A channel that answers every stream with an instant 500: hundreds of errors a second (no back-off applies)."""
    path = tmp_path / "failing.toml"
    path.write_text('extends = "fast"\n[faults]\n"status code=500 body=json" = 1.0\n')
    return path


@pytest.mark.parametrize("processes", [0, 2])
def test_max_requests_is_not_overshot_by_fast_errors(tmp_path: Path, processes: int) -> None:
    """Instant 500s come back by the hundred each second, yet the limit holds."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 4
[load]
kind = "constant"
users = 6
step_s = 20
[stop]
max_requests = 40
drain_s = 5
""")
    truth_path = tmp_path / "truth.jsonl"
    extra = ("--processes", str(processes)) if processes else ()
    with launch(["--profile", str(_failing_profile(tmp_path)), "--truth", str(truth_path)]) as sim:
        result = subprocess.run(run_command(scenario, sim.base_url, tmp_path / "run", *extra),
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no request succeeded" in result.stderr, result.stderr
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert df.error_kind.eq("server_error").all()
    assert len(df) == len(truth_frame(truth_path)) == 40  # no more sent than the limit, every one recorded
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stop_reason"].startswith("max_requests"), manifest["stop_reason"]  # not the 20 s plan
    if processes:
        assert df.worker.nunique() == 2


def test_a_misconfigured_channel_stops_the_run_and_says_so(tmp_path: Path) -> None:
    """Every request fails on the model id: the run stops within seconds, names the fix, exits 1."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 4
[load]
kind = "constant"
users = 4
step_s = 30
""")
    with launch() as sim:
        result = subprocess.run(run_command(scenario, sim.base_url, tmp_path / "run", model="no-such-model"),
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "not_found_model HTTP 404" in result.stderr and "fix: use a model id this channel serves" in result.stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    # the run's own span, not the command's: a busy machine took 25.6 s to start and end its processes around it
    assert manifest["ended_at"] - manifest["started_at"] < 20, manifest  # not the 30 s plan
    assert manifest["stop_reason"].startswith("channel misconfigured: "), manifest["stop_reason"]
    assert "with not_found_model" in manifest["stop_reason"]
    # doctor's own fix; "no-such-model" is like no served id, so none is offered as the closest match
    assert "fix: set --model to one of the models this channel serves: sim-7b, sim-30b" in manifest["stop_reason"]


def test_token_budget_overshoots_by_at_most_the_requests_in_flight(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 50
[output]
max_tokens = 20
ignore_eos = true
[load]
kind = "constant"
users = 4
step_s = 30
[stop]
max_tokens = 1400
drain_s = 5
""")
    with launch(["--profile", "fast"]) as sim:
        result = subprocess.run(run_command(scenario, sim.base_url, tmp_path / "run"), capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 0, result.stderr
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    per_request = 70  # 50 input + 20 output tokens
    assert (df.input_tokens + df.output_tokens).eq(per_request).all()
    used = int((df.input_tokens + df.output_tokens).sum())
    assert 1400 <= used <= 1400 + 4 * per_request, used
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["stop_reason"].startswith("token budget")


def test_killed_worker_keeps_what_it_flushed_and_the_run_is_finalised(tmp_path: Path) -> None:
    """SIGKILL one of two workers mid-run: its records up to ~1 s before the kill survive,
    the run directory is still finalised, the manifest names the lost worker and the exit code is 1."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 32
[output]
max_tokens = 20
ignore_eos = true
[load]
kind = "constant"
users = 4
step_s = 7
[stop]
drain_s = 3
""")
    truth_path = tmp_path / "truth.jsonl"
    out = tmp_path / "run"
    with launch(["--truth", str(truth_path)]) as sim:
        proc = subprocess.Popen(run_command(scenario, sim.base_url, out, "--processes", "2"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        states: list[dict] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # both workers have flushed records at least once
            states = [json.loads(Path(p).read_text()) for p in glob.glob(str(out / "segments" / "*.state.json"))]
            if len(states) == 2 and all(s["records"] >= 3 for s in states):
                break
            time.sleep(0.2)
        assert len(states) == 2, states
        victim = states[0]
        time.sleep(1.5)
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert stdout.strip().splitlines()[-1] == str(out)
    df = pd.read_parquet(out / "requests.parquet")
    assert df.request_id.is_unique
    truth = truth_frame(truth_path)
    # Every request the server finished more than ~1 s before the kill is recorded (either worker).
    done_before = set(truth.request_id[truth.last_token < killed_at - 1.2])
    assert done_before and done_before <= set(df.server_request_id)
    assert (df.worker == victim["worker"]).sum() >= 3
    assert (df.worker != victim["worker"]).sum() > (df.worker == victim["worker"]).sum()  # the other went on
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["workers_lost"] == [victim["worker"]]
    assert any("did not finish" in w for w in manifest["warnings"])
    assert not (out / "segments").exists() or not list((out / "segments").glob("*.arrow"))


def test_ramp_stops_after_the_first_step_over_the_error_limit(tmp_path: Path) -> None:
    """Auto-stop after the breakpoint: the relay admits 2 streams at a time, so 8 users get 429s."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 32
[output]
max_tokens = 40
ignore_eos = true
[load]
kind = "steps"
users = [1, 8, 16, 32]
step_s = 3
[stop]
breakpoint_error_rate = 0.2
drain_s = 3
""")
    profile = tmp_path / "relay.toml"
    profile.write_text('extends = "fast"\nmax_concurrency = 2\n')
    with launch(["--profile", str(profile)]) as sim:
        result = subprocess.run(run_command(scenario, sim.base_url, tmp_path / "run"), capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stop_reason"].startswith("auto-stop: step 2 (8 users) load error rate"), manifest["stop_reason"]
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    # The 16- and 32-user steps never ran.
    assert df.active_users.max() == 8 and df.error_kind.eq("rate_limited").any()
