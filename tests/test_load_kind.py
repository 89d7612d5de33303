"""Load a real channel survives: back-off, fail-fast, the error-storm breaker, rate caps, headroom.

Real `tokenload run` (Locust in a subprocess) against the real simulator over loopback;
the simulator's truth file says what the channel really received.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from loadkit import run_cli, sim_run, truth_frame, write_scenario

from tokenload.sim import launch

pytestmark = pytest.mark.slow

SHORT = """
[prompt]
tokens = 16
[output]
max_tokens = 4
"""


def profile(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "profile.toml"
    path.write_text(body)
    return path


# One protocol for each of the vendors' rate-limit header dialects the simulator speaks.
RATE_LIMIT_DIALECTS = {"anthropic-ratelimit-*": "anthropic", "x-ratelimit-*": "openai-chat"}


@pytest.mark.parametrize("protocol", RATE_LIMIT_DIALECTS.values(), ids=RATE_LIMIT_DIALECTS.keys())
def test_a_rate_limited_channel_gets_its_limit_not_a_storm(tmp_path: Path, protocol: str) -> None:
    """8 users of short requests would send hundreds in 10 s; a 20-per-minute channel gets about 20.

    The users read the vendor's headers: the response that used the last request
    holds every user until the reset, so the run sends no more than the limit plus
    the few requests already on their way; every 429 is recorded; the report shows
    the limit it found.
    """
    scenario = write_scenario(tmp_path, SHORT + """
[load]
kind = "constant"
users = 8
step_s = 10
[stop]
drain_s = 5
""")
    sim = ["--profile", str(profile(tmp_path, 'extends = "ratelimited"\nrate_limit_rpm = 20\n'))]
    run = sim_run(tmp_path, scenario, "--protocol", protocol, sim_args=sim, ok=False)
    result, df, truth, wall = run.result, run.records, run.truth, run.wall_s
    assert result.returncode == 0, result.stderr
    assert len(truth) <= 20 + 8, truth.status.value_counts()  # the limit plus the requests in flight at most
    assert (truth.status == 200).sum() == 20  # and it was used in full
    assert len(df) == len(truth)  # every request recorded
    assert df.error_kind.eq("rate_limited").sum() == (truth.status == 429).sum()
    assert df.loc[df.error_kind.eq("rate_limited"), "backoff_s"].gt(0).all()
    assert wall < 30  # holds end with the run: a held user does not wait for the drain
    subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(tmp_path / "run")], capture_output=True,
                   check=True)
    limits = json.loads((tmp_path / "run" / "summary.json").read_text())["rate_limits"]
    assert limits["seen"] and limits["requests_per_min"] == 20 and limits["tokens_per_min"] == 40000
    assert limits["lowest_requests_remaining"]["remaining"] == 0
    assert limits["rate_limited"] == (truth.status == 429).sum()
    report = (tmp_path / "run" / "report.html").read_text()
    assert "Rate limits" in report and "20 per minute" in report


def pushed_back_run(tmp_path: Path, code: int, step_s: float,
                    retry: int = 0) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """4 users against a channel that answers every stream with HTTP `code`: the finished records, manifest, truth."""
    scenario = write_scenario(tmp_path, SHORT + f"""
