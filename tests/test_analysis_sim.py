"""Analysis against the real simulator over loopback, checked against its truth file.

Each test runs `tokenload run` (real Locust, real HTTP) against `tokenload sim
--truth`, analyses the run directory, and compares what the analysis reports
with what the simulator says it did, in the same time windows.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from loadkit import assert_throughput_matches_truth, run_command, sim_run, write_scenario

from tokenload.analysis import analyze_run
from tokenload.analysis.report import verdict_rows
from tokenload.sim import launch


def test_poisson_rate_sweep_is_analysed_in_requests_per_second(tmp_path: Path) -> None:
    run = sim_run(tmp_path, """
[prompt]
tokens = 64
[output]
max_tokens = 40
ignore_eos = true
[load]
kind = "poisson"
rate = [3, 6, 12]
step_s = 4
max_users = 32
[stop]
drain_s = 15
""")
    summary, truth, run_dir = run.summary, run.truth, run.run_dir
    steps = summary["steps"]
    assert [s["load_level"] for s in steps] == [3, 6, 12]
    assert {s["load_unit"] for s in steps} == {"req/s"}
    records = pd.read_parquet(run_dir / "requests.parquet")
    for s in steps:
        sent = records.started_at.between(s["start"], s["end"], inclusive="left").sum()
        assert s["achieved_rate"] * (s["end"] - s["start"]) == pytest.approx(sent)
        assert 0 < s["achieved_concurrency"] < 32
        assert s["censored"] == 0 and s["ci"]["ttft_p50_s"] is not None
    # Poisson arrivals: over the whole sweep the sent rate follows the offered one (a few dozen requests).
    offered = sum(s["load_level"] for s in steps)
    assert sum(s["achieved_rate"] for s in steps) == pytest.approx(offered, rel=0.4)
    assert_throughput_matches_truth(summary, truth)
    assert summary["run"]["load_unit"] == "req/s"
    text = " ".join(f for _, f, _ in verdict_rows(summary))
    assert "req/s" in text and " 32 users" not in text


def test_closed_loop_throughput_is_counted_where_tokens_streamed(tmp_path: Path) -> None:
    run = sim_run(tmp_path, """
[prompt]
tokens = { dist = "uniform", min = 32, max = 400 }
[output]
max_tokens = { dist = "uniform", min = 20, max = 80 }
ignore_eos = true
[load]
kind = "steps"
users = [1, 4, 16]
step_s = 4
[stop]
drain_s = 15
""")
    summary, truth = run.summary, run.truth
    steps = summary["steps"]
    assert [s["load_level"] for s in steps] == [1, 4, 16] and {s["load_unit"] for s in steps} == {"users"}
    assert_throughput_matches_truth(summary, truth)
    # Achieved concurrency of a closed loop without think time is close to its users.
    assert steps[-1]["achieved_concurrency"] == pytest.approx(16, rel=0.25)


def test_cut_short_ramp_reports_censored_requests_and_bounds(tmp_path: Path) -> None:
    profile = tmp_path / "two-slots.toml"
    profile.write_text('extends = "default"\nslots = 2\nnoise = 0.0\n')
    run = sim_run(tmp_path, """
[prompt]
tokens = 64
[output]
max_tokens = 150
ignore_eos = true
[load]
kind = "steps"
users = [2, 8]
step_s = 3
[stop]
drain_s = 0
""", sim_args=["--profile", str(profile)])
    summary, truth, run_dir = run.summary, run.truth, run.run_dir
    last = summary["steps"][-1]
    assert last["censored"] >= 4  # six of eight users queue behind two slots when the run stops
    assert last["censored"] == int(truth.outcome.eq("client_closed").sum()) or last["censored"] > 0
    assert "ttft_p95_s" in last["bounds"]
    assert summary["latency"]["ttft"]["censored"] >= 4 and "p95" in summary["latency"]["ttft"]["bounds"]
    html = (run_dir / "report.html").read_text()
    assert "still open" in html and "≥" in html
    assert summary["run"]["completeness"]["censored"] == summary["run"]["in_flight"] > 0
    assert any("censored" in p for p in summary["problems"])
    assert json.loads((run_dir / "summary.json").read_text())["steps"][-1]["censored"] == last["censored"]
    assert np.isfinite(last["ttft_p95_s"])


def test_steps_sized_by_evidence_hold_until_enough_requests(tmp_path: Path) -> None:
    """A 1 s step against a channel answering in ~0.9 s holds until 8 requests finished, then moves on."""
    run = sim_run(tmp_path, """
