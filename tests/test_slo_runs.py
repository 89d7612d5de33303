"""The SLO and the verdicts around the breakpoint on real runs: Locust, loopback, a scripted server or the simulator."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import pandas as pd
import pytest

from fakeserver import FakeServer, Received, Script, json_script, stream_script
from loadkit import run_cli, write_scenario

from tokenload.analysis import analyze_run
from tokenload.analysis.report import verdict_rows
from tokenload.sim import launch

pytestmark = pytest.mark.slow

# What an Anthropic channel answers a prompt over the model's context.
TOO_LONG = {"type": "error", "error": {"type": "invalid_request_error",
                                       "message": "prompt is too long: 208656 tokens > 200000 maximum"}}
SLOW_S = 0.4  # the scripted slow answers' first token: over the 0.2 s TTFT bound by a wide margin


def test_context_length_errors_count_neither_for_nor_against_the_slo(fake_server: FakeServer, tmp_path: Path) -> None:
    """Of every 4 requests the server refuses 1 as too long, answers 1 late and 2 at once.

    Attainment must be the share among the judged (answered) requests, 2/3, not 2/4; the
    `--slo-ttft` flag replaces the scenario's own bound in the resolved scenario.
    """
    counter = itertools.count()
    lock = threading.Lock()

    def route(_received: Received) -> Script:
        with lock:
            i = next(counter)
        if i % 4 == 0:
            return json_script(400, TOO_LONG)
        return stream_script("anthropic", ["a"] * 4, first_delay=SLOW_S if i % 4 == 1 else 0.0, per_token=0.001)

    fake_server.route(route)
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 4
[load]
kind = "constant"
users = 2
step_s = 4
[stop]
max_requests = 120
drain_s = 5
[slo]
ttft_s = 0.05
e2e_s = 5
""")
    result = run_cli(scenario, fake_server.url, tmp_path / "run", "--slo-ttft", "0.2", model="claude-test")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["scenario"]["slo"]["ttft_s"] == 0.2 and manifest["scenario"]["slo"]["e2e_s"] == 5

    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert not df.in_flight.any()
    refused = int(df.error_kind.eq("context_length").sum())
    fast = int((df.status.eq("ok") & (df.ttft_s < SLOW_S / 2)).sum())
    slow = int((df.status.eq("ok") & (df.ttft_s >= SLOW_S)).sum())
    assert refused + fast + slow == len(df) and refused >= 10 and slow >= 5  # the script's three kinds, no other

    s = analyze_run(tmp_path / "run", write=False)
    assert s["slo"]["ttft_s"] == 0.2 and s["slo"]["judged"] == fast + slow and s["slo"]["not_judged"] == refused
    assert s["slo"]["attainment"] == pytest.approx(fast / (fast + slow), abs=1e-4)
    assert abs(s["slo"]["attainment"] - fast / len(df)) > 0.1  # what counting the refusals as misses would say
    [step] = s["steps"]
    assert step["input_errors"] == step["errors"] > 0
    measured = df[df.started_at >= step["start"]]
    judged = measured[measured.status.eq("ok")]
    assert step["slo_n"] == len(judged)
    assert step["slo_attainment"] == pytest.approx(float((judged.ttft_s <= 0.2).mean()), abs=1e-6)


def test_auto_stop_is_named_and_related_to_the_slo_breakpoint(tmp_path: Path) -> None:
    """2 slots, 0.4 s a stream: 4 users queue past the 0.05 s TTFT SLO (about one stream's wait); only at 8 users
    (three) does TTFT p95 pass the live 0.9 s limit. (At 0.1 s a stream and a 0.28 s limit, a busy machine, whose
    simulator falls behind its 1 ms token grid, read 0.35 s at 4 users.) Each step holds until 20 requests
    finished, the fewest a step needs to decide."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 32
[output]
max_tokens = 100
ignore_eos = true
[load]
kind = "steps"
users = [2, 4, 8, 16]
step_s = 4
min_requests = 20
[stop]
breakpoint_ttft_p95_s = 0.9
drain_s = 3
[slo]
ttft_s = 0.05
""")
    profile = tmp_path / "two-slots.toml"
    profile.write_text('extends = "fast"\nslots = 2\ndecode_base_s = 0.004\n')
    with launch(["--profile", str(profile)]) as sim:
        result = run_cli(scenario, sim.base_url, tmp_path / "run")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stop_reason"].startswith("auto-stop: step 3 (8 users) TTFT p95 "), manifest["stop_reason"]
    assert manifest["stop_reason"].endswith("> 0.9 s ([stop] breakpoint_ttft_p95_s)")

    s = analyze_run(tmp_path / "run", write=False)
    assert s["run"]["completeness"]["truncated"] is False and s["run"]["completeness"]["note"] is None
    assert s["breakpoint"]["reason"] == "slo" and s["breakpoint"]["load_level"] == 4
    assert s["auto_stop"]["load_level"] == 8 and s["auto_stop"]["rule"] == "breakpoint_ttft_p95_s"
    rows = {topic: finding for topic, finding, _ in verdict_rows(s)}
    assert "Run incomplete" not in rows and "Missing" not in rows
    assert rows["Auto-stop"].startswith("auto-stop at 8 users (TTFT p95 ")
    assert "; the SLO breakpoint is 4 users, lower" in rows["Auto-stop"]


def test_a_slow_channel_is_not_nothing_measured_nor_errors_bound(tmp_path: Path) -> None:
    """1 s per token: each user's first request gets its first token, then the run ends with it open."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 32
ignore_eos = true
[load]
kind = "constant"
users = 2
step_s = 2
[stop]
drain_s = 1
""")
    profile = tmp_path / "slow.toml"
    profile.write_text('extends = "fast"\ndecode_base_s = 1.0\n')
    with launch(["--profile", str(profile)]) as sim:
        result = run_cli(scenario, sim.base_url, tmp_path / "run")
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert df.error_kind.isna().all() and df.ttft_s.notna().sum() >= 2 and not df.status.eq("ok").any()
    assert "nothing was measured" not in result.stderr
    assert f"no request finished: {df.ttft_s.notna().sum()} TTFT(s) recorded" in result.stderr
    d = analyze_run(tmp_path / "run", write=False)["diagnosis"]
    assert d["bound"] is None and d["error_rate"] == 0.0
    assert any("no request finished" in line for line in d["advice"])
