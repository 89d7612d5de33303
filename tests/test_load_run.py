"""`tokenload run` end to end: real Locust, the real simulator, loopback, a few seconds each."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from loadkit import run_cli, run_command, run_master_and_worker, truth_frame, write_scenario

from tokenload.load.records import COLUMNS
from tokenload.sim import launch

pytestmark = pytest.mark.slow

SPEC_COLUMNS = (
    "request_id run_id worker user_id step active_users scheduled_at started_at protocol model status error_kind "
    "http_status ttfb_s ttft_s ttft_text_s tpot_s e2e_s input_tokens input_tokens_source output_tokens "
    "output_tokens_source max_tokens chunks itl_p50_s itl_p99_s itl_max_s stop_reason finished_at "
    "prompt_tokens_target in_flight server_request_id error_message"
).split()
SECRET = "sk-tokenload-DISTINCTIVE-9f3c2e71"


def test_step_ramp_records_and_truth(tmp_path: Path) -> None:
    """Each step runs its user count; every contract column; one record per server request; TTFT/TPOT match truth."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = { dist = "uniform", min = 20, max = 400 }
[output]
max_tokens = 12
ignore_eos = true
[load]
kind = "steps"
users = [1, 2, 4]
step_s = 2.5
[stop]
drain_s = 5
""")
    truth_path = tmp_path / "truth.jsonl"
    with launch(["--truth", str(truth_path)]) as sim:
        result = run_cli(scenario, sim.base_url, tmp_path / "run")
    assert result.returncode == 0, result.stderr
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    df = pd.read_parquet(run_dir / "requests.parquet")
    assert [c for c in SPEC_COLUMNS if c not in df.columns] == []
    assert list(df.columns) == list(COLUMNS)
    assert (df.error_kind == "client_error").sum() == 0 and (df.status == "ok").all()
    per_step = df.groupby("step").agg(users=("active_users", "max"), distinct=("user_id", "nunique"))
    assert per_step.users.tolist() == [1, 2, 4]
    assert per_step.distinct.tolist() == [1, 2, 4]
    truth = truth_frame(truth_path)
    assert len(df) == len(truth) and df.request_id.is_unique
    joined = df.merge(truth, left_on="server_request_id", right_on="request_id", suffixes=("", "_truth"))
    assert len(joined) == len(df)
    server_ttft = joined.first_token - joined.arrival
    assert ((joined.ttft_s - server_ttft).abs() < 0.05).mean() > 0.95
    server_tpot = (joined.last_token - joined.first_token) / (joined.output_tokens_truth - 1)
    assert ((joined.tpot_s - server_tpot).abs() < 0.005).mean() > 0.95
    assert (joined.input_tokens == joined.input_tokens_truth).all()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stop_reason"] == "plan complete"
    assert [s["users"] for s in manifest["steps"]] == [1, 2, 4]


def test_processes_2_lose_nothing(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 64
[output]
max_tokens = 10
[load]
kind = "constant"
users = 6
step_s = 4
[stop]
drain_s = 5
""")
    truth_path = tmp_path / "truth.jsonl"
    with launch(["--truth", str(truth_path)]) as sim:
        result = run_cli(scenario, sim.base_url, tmp_path / "run", "--processes", "2")
    assert result.returncode == 0, result.stderr
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    truth = truth_frame(truth_path)
    assert df.worker.nunique() == 2
    assert len(df) == len(truth) > 20
    assert df.request_id.is_unique and set(df.server_request_id) == set(truth.request_id)