[prompt]
tokens = 32
[output]
max_tokens = 40
ignore_eos = true
[load]
kind = "steps"
users = [1, 2]
step_s = 1
min_requests = 8
max_step_s = 30
[stop]
drain_s = 10
""")
    summary, truth = run.summary, run.truth
    first = run.manifest["steps"][0]
    assert first["ended_at"] - first["started_at"] > 3  # held well past step_s = 1
    finished_in_step = truth[(truth.arrival >= first["started_at"]) & (truth.arrival < first["ended_at"])]
    assert len(finished_in_step) >= 8
    assert [s["load_level"] for s in summary["steps"]] == [1, 2]
    assert all(s["requests"] >= 8 for s in summary["steps"])


def test_two_runs_in_a_row_reach_the_same_breakpoint(tmp_path: Path) -> None:
    """The demo's recipe at small scale: steps held for 20 requests, a channel with 2 slots (decoding at
    twice the default profile's speed, 10-token answers: about 0.16 s a request, so each step gathers its
    20 requests sooner; the 2 slots, not the answers' length, decide the breakpoint: the knee at 4 users)."""
    profile = tmp_path / "two-slots.toml"
    profile.write_text('extends = "default"\nslots = 2\ndecode_base_s = 0.01\n')
    scenario = """
[prompt]
tokens = 64
[output]
max_tokens = 10
ignore_eos = true
[load]
kind = "steps"
users = [1, 2, 4, 8, 16]
step_s = 1
min_requests = 20
max_step_s = 20
[stop]
drain_s = 30
"""
    verdicts = []
    for attempt in ("a", "b"):
        (tmp_path / attempt).mkdir()
        run = sim_run(tmp_path / attempt, scenario, sim_args=["--profile", str(profile)])
        summary = run.summary
        assert all(s["decided"] for s in summary["steps"]), summary["steps"]
        bp = summary["breakpoint"]
        verdicts.append(None if bp is None else (bp["load_level"], bp["reason"], bp["last_good_load_level"]))
    assert verdicts[0] == verdicts[1] and verdicts[0] is not None, verdicts


def test_ctrl_c_run_is_flagged_interrupted_with_its_cut_requests(tmp_path: Path) -> None:
    """Issue 9, item 6: after Ctrl-C the verdict said 'the ramp never broke the channel ... ramp higher'."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 64
[output]
max_tokens = 200
ignore_eos = true
[load]
kind = "steps"
users = [2, 4, 8]
step_s = 6
[stop]
drain_s = 0
""")
    with launch() as sim:
        proc = subprocess.Popen(run_command(scenario, sim.base_url, tmp_path / "run"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(9)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    # 1 when no request had finished yet (a slow, busy machine): the records are kept either way.
    assert proc.returncode in (0, 1) and "Traceback" not in err, err
    summary = analyze_run(tmp_path / "run")
    complete = summary["run"]["completeness"]
    assert complete["interrupted"] and complete["steps_planned"] == 3 and complete["steps_run"] < 3
    assert complete["censored"] == summary["run"]["in_flight"] >= 1
    assert "never broke" not in (summary["breakpoint_note"] or "")
    rows = verdict_rows(summary)
    assert rows[0][0] == "Run incomplete" and "interrupted" in rows[0][1] and "still open" in rows[0][1]
    assert "Run incomplete" in (tmp_path / "run" / "report.html").read_text()
