"""`tokenload demo` end to end: simulator, two real Locust runs, analysis, comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from simfixtures import DemoRun

pytestmark = pytest.mark.slow

SUMMARY_KEYS = {"fits", "formula", "steps", "breakpoint", "diagnosis"}
STEP_KEYS = {"step", "active_users", "requests", "errors", "error_rate", "rps", "output_tok_s", "ttft_p50_s",
             "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "e2e_p95_s", "slo_attainment", "formula_mape"}


def test_demo_writes_reports_and_comparison(demo_run: DemoRun) -> None:
    """`tokenload demo --duration 10` (run side by side with the other long runs: tests/simfixtures.py).

    The console script runs in a directory holding an empty `tokenload/` folder: its children (the
    simulator, Locust) import the installed package, not that folder.
    """
    out, proc = demo_run.out, demo_run.proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    printed = [Path(line) for line in proc.stdout.split()]
    assert printed == [out / "offpeak" / "report.html", out / "peak" / "report.html",
                       out / "comparison" / "comparison.html"]
    for path in printed:
        assert path.stat().st_size > 10_000, path
    for phase in ("offpeak", "peak"):
        summary = json.loads((out / phase / "summary.json").read_text())
        assert SUMMARY_KEYS <= summary.keys()
        assert summary["steps"] and STEP_KEYS <= summary["steps"][0].keys()
        assert summary["fits"]["e2e_vs_output"]["n"] > 5
        assert summary["errors_by_kind"].get("client_error", 0) == 0
        assert len(list((out / phase / "plots").glob("*.png"))) >= 6
        # a searched run: a stream cut at a step down is censored at its cut, so no latency's lower bound goes
        # past the longest any request lasted (it read "p99 ≥ 11.5 s": censored at the run's end); the verdict
        # judges each probe, with no attainment pooled over them
        df = pd.read_parquet(out / phase / "requests.parquet")
        longest = float((df["finished_at"].fillna(df["cut_at"]) - df["started_at"]).max())
        for metric in ("ttft", "e2e"):
            lat = summary["latency"][metric]
            assert all(lat[q] <= longest + 1e-6 for q in lat["bounds"]), (phase, metric, lat, longest)
        assert summary["slo"]["attainment"] is None and len(summary["search"]["probes"]) >= 3
    assert "Probe 3" in proc.stderr and "SLO attainment" not in proc.stderr  # the verdict tables
    comparison = json.loads((out / "comparison" / "comparison.json").read_text())
    tpot = next(d for d in comparison["deltas"] if d["metric"] == "tpot")
    # The peak profile slows every decode step by 1.8x: the comparison must see it.
    assert tpot["verdict"] == "slower" and tpot["ratio_p50"] > 1.3