[load]
kind = "constant"
users = 4
step_s = {step_s}
retry = {retry}
[stop]
drain_s = 2
""")
    sim = ["--profile", str(profile(tmp_path, f'extends = "fast"\n[faults]\n"status code={code} body=json" = 1.0\n'))]
    run = sim_run(tmp_path, scenario, sim_args=sim, ok=False)
    df, manifest, truth = run.records, run.manifest, run.truth
    df = df[~df.in_flight]  # cut by the end of the run
    assert len(df) == len(truth)
    return df, manifest, truth


def test_back_off_honours_retry_after_and_a_retry_is_a_new_linked_request(tmp_path: Path) -> None:
    """Every request gets 429 + retry-after: 1. Users wait 1 s between waves; a retry names its first request."""
    df, manifest, _ = pushed_back_run(tmp_path, 429, step_s=6, retry=1)
    assert len(df) <= 4 * 8  # about one wave a second, not hundreds
    assert df.error_kind.eq("rate_limited").all() and df.backoff_s.eq(1.0).all() and df.retry_after_s.eq(1.0).all()
    retries = df[df.retry_of.notna()]
    firsts = df.set_index("request_id")
    assert len(retries) >= 4 and retries.retry_of.isin(firsts.index).all()
    assert firsts.loc[retries.retry_of, "retry_of"].isna().all()  # retry_of names the first request of the chain
    assert (retries.user_id.to_numpy() == firsts.loc[retries.retry_of, "user_id"].to_numpy()).all()
    assert "storm" not in (manifest["stop_reason"] or "")


def test_without_a_header_back_off_doubles(tmp_path: Path) -> None:
    """503 with no retry-after: the waves are 1, 2, 4 s apart."""
    df, _, truth = pushed_back_run(tmp_path, 503, step_s=7.5)
    assert len(df) <= 4 * 4
    assert df.error_kind.eq("overloaded").all() and df.retry_of.isna().all()  # no retry unless asked
    waits = sorted(df.backoff_s.unique())
    assert len(waits) >= 3 and waits == [2.0 ** i for i in range(len(waits))]  # 1, 2, 4 (8) s
    gaps = truth.sort_values("arrival").arrival.diff().dropna()
    pauses = gaps[gaps > 0.5].to_numpy()
    assert pauses == pytest.approx([1.0, 2.0, 4.0][: len(pauses)], abs=0.3) and len(pauses) >= 2


@pytest.mark.parametrize("case", ["key", "key-processes-2", "base-url"])
def test_a_broken_channel_stops_smoke_after_a_handful_with_doctors_fix(tmp_path: Path, case: str) -> None:
    """`smoke` (max_requests = 200) with a wrong key or a base URL without /api stops after a few requests."""
    extra = ("--processes", "2") if case.endswith("processes-2") else ()
    truth = tmp_path / "truth.jsonl"
    with launch(["--api-key", "sk-right-0123456789", "--truth", str(truth)]) as sim:
        if case == "base-url":
            base, key = sim.base_url.removesuffix("/api"), "sk-right-0123456789"
            fix = f"fix: set --base-url to {sim.base_url}"
        else:
            base, key, fix = sim.base_url, "sk-wrong-9876543210", "fix: check the key"
        result = run_cli(Path("smoke"), base, tmp_path / "run", "--api-key", key, *extra)
    assert result.returncode == 1
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["ended_at"] - manifest["started_at"] < 30, manifest  # the run's own span, not the command's
    assert manifest["stop_reason"].startswith("channel misconfigured"), manifest["stop_reason"]
    assert fix in manifest["stop_reason"] and fix in " ".join(result.stderr.split())
    records = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    # a handful, not max_requests' 200; the channel also saw doctor's few requests for the fix
    assert 5 <= len(records) <= 12 and len(truth_frame(truth)) <= len(records) + 8
    assert "sk-wrong-9876543210" not in result.stderr + json.dumps(manifest)
    # all failed: the client was not the bottleneck
    assert "bottleneck" not in result.stderr and not manifest["scheduler_lag"]["client_bound"]


@pytest.mark.parametrize("processes", [0, 2])
def test_the_storm_breaker_pauses_probes_and_stops(tmp_path: Path, processes: int) -> None:
    """Every request gets an instant 500: users pause after storm_s, two probes fail, the run stops, saying why.

    With workers, the master pauses them by message and probes the channel itself. The probes are records of
    their own phase: the records hold every request the simulator saw (its truth file).
    """
    scenario = write_scenario(tmp_path, SHORT + """