def test_open_loop_rate_within_10_percent(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 32
[output]
max_tokens = 8
[load]
kind = "poisson"
arrival = "constant"
rate = 10
step_s = 4
max_users = 16
[stop]
drain_s = 5
""")
    with launch() as sim:
        result = run_cli(scenario, sim.base_url, tmp_path / "run")
    assert result.returncode == 0, result.stderr
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    span = df.scheduled_at.max() - df.scheduled_at.min()
    assert abs((len(df) - 1) / span - 10) / 10 < 0.10
    # The schedule runs on the plan's clock: 10/s for 4 s offers 40 requests, not fewer
    # because the users started a little after the clock.
    assert 36 <= len(df) <= 41, len(df)
    assert df.late_s.quantile(0.5) < 0.01
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert "warning" not in manifest["open_loop_lateness"]


def test_sigint_keeps_the_records(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 64
[output]
max_tokens = 200
ignore_eos = true
[load]
kind = "constant"
users = 4
step_s = 60
[stop]
drain_s = 0
""")
    truth_path = tmp_path / "truth.jsonl"
    with launch(["--truth", str(truth_path)]) as sim:
        proc = subprocess.Popen(run_command(scenario, sim.base_url, tmp_path / "run"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        state = tmp_path / "run" / "segments" / "local.state.json"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # some requests completed and were flushed (not a fixed sleep:
            try:                            # a busy machine starts Locust slower)
                if json.loads(state.read_text())["records"] >= 4:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-1] == str(tmp_path / "run")
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    truth = truth_frame(truth_path)
    assert len(df) >= 8 and df.request_id.is_unique
    # Every request the server saw is recorded; the cut streams are flagged as in flight.
    assert set(truth.request_id) <= set(df.server_request_id.dropna()) | set()
    assert df.in_flight.sum() >= 1
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["stop_reason"] == "interrupted"


def test_no_secret_anywhere(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 4
[load]
kind = "constant"
users = 2
step_s = 2
[stop]
drain_s = 2
""")
    with launch(["--api-key", SECRET]) as sim:
        good = run_cli(scenario, sim.base_url, tmp_path / "good", "--api-key", SECRET)
        bad = run_cli(scenario, sim.base_url, tmp_path / "bad", "--api-key", SECRET + "x")
    assert good.returncode == 0, good.stderr
    assert pd.read_parquet(tmp_path / "good" / "requests.parquet").status.eq("ok").all()
    assert pd.read_parquet(tmp_path / "bad" / "requests.parquet").error_kind.eq("auth").all()
    for result in (good, bad):
        assert SECRET not in result.stdout + result.stderr
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "scenario.toml":
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("body, field", [
    ("[load]\nkind = 'steps'\nusers = [1, 'two']\n", "[load] users"),
    ("[load]\nkind = 'constant'\nusers = 2\nbogus = 1\n", "[load] bogus"),
    ("[load]\nkind = 'steps'\n[prompt]\ntokens = { dist = 'uniform', min = 10, max = 5 }\n", "[prompt] tokens max"),
    ("[load]\nkind = 'poisson'\nrate = -1\n", "[load] rate"),
    ("[load]\nkind = 'steps'\n[stop]\nbreakpoint_error_rate = 5\n", "[stop] breakpoint_error_rate"),
    ("[load\n", "not valid TOML"),
])
def test_bad_scenario_is_one_line_exit_2(tmp_path: Path, body: str, field: str) -> None:
    scenario = write_scenario(tmp_path, body)
    result = subprocess.run([sys.executable, "-m", "tokenload", "run", str(scenario), "--base-url", "http://127.0.0.1:9"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert field in result.stderr and "scenario.toml" in result.stderr


@pytest.mark.parametrize("shared", [True, False], ids=["one-shared-directory", "nothing-shared"])
def test_master_and_worker(tmp_path: Path, shared: bool) -> None:
    """`--master` / `--worker` as on two machines (here two processes on loopback): one run id, each of the
    server's requests once in the master's run. Shared: both `--out A`, the worker writes its segments into A.
    Nothing shared: the worker's `--out B` is its own; its records reach A over Locust's messages, B holds its
    log and no run."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 8
[load]
kind = "steps"
users = [2, 4]
step_s = 3
[stop]
drain_s = 3
""")
    truth_path = tmp_path / "truth.jsonl"
    a, b = tmp_path / "A", tmp_path / ("A" if shared else "B")
    with launch(["--truth", str(truth_path)]) as sim:
        master, worker = run_master_and_worker(scenario, sim.base_url, a, b)
    assert worker.returncode == 0, worker.stderr
    assert master.returncode == 0, master.stderr
    assert master.stdout.strip().splitlines()[-1] == str(a)
    df = pd.read_parquet(a / "requests.parquet")
    truth = truth_frame(truth_path)
    assert len(df) == len(truth) > 10 and df.request_id.is_unique
    assert df.server_request_id.is_unique and set(df.server_request_id) == set(truth.request_id)
    manifest = json.loads((a / "manifest.json").read_text())
    assert df.run_id.nunique() == 1 and manifest["run_id"] == df.run_id.iloc[0]
    assert df.worker.nunique() == 1 and manifest["workers_lost"] == []
    assert not [w for w in manifest["warnings"] if "did not finish" in w or "stopped early" in w]
    assert manifest["records"]["written_per_worker"] == manifest["records"]["per_worker"]
    assert sorted(df.step.unique()) == [1, 2]
    assert list(b.glob("locust-worker-*.log"))
    if not shared:
        assert not (b / "requests.parquet").exists() and not list(b.rglob("*.arrow")) and not (b / "segments").exists()
