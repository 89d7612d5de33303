"""`tokenload watch --stress`: a load test at set hours, ingested beside the samples, within the budget."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from tokenload.dayclock import DAY_S, day_hour, utc_offset_s
from tokenload.errors import ConfigError
from tokenload.history.sampler import ESTIMATE_MARGIN, parse_stress
from tokenload.history.store import open_store
from tokenload.sim import serve_in_thread
from tokenload.workload.scenario import load_scenario

STRESS = """
name = "mini"
[prompt]
tokens = 32
[output]
max_tokens = 8
[load]
kind = "constant"
users = 2
step_s = 3
[stop]
drain_s = 5
"""


@pytest.mark.parametrize("bad", ["ramp", "ramp@25:00", "ramp@3", "@03:00", "ramp@03:00,x"])
def test_a_bad_stress_spec_names_the_fix(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SCENARIO@HH:MM"):
        parse_stress(bad, tmp_path)


def test_stress_times_and_the_budget_margin(tmp_path: Path) -> None:
    stress = parse_stress("ramp@14:00,03:30", tmp_path)
    assert stress.hours == (3.5, 14.0) and stress.scenario.name == "ramp"
    t = 1_700_000_000.0
    start = t - (t + utc_offset_s(t)) % DAY_S
    assert stress.next_at(start + 2 * 3600, DAY_S) == start + 3.5 * 3600
    assert stress.next_at(start + 15 * 3600, DAY_S) == start + DAY_S + 3.5 * 3600
    ramp = load_scenario("ramp")
    users = max(ramp.load.users)
    per_request = int(ramp.prompt.tokens.upper * ESTIMATE_MARGIN + 0.999) + 8 + ramp.output.max_tokens.upper
    assert stress.worst_overshoot() == users * per_request


def _communicate(proc: subprocess.Popen[str], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _startup_s() -> float:
    """How long a tokenload command takes to start on this machine now (seconds on a busy one)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "tokenload", "watch", "--help"], capture_output=True, check=True)
    return time.monotonic() - started


def test_stress_runs_at_its_hour_and_lands_in_the_database(tmp_path: Path) -> None:
    """The stress hour is the first whole one after twice the start-up a command takes here now (a watcher that
    starts after it waits a whole day: on a busy machine one started 2-4 s ahead missed it), and the watchers
    sample until a few seconds past it."""
    scenario = tmp_path / "mini.toml"
    scenario.write_text(STRESS)
    period, hour_s = 48.0, 2.0
    lead = 2 * _startup_s() + 1
    at = math.ceil(day_hour(time.time() + lead, period)) % 24
    wait = (at - day_hour(time.time(), period)) % 24 * hour_s
    samples, tight_samples = math.ceil(wait) + 3, math.ceil(wait / 1.5) + 3  # every 1 s and every 1.5 s
    db = tmp_path / "data" / "h.db"
    with serve_in_thread("fast") as sim:
        base = [sys.executable, "-m", "tokenload", "watch", "--base-url", sim.base_url, "--model", "sim-7b",
                "--every", "1s", "--period", "48s", "--db", str(db)]
        # Two watchers side by side on databases of their own: this one runs the stress scenario; the second
        # (below) has a budget too small for anything, so it never sends a request to disturb the first.
        watching = subprocess.Popen([*base, "--stress", f"{scenario}@{at:02d}:00", "--samples", str(samples),
                                     "--max-tokens-per-day", "1000000"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        fresh = tmp_path / "tight" / "h.db"
        tight_watching = subprocess.Popen([*base, "--db", str(fresh), "--stress", f"{scenario}@{at:02d}:00",
                                           "--samples", str(tight_samples), "--every", "1.5s",
                                           "--max-tokens-per-day", "120"],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            done = _communicate(watching, timeout=120)
        finally:
            tight = _communicate(tight_watching, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "stress mini:" in done.stdout, done.stdout
        runs = list((tmp_path / "data" / "runs").iterdir())
        assert len(runs) == 1 and (runs[0] / "requests.parquet").is_file()
        with closing(open_store(db)) as store:
            frame = store.query()
            stress_rows = frame[frame["source"] == "run"]
            assert len(stress_rows) > 0 and set(stress_rows["active_users"]) == {2}
            assert len(frame[frame["source"] == "watch"]) == 3 * samples  # each sample: three requests
            spent = store.tokens_used(next(iter(dict(store.channels()))), 0, 2e10)
            assert spent == int(frame["input_tokens"].sum() + frame["output_tokens"].sum())
        # a budget that cannot hold the worst case of the 2 users in flight (2 x (48 + 8 + 8)) skips the run
        assert tight.returncode == 0, tight.stderr
        assert "stress mini SKIPPED (budget: 120 tokens left today)" in tight.stdout, tight.stdout
        assert not (tmp_path / "tight" / "runs").exists()
        with closing(open_store(fresh)) as store:
            assert len(store.query()) == 0  # the probes (3 x 136 tokens at worst) were skipped too
