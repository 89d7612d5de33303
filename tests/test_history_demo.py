"""`tokenload demo --history`: a compressed simulated day watched and reported end to end."""

from __future__ import annotations

import json

from simfixtures import DemoRun


def test_demo_history_finds_the_simulated_peak_and_off_peak(history_demo_run: DemoRun) -> None:
    """`tokenload demo --history --duration 48` (run side by side with the other long runs: tests/simfixtures.py)."""
    out, done = history_demo_run.out, history_demo_run.proc
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(out / "history" / "history.html")
    result = next(iter(json.loads((out / "history" / "history.json").read_text()).values()))
    peak, off = result["metrics"]["ttft"]["peak"], result["metrics"]["ttft"]["off_peak"]
    assert peak and off, done.stdout
    assert abs(peak["hours"][0] - 13) <= 1 and abs(peak["hours"][-1] - 16) <= 1
    assert abs(off["hours"][0] - 1) <= 1 and abs(off["hours"][-1] - 5) <= 1
    assert "advice: at " in done.stdout and (out / "history.db").is_file()
