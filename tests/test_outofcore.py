"""A run too long to load, analysed out of core (`analysis.outofcore`): the same numbers as the analysis of the
whole frame.

Forced on the suite's runs by two levers of `analysis.records`: a run counts as too long past
ANALYSIS_ROWS records (set to 0), and its chunks are CHUNK_ROWS long (set small, so a step spans many).
With the whole run as its "sample" every number of summary.json must equal the in-memory analysis (up to
the order of float sums); with a real sample of a third, every count, rate, SLO attainment and step
percentile with its interval still must, since those are counted over every record.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from simfixtures import DemoRun

from tokenload import quantiles
from tokenload.analysis import records, stats
from tokenload.analysis.outage import channel_words
from tokenload.analysis.pipeline import analyze, analyze_run
from tokenload.analysis.ratelimits import rate_limits
from tokenload.analysis.stats import km_quantiles
from tokenload.analysis.synthetic import Law, generate, manifest_for

# The step keys counted over every record (the others, `outofcore.FROM_SAMPLE`, come from the sample).
EXACT_STEP_KEYS = (
    "requests", "errors", "load_errors", "censored", "open_at_step_end", "warmup_excluded", "ok", "output_tokens",
    "error_rate", "slo_attainment", "slo_n", "slo_ci", "goodput_share", "output_tok_s", "input_tok_s", "rps",
    "achieved_rate", "goodput_rps", "achieved_concurrency", "ttft_n", "tpot_n", "e2e_n", "ttft_censored",
    "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "ci", "bounds",
)


def _awkward_run(run_dir: Path) -> Path:
    """A synthetic ramp with what the analysis treats specially: streams cut open (at the end and at a step
    down), warm-up requests set apart, errors, a second model, TTFTs that may hold the client's delay."""
    law = Law(users=(1, 2, 4, 8, 16), capacity=6.0, error_rates={8: 0.02, 16: 0.05})
    df = generate(law, n=6_000, seed=11)
    rng = np.random.default_rng(11)
    n = len(df)
    end = float(df["finished_at"].max())
    cut = rng.uniform(size=n) < 0.02
    df["in_flight"] = cut
    df["cut_at"] = np.where(cut, np.where(rng.uniform(size=n) < 0.5, end, df["started_at"] + 0.1), np.nan)
    for column in ("ttft_s", "tpot_s", "e2e_s", "finished_at"):
        df.loc[cut, column] = np.nan
    df.loc[cut & (rng.uniform(size=n) < 0.5), "ttft_s"] = 0.05
    df["phase"] = np.where(rng.uniform(size=n) < 0.01, "warmup", "measure")
    df["model"] = np.where(rng.uniform(size=n) < 0.3, "sim-13b", law.model)
    df["ttft_exact"] = rng.uniform(size=n) < 0.9
    df = df.sort_values("started_at", kind="stable").reset_index(drop=True)
    return records.write_run(run_dir, df, manifest_for(law, df))