[load]
kind = "constant"
users = 4
step_s = 40
[stop]
drain_s = 2
storm_s = 2
storm_probes = 2
""")
    sim = ["--profile", str(profile(tmp_path, 'extends = "fast"\n[faults]\n"status code=500 body=json" = 1.0\n'))]
    extra = ("--processes", str(processes)) if processes else ()
    run = sim_run(tmp_path, scenario, *extra, sim_args=sim, ok=False)
    df, manifest, truth, wall = run.records, run.manifest, run.truth, run.wall_s
    assert wall < 30, manifest["stop_reason"]
    assert manifest["stop_reason"].startswith("error storm:") and "2 probe requests" in manifest["stop_reason"]
    storm = manifest["storms"][0]
    assert storm["failed_probes"] == 2 and storm["outcome"] == "stopped"
    probes = df[df.phase == "storm_probe"]
    assert (df[df.phase != "storm_probe"].started_at > storm["paused_at"] + 0.5).sum() == 0  # no user sent
    assert len(truth) == len(df) and len(probes) == 2 and (probes.error_kind == "server_error").all()
    assert (probes.started_at > storm["paused_at"]).all() and probes.request_id.is_unique
    assert set(manifest["scheduler_lag"]["workers"]) == set(df[df.phase != "storm_probe"].worker)


def test_the_storm_breaker_resumes_when_a_probe_succeeds(tmp_path: Path) -> None:
    """The load's prompts fail (a fault marker in each), the probe's does not: the users resume."""
    data = tmp_path / "prompts.jsonl"
    lines = (json.dumps({"prompt": f"q{i} [[fault:status code=500 body=json]]"}) + "\n" for i in range(50))
    data.write_text("".join(lines))
    scenario = write_scenario(tmp_path, """
[prompt]
dataset = "prompts.jsonl"
[output]
max_tokens = 4
[load]
kind = "constant"
users = 2
step_s = 7
[stop]
drain_s = 2
storm_s = 2
""")
    run = sim_run(tmp_path, scenario, sim_args=["--profile", "fast"], ok=False)
    df, manifest = run.records, run.manifest
    assert manifest["stop_reason"] == "duration" or manifest["stop_reason"] == "plan complete"
    assert manifest["storms"][0]["outcome"] == "resumed"
    resumed = manifest["storms"][0]["resumed_at"]
    assert (df.started_at > resumed).any()  # sending again after the probe succeeded


@pytest.mark.parametrize("cap, rate", [("max_rps = 4", 4.0), ("max_tokens_per_min = 1800", 30 / 20)])
def test_our_own_caps_hold_across_workers(tmp_path: Path, cap: str, rate: float) -> None:
    """Over two processes: max_rps = 4 sends about 4 requests a second in all, not 6 users' worth;
    max_tokens_per_min = 1800 (30 tokens/s) about one 20-token request (16 in + 4 out) every 2/3 s.
    Counted over the step as the manifest timed it (it can outlast its 5 s by the time the workers take to
    hear it ended), plus the one request each process may send at once."""
    scenario = write_scenario(tmp_path, SHORT + f"""
[load]
kind = "constant"
users = 6
step_s = 5
{cap}
[stop]
drain_s = 2
""")
    run = sim_run(tmp_path, scenario, "--processes", "2", sim_args=["--profile", "fast"], ok=False)
    result, df, manifest, truth = run.result, run.records, run.manifest, run.truth
    assert result.returncode == 0, result.stderr
    assert df.worker.nunique() == 2 and len(df) == len(truth)
    step = manifest["steps"][0]
    span = max(step["ended_at"], df.started_at.max()) - step["started_at"]
    assert rate * span / 2 <= len(df) <= rate * span + 2, (len(df), span)
    assert df.held_s.max() > 0  # the gate, not the channel, set the pace


def test_input_errors_neither_trip_the_breakpoint_nor_fail_fast(tmp_path: Path) -> None:
    """Every request is refused as too long (an input error): no load-error breakpoint, no misconfiguration stop."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 4
[load]
kind = "steps"
users = [1, 2]
step_s = 2
[stop]
breakpoint_error_rate = 0.1
drain_s = 2
""")
    sim = ["--profile", str(profile(tmp_path, 'extends = "fast"\nmax_output_tokens = 2\n'))]
    run = sim_run(tmp_path, scenario, sim_args=sim, ok=False)
    df, manifest = run.records, run.manifest
    # every answered request is an input error; the end's hard cut (drain_s = 2) may catch a user's last one
    # unanswered (a CI run: 1 of 4152, with the simulator busy answering a thousand refusals a second)
    answered = df[~df["in_flight"]]
    assert answered.error_kind.eq("bad_request").all() and len(answered) > 10
    assert df["in_flight"].sum() <= 2 and (df.loc[df["in_flight"], "status"] == "cancelled").all()
    assert manifest["stop_reason"] == "plan complete", manifest["stop_reason"]
    assert df.step.max() == 2
