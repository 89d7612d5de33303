"""Censoring, sample size, warm-up, goodput and incomplete runs, on records whose truth is known."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenload.analysis import analyze_run
from tokenload.analysis.records import write_run
from tokenload.analysis.report import verdict_rows
from tokenload.analysis.stats import bootstrap_ci, km_quantiles
from tokenload.analysis.synthetic import Law, generate, manifest_for
from tokenload.cli import main
from tokenload.search.evidence import wilson_interval

NO_QUEUE = 10_000


def test_kaplan_meier_by_hand_and_lower_bound() -> None:
    times = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    events = np.array([True, True, True, False, False])
    # S: 4/5 after t=1, 3/5 after 2, 3/5 x 2/3 = 2/5 after 3; the CDF never passes 0.6.
    q50, q70 = km_quantiles(times, events, [0.5, 0.7])
    assert (q50.value, q50.bound) == (3.0, False)
    assert (q70.value, q70.bound) == (5.0, True)
    # Without censoring it is numpy's percentile exactly.
    plain = km_quantiles(times, np.ones(5, bool), [0.5, 0.95])
    assert [q.value for q in plain] == pytest.approx(np.percentile(times, [50, 95]).tolist())


def test_bootstrap_interval_is_seeded_and_covers_the_truth() -> None:
    rng = np.random.default_rng(3)
    sample = rng.exponential(1.0, 2000)
    ci = bootstrap_ci(sample, np.ones(2000, bool), 0.5, seed=11)
    assert ci == bootstrap_ci(sample, np.ones(2000, bool), 0.5, seed=11)
    assert ci[0] < np.log(2) < ci[1] and ci[1] - ci[0] < 0.15
    assert bootstrap_ci(sample[:3], np.ones(3, bool), 0.5, seed=1) is None
    # Past BOOTSTRAP_MAX_N the order-statistic interval stands in; it agrees with the bootstrap.
    big = rng.exponential(1.0, 20_000)
    fast = bootstrap_ci(big, np.ones(big.size, bool), 0.95, seed=2)
    slow = bootstrap_ci(big[:5000], np.ones(5000, bool), 0.95, seed=2)
    assert fast[0] < -np.log(0.05) < fast[1] and (fast[1] - fast[0]) < (slow[1] - slow[0])
    lo, hi = wilson_interval(9, 10)
    assert 0.59 < lo < 0.6 and 0.98 < hi < 0.99


def _censored_run(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A ramp whose last step was cut while a third of its requests were still waiting for a first token."""
    law = Law(capacity=NO_QUEUE, users=(1, 2, 4, 8))
    df = generate(law, n=3000, seed=4)
    last = df.index[df["step"].eq(df["step"].max())]
    slow = last[np.argsort(df.loc[last, "ttft_s"].to_numpy())[-len(last) // 3:]]
    true_ttft = df.loc[last, "ttft_s"].to_numpy() + np.where(np.isin(last, slow), 5.0, 0.0)
    cut = float(df["finished_at"].max())
    df.loc[slow, "started_at"] = cut - 2.0  # waited 2 s for a first token when the run stopped
    df.loc[slow, ["ttft_s", "ttft_text_s", "tpot_s", "e2e_s"]] = np.nan
    df.loc[slow, "in_flight"] = True
    df.loc[slow, "output_tokens"] = 0
    manifest = manifest_for(law, df)
    manifest["ended_at"] = cut
    return write_run(tmp_path / "run", df, manifest), true_ttft


def test_cut_requests_are_censored_not_dropped(tmp_path: Path) -> None:
    run_dir, true_ttft = _censored_run(tmp_path)
    s = analyze_run(run_dir)
    last = s["steps"][-1]
    assert last["censored"] == last["ttft_censored"] > 0
    assert last["open_at_step_end"] >= last["censored"]
    # Their TTFT is > 2 s, so p95 is at least 2 s: reported as a bound, far above what dropping them gave.
    assert "ttft_p95_s" in last["bounds"] and last["ttft_p95_s"] >= 2.0
    assert np.percentile(true_ttft, 95) >= last["ttft_p95_s"]
    assert last["ttft_p50_s"] < 2.0 and "ttft_p50_s" not in last["bounds"]
    html = (run_dir / "report.html").read_text()
    assert "≥ 2" in html
    rows = {topic: text for topic, text, _ in verdict_rows(s)}
    assert f"{last['censored']} still open at the end, censored when cut" in rows["TTFT"]


def test_a_stream_cut_at_a_step_down_is_censored_when_it_was_cut_not_at_the_runs_end(tmp_path: Path) -> None:
    # Step 2's slowest third was cut at a step down, each 3 s after it was sent (longer than any TTFT here); the
    # run then went on 20 s. Their TTFT is at least 3 s, no more is known: 20 s would be a bound past any wait.
    law = Law(capacity=NO_QUEUE, users=(1, 2, 1))
    df = generate(law, n=1500, seed=5)
    step2 = df.index[df["step"].eq(2)]
    slow = step2[np.argsort(df.loc[step2, "ttft_s"].to_numpy())[-len(step2) // 3:]]
    df["cut_at"] = np.nan
    df.loc[slow, "cut_at"] = df.loc[slow, "started_at"] + 3.0
    df.loc[slow, ["ttft_s", "ttft_text_s", "tpot_s", "e2e_s", "finished_at"]] = np.nan
    df.loc[slow, "in_flight"] = True
    manifest = manifest_for(law, df)
    manifest["ended_at"] = float(df["finished_at"].max()) + 20.0
    s = analyze_run(write_run(tmp_path / "run", df, manifest), write=False)
    step = next(row for row in s["steps"] if row["step"] == 2)
    assert step["ttft_censored"] == len(slow) and "ttft_p95_s" in step["bounds"]
    assert step["ttft_p95_s"] == pytest.approx(3.0, abs=1e-6)
    assert s["latency"]["ttft"]["censored_step_down"] == len(slow) == s["run"]["cut_step_down"]
    rows = {topic: text for topic, text, _ in verdict_rows(s)}
    assert f"{len(slow)} cut at a step down" in rows["TTFT"] and "still open at the end" not in rows["TTFT"]
    assert f"{len(slow)} cut at a step down)" in rows["Requests"]


def test_interrupted_run_is_flagged_and_gets_no_clean_verdict(tmp_path: Path) -> None:
    law = Law(capacity=NO_QUEUE, users=(1, 2, 4))
    df = generate(law, n=2000, seed=6)
    manifest = manifest_for(law, df)
    manifest["stop_reason"] = "interrupted"
    manifest["plan"] = [{"step": i + 1, "users": u, "rate": None} for i, u in enumerate((1, 2, 4, 8, 16, 32))]
    s = analyze_run(write_run(tmp_path / "run", df, manifest))
    complete = s["run"]["completeness"]
    assert complete["interrupted"] and complete["steps_run"] == 3 and complete["steps_planned"] == 6
    assert "never broke" not in s["breakpoint_note"] and "not measured" in s["breakpoint_note"]
    rows = [(topic, text) for topic, text, _ in verdict_rows(s)]
    assert rows[0][0] == "Run incomplete" and "interrupted" in rows[0][1] and "step 3 of 6" in rows[0][1]
    assert complete["note"].startswith("the run was interrupted during step 3 of 6")  # not "interrupted (interrupted)"
    assert "Run incomplete" in (tmp_path / "run" / "report.html").read_text()


def test_too_small_steps_cannot_decide_the_breakpoint(tmp_path: Path) -> None:
    law = Law(capacity=NO_QUEUE, users=(1, 2, 4, 8), error_rates={1: 1.0})
    df = generate(law, n=3000, seed=2)
    keep = ~df["step"].eq(1) | (np.arange(len(df)) % 50 == 0)  # step 1: a handful of requests, all failing
    s = analyze_run(write_run(tmp_path / "run", df[keep], manifest_for(law, df)), write=False)
    small = s["steps"][0]
    assert small["requests"] < 20 and small["decided"] is False and small["load_errors"] > 0
    assert s["breakpoint"] is None
    assert f"step 1 (1 user, n={small['requests']}) had too few requests to judge" in s["breakpoint_note"]


def test_warmup_goodput_and_percentiles_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    law = Law(capacity=NO_QUEUE, users=(2, 4))
    df = generate(law, n=3000, seed=8)
    starts = df.groupby("step")["started_at"].transform("min")
    early = (df["started_at"] - starts) < 1.0
    df.loc[early, "ttft_s"] += 30.0  # a cold start: the first second of each step is slow
    df.loc[early, "e2e_s"] += 30.0
    df["finished_at"] = df["started_at"] + df["e2e_s"]
    run_dir = write_run(tmp_path / "run", df, manifest_for(law, df))
    assert main(["analyze", str(run_dir), "--quiet", "--warmup", "1", "--percentiles", "50,90,99.9",
                 "--goodput", "ttft:600", "e2e:2500"]) == 0
    s = json.loads((run_dir / "summary.json").read_text())
    assert [st["warmup_excluded"] for st in s["steps"]] == df[early].groupby("step").size().tolist()
    assert all(st["ttft_p99.9_s"] < 30 for st in s["steps"])  # the cold second is out
    assert set(s["latency"]["ttft"]) >= {"p50", "p90", "p95", "p99.9"}
    measured = df[~early]
    for st in s["steps"]:
        rows = measured[measured["step"].eq(st["step"])]
        truth = ((rows["ttft_s"] <= 0.6) & (rows["e2e_s"] <= 2.5)).mean()
        assert st["goodput_share"] == pytest.approx(truth, abs=1e-6)
    assert s["analysis_options"]["goodput_s"] == {"ttft": 0.6, "e2e": 2.5}
    html = (run_dir / "report.html").read_text()
    assert "ttft &lt;= 600 ms" in html and "1 s (requests started" in html
    assert main(["analyze", str(run_dir), "--goodput", "latency:5"]) == 2
    assert main(["analyze", str(run_dir), "--percentiles", "50,100"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("tokenload: error:") == 2


def test_connection_setup_is_its_own_statistic_per_step(tmp_path: Path) -> None:
    """`connect_s` (kept out of TTFT) is summarised per step over the requests that opened a connection."""
    law = Law(capacity=NO_QUEUE, users=(1, 2))
    df = generate(law, n=400, seed=8)
    rng = np.random.default_rng(8)
    fresh = rng.uniform(0, 1, len(df)) < 0.25
    df["connect_s"] = np.where(fresh, rng.uniform(0.01, 0.2, len(df)), 0.0)
    df["reconnects"] = np.where(rng.uniform(0, 1, len(df)) < 0.05, 1, 0)
    s = analyze_run(write_run(tmp_path / "run", df, manifest_for(law, df)), write=False)
    for row in s["steps"]:
        rows = df[df["step"].eq(row["step"])]
        opened = rows.loc[rows["connect_s"] > 0, "connect_s"]
        assert row["new_connections"] == len(opened) > 0
        assert row["connect_p50_s"] == pytest.approx(float(np.median(opened)), abs=1e-4)
        assert row["connect_p95_s"] == pytest.approx(float(np.quantile(opened, 0.95)), abs=1e-4)
        assert row["reconnects"] == int(rows["reconnects"].sum())


def test_first_tokens_read_with_later_ones_are_counted_per_step(tmp_path: Path) -> None:
    """A request whose first token was read with later ones (`first_read_tokens` > 1) has an upper-bound TTFT:
    each step says how many of its requests are such."""
    law = Law(capacity=NO_QUEUE, users=(1, 2))
    df = generate(law, n=400, seed=9)
    rng = np.random.default_rng(9)
    df["first_read_tokens"] = np.where(rng.uniform(0, 1, len(df)) < 0.1, rng.integers(2, 4, len(df)), 1)
    s = analyze_run(write_run(tmp_path / "run", df, manifest_for(law, df)), write=False)
    for row in s["steps"]:
        rows = df[df["step"].eq(row["step"])]
        assert row["ttft_upper_bounds"] == int(rows["first_read_tokens"].gt(1).sum()) > 0


def test_inexact_ttfts_are_left_out_of_a_steps_percentiles_and_counted(tmp_path: Path) -> None:
    """A TTFT that may hold the client's delay (`ttft_exact` False: here read 0.5 s late) stays out of the
    step's TTFT percentiles, which are those of the exact ones, and the step counts it; a step with no exact
    TTFT at all (HTTPS) keeps every one."""
    law = Law(capacity=NO_QUEUE, users=(1, 2))
    df = generate(law, n=400, seed=10)
    rng = np.random.default_rng(10)
    late = rng.uniform(0, 1, len(df)) < 0.2
    exact_ttft = df["ttft_s"].copy()
    df["ttft_s"] = np.where(late, df["ttft_s"] + 0.5, df["ttft_s"])
    df["ttft_exact"] = np.where(df["step"].eq(2), None, np.where(late, False, True)).astype(object)
    df.loc[df["step"].eq(2), "ttft_exact"] = False
    s = analyze_run(write_run(tmp_path / "run", df, manifest_for(law, df)), write=False)
    first, second = s["steps"]
    rows = df["step"].eq(first["step"]) & df["status"].eq("ok")
    kept = exact_ttft[rows & ~late]
    assert first["ttft_inexact"] == int((rows & late).sum()) > 0
    assert first["ttft_n"] == len(kept)
    assert first["ttft_p50_s"] == pytest.approx(float(np.median(kept)), abs=2e-3)
    in_second = df["step"].eq(second["step"]) & df["status"].eq("ok")
    assert second["ttft_inexact"] == second["ttft_n"] == int(in_second.sum())


def test_verdict_table_prints_findings_verbatim(tmp_path: Path) -> None:
    """A finding that names a scenario section (`[session]`) is text, not rich markup to strip."""
    from rich.console import Console

    from tokenload.analysis.report import verdict_table

    law = Law(capacity=NO_QUEUE, users=(1, 2))
    df = generate(law, n=200, seed=5)
    df["cache_read_input_tokens"] = df["cache_creation_input_tokens"] = 0  # single-turn requests: the caching verdict says to use a [session] scenario
    s = analyze_run(write_run(tmp_path / "run", df, manifest_for(law, df)), write=False)
    assert any("[session]" in finding for _, finding, _ in verdict_rows(s))
    console = Console(record=True, width=300)
    console.print(verdict_table(s))
    printed = console.export_text()
    for _, finding, _ in verdict_rows(s):
        assert finding in printed