def _whole_as_sample(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """Every run goes out of core, with every record as its sample (the frame the in-memory path reads)."""
    real = records._sample
    monkeypatch.setattr(records, "ANALYSIS_ROWS", 0)
    monkeypatch.setattr(records, "CHUNK_ROWS", chunk)
    monkeypatch.setattr(records, "_sample", lambda parquet, columns, total, keep: real(parquet, columns, total, total))


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two JSON values differ (floats by 1e-9 relative: sums over chunks add in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted({*a, *b}, key=str) for d in _same(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float | int) and not isinstance(b, bool):
        if (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            return []
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _without_sampling(summary: Any) -> dict[str, Any]:
    out = dict(summary)
    out["run"] = {k: v for k, v in summary["run"].items() if k != "sampled"}
    out["problems"] = [p for p in summary["problems"] if "too many to hold" not in p]
    return out


def _compare_whole(run_dir: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    in_memory = analyze_run(run_dir, write=False)
    with monkeypatch.context() as patch:
        _whole_as_sample(patch, chunk)
        out_of_core = analyze_run(run_dir, write=False)
    total = pq.ParquetFile(run_dir / "requests.parquet").metadata.num_rows
    assert out_of_core["run"]["sampled"]["records"] == out_of_core["run"]["sampled"]["sample"] == total
    assert any("too many to hold" in p for p in out_of_core["problems"])
    differences = _same(_without_sampling(in_memory), _without_sampling(out_of_core))
    assert not differences, differences[:20]


def test_out_of_core_gives_every_number_of_the_in_memory_analysis(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut streams, a step down, warm-up, errors, two models, inexact TTFTs, in chunks of 97 records: summary.json
    equal, key by key (steps, percentiles and intervals, fits, SLO, errors, completeness, verdicts)."""
    run_dir = _awkward_run(tmp_path / "run")
    _compare_whole(run_dir, monkeypatch, chunk=97)


def test_a_sampled_run_counts_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample of a third stands for the run: its counts, rates, SLO attainment and step percentiles with
    their intervals are still the whole run's; the summary says what came from the sample, and how far off
    any percentile of it may be."""
    run_dir = _awkward_run(tmp_path / "run")
    in_memory = analyze_run(run_dir, write=False)
    total = int(pd.read_parquet(run_dir / "requests.parquet", columns=["step"]).shape[0])
    with monkeypatch.context() as patch:
        patch.setattr(records, "ANALYSIS_ROWS", total // 3)
        patch.setattr(records, "CHUNK_ROWS", 500)
        sampled = analyze_run(run_dir, write=False)
    assert sampled["run"]["sampled"]["records"] == total and sampled["run"]["sampled"]["sample"] == total // 3
    assert 0 < sampled["run"]["sampled"]["rank_error"] < 0.05
    for key in ("requests", "ok", "errors", "in_flight", "cut_step_down", "models", "completeness"):
        assert sampled["run"][key] == in_memory["run"][key], key
    assert _same(sampled["slo"], in_memory["slo"]) == []
    assert sampled["errors_by_kind"] == in_memory["errors_by_kind"]
    assert len(sampled["steps"]) == len(in_memory["steps"])
    for mine, whole in zip(sampled["steps"], in_memory["steps"]):
        differences = _same({k: mine.get(k) for k in EXACT_STEP_KEYS}, {k: whole.get(k) for k in EXACT_STEP_KEYS})
        assert not differences, differences[:10]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["offpeak", "peak"])
def test_the_demo_runs_out_of_core_give_the_same_numbers(demo_run: DemoRun, phase: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's runs of `tokenload demo` (the suite's shared ones), out of core in chunks of 50 records."""
    _compare_whole(demo_run.out / phase, monkeypatch, chunk=50)


def test_kaplan_meier_walked_in_blocks_is_the_one_pass_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of millions of censored latencies is walked a block of events at a time: bit for bit the quantiles
    of one cumulative product over every observation (ties of events and censorings included)."""
    rng = np.random.default_rng(4)
    times = np.round(rng.lognormal(0, 1, 5_000), 2)  # ties
    events = rng.uniform(size=times.size) < 0.8
    qs = [0.01, 0.5, 0.9, 0.95, 0.99, 0.999]
    whole = km_quantiles(times, events, qs)
    monkeypatch.setattr(quantiles.KaplanMeier, "BLOCK", 7)
    assert km_quantiles(times, events, qs) == whole
    order = np.lexsort((~events, times))  # the one-pass curve, as before the blocks
    t, e = times[order], events[order]
    cdf = 1.0 - np.cumprod(np.where(e, 1.0 - 1.0 / (t.size - np.arange(t.size)), 1.0))
    assert [q.value for q in whole] == [float(t[np.flatnonzero(e & (cdf >= q - 1e-12))[0]]) for q in qs]


def test_the_large_sample_kaplan_meier_interval_is_the_bootstraps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past KM_BOOTSTRAP_MAX_N censored observations the interval is Brookmeyer-Crowley's from one curve: on
    20,000 (a fifth censored) it lies within a tenth of the bootstrap's width of the bootstrap's ends, and
    it covers the true quantile."""
    rng = np.random.default_rng(9)
    truth = rng.lognormal(0, 0.5, 20_000)
    cut = rng.uniform(0, 6, truth.size)
    times, events = np.minimum(truth, cut), truth <= cut
    for q in (0.5, 0.9):
        boot = stats.bootstrap_ci(times, events, q, seed=1, resamples=400)
        assert boot is not None
        monkeypatch.setattr(stats, "KM_BOOTSTRAP_MAX_N", 1_000)
        large = stats.bootstrap_ci(times, events, q, seed=1)
        monkeypatch.setattr(stats, "KM_BOOTSTRAP_MAX_N", 10**9)
        assert large is not None and large != boot
        width = boot[1] - boot[0]
        assert abs(large[0] - boot[0]) < 0.1 * width + 1e-9 and abs(large[1] - boot[1]) < 0.1 * width + 1e-9
        true = float(np.exp(0.5 * {0.5: 0.0, 0.9: 1.2815515655446004}[q]))
        assert large[0] <= true <= large[1]


def test_one_model_of_a_run_out_of_core_is_that_models_in_memory(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A comparison of a run's models analyses one model's requests: out of core, only its chunks' rows count."""
    run_dir = _awkward_run(tmp_path / "run")
    in_memory = analyze(run_dir, write=False, model="sim-13b").summary
    with monkeypatch.context() as patch:
        _whole_as_sample(patch, chunk=211)
        out_of_core = analyze(run_dir, write=False, model="sim-13b").summary
    assert 1000 < in_memory["run"]["requests"] < 2500
    differences = _same(_without_sampling(in_memory), _without_sampling(out_of_core))
    assert not differences, differences[:20]


def test_rate_limits_and_the_channels_words_read_a_chunk_at_a_time(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What `rate_limits` and `outage.channel_words` read from requests.parquet themselves, in chunks of 97: the
    same as the whole file at once (the lowest headroom's first row, the first 429, holds, retries, words)."""
    law = Law(users=(1, 2, 4), capacity=3.0, error_rates={4: 0.05})
    df = generate(law, n=3_000, seed=5)
    rng = np.random.default_rng(5)
    n = len(df)
    df["worker"] = np.where(rng.uniform(size=n) < 0.5, "w0", "w1")
    limited = rng.uniform(size=n) < 0.03
    df["status"] = np.where(limited, "error", df["status"])
    df["error_kind"] = np.where(limited, "rate_limited", df["error_kind"].astype(object))
    df["http_status"] = np.where(limited, 429, df["http_status"])
    df["error_message"] = np.where(limited, rng.choice(["slow down", "quota"], n), None)
    df["rl_requests_limit"] = np.where(rng.uniform(size=n) < 0.7, 600.0, np.nan)
    df["rl_requests_remaining"] = np.round(rng.uniform(1, 600, n))
    lowest = int(np.flatnonzero(~limited & df["rl_requests_limit"].notna().to_numpy())[n // 2])
    df.loc[lowest, "rl_requests_remaining"] = 0.0  # the run's lowest headroom, in a request nothing else keeps
    df["rl_tokens_limit"] = np.where(rng.uniform(size=n) < 0.5, 90_000.0, np.nan)
    first = df["started_at"] < df["started_at"].quantile(0.1)
    df.loc[first, ["rl_requests_limit", "rl_tokens_limit"]] = np.nan  # chunks without any: the run's first tenth
    df["rl_tokens_remaining"] = rng.integers(0, 90_000, n).astype(float)
    df["backoff_s"] = np.where(limited, rng.uniform(0.5, 3, n), np.nan)
    df["held_s"] = rng.exponential(0.01, n)
    df["retry_of"] = np.where(rng.uniform(size=n) < 0.02, "x", None)
    run_dir = records.write_run(tmp_path / "run", df.sort_values("started_at", kind="stable"), manifest_for(law, df))
    whole = rate_limits(run_dir, None), channel_words(run_dir)
    monkeypatch.setattr(records, "CHUNK_ROWS", 97)
    assert (rate_limits(run_dir, None), channel_words(run_dir)) == whole
    assert whole[0]["rate_limited"] == int(limited.sum()) and whole[0]["lowest_requests_remaining"]["remaining"] == 0
    assert whole[0]["held_s"] == round(float(df["held_s"].sum()), 3) and whole[0]["retries"] == df["retry_of"].notna().sum()
    assert set(whole[1]) == {"rate_limited", "overloaded"}
