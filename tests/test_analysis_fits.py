"""Fits that know their limits: no slope from a length that barely varies, prefill fitted on the
least-concurrent requests, and an intercept the shortest prompts contradict is flagged, not advised on."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tokenload.analysis.diagnosis import diagnose_latency
from tokenload.analysis.fits import intercept_check, ttft_vs_input
from tokenload.analysis.summary import least_concurrent
from tokenload.slo import Slo


def test_fixed_prompt_is_not_fitted() -> None:
    """A '256-token' prompt the server counts as 256-280 once gave 0.0553 s/token, intercept -12.8 s."""
    rng = np.random.default_rng(1)
    n = rng.integers(256, 281, 300).astype(float)
    ttft = 1.0 + rng.normal(0, 0.3, 300) + 0.05 * (n - 268)
    fit = ttft_vs_input(n, ttft)
    assert fit["model"] is None and fit["slope_s_per_token"] is None
    assert fit["note"].startswith("input length barely varies (257-279 tokens") and "prompt-sweep" in fit["note"]


def test_intercept_contradicted_by_shortest_prompts_is_flagged_and_not_advised_on() -> None:
    x = np.concatenate([np.full(5, 64.0), np.linspace(500, 8000, 195)])
    y = np.concatenate([np.full(5, 0.1), 1.7 + 0.006 * x[5:]])  # short prompts fast, long ones slowed by a neighbour
    fit = ttft_vs_input(x, y)
    assert fit["intercept_s"] > 0.1 and "exceeds the median TTFT of the shortest prompts (0.1 s" in fit["intercept_check"]
    negative = ttft_vs_input(x, np.concatenate([np.full(5, 0.5), -3.0 + 0.004 * x[5:]]))
    assert negative["intercept_s"] < 0 and "impossible" in negative["intercept_check"]
    assert intercept_check(x, 0.008 * x, 0.0, lambda n: 0.008 * n) is None  # a true line through zero is not flagged
    low = {"ttft": 12.0, "tpot": 0.02, "e2e": 13.0, "output_tokens": 40.0, "input_tokens": 4000.0,
           "active_users": 1.0, "load": "1 user"}
    advice = diagnose_latency(slo=Slo(), requests=200, errors_total=0, errors_by_kind={}, share_ttft=0.9, low=low,
                      high=low, ttft_fit=fit, breakpoint=None)["advice"]
    assert not any("even an empty prompt" in line for line in advice)
    assert any("not used for advice" in line for line in advice)


def test_prefill_fit_uses_the_requests_that_ran_alone() -> None:
    """One user alone (8 ms/token, intercept 0), then two users slowing each other (6 ms/token + 1.7 s)."""
    rng = np.random.default_rng(2)
    n_alone = rng.integers(64, 4096, 60).astype(float)
    ttft_alone = 0.008 * n_alone
    starts = np.concatenate([[0.0], np.cumsum(ttft_alone + 0.5)[:-1]])  # one at a time: each after the previous ended
    n_pair = rng.integers(64, 4096, 120).astype(float)
    ttft_pair = 1.7 + 0.006 * n_pair
    pair_starts = starts[-1] + 10 + np.repeat(np.arange(60) * 60.0, 2) + np.tile([0.0, 0.1], 60)  # two at once
    df = pd.DataFrame({
        "started_at": np.concatenate([starts, pair_starts]),
        "input_tokens": np.concatenate([n_alone, n_pair]),
        "ttft_s": np.concatenate([ttft_alone, ttft_pair]),
        "in_flight": False,
    })
    df["finished_at"] = df["started_at"] + df["ttft_s"] + 0.2
    chosen, reason = least_concurrent(df, df)
    assert len(chosen) == 60 + 60  # alone, plus the first of each pair (which started alone)
    alone_only, _ = least_concurrent(df.iloc[:60], df.iloc[:60])
    fit = ttft_vs_input(alone_only["input_tokens"].to_numpy(), alone_only["ttft_s"].to_numpy())
    assert abs(fit["slope_s_per_token"] - 0.008) < 1e-6 and abs(fit["intercept_s"]) < 1e-6
    assert "at most 0 other request(s) in flight" in reason


def test_ttft_that_does_not_grow_with_input_length_gets_no_fit() -> None:
    """A falling line ("5.61 - 0.00174 n") or a flat cloud is what queueing looks like, not a prefill law: no fit,
    and the note names the likely cause only where requests ran at once."""
    rng = np.random.default_rng(7)
    n = rng.uniform(100, 4000, 300)
    falling = ttft_vs_input(n, 5.61 - 0.00174 * n + rng.normal(0, 0.5, n.size), concurrency=8)
    assert falling["model"] is None and falling["slope_s_per_token"] is None
    assert falling["note"].startswith("TTFT does not grow with input length here (slope -0.00")
    assert "(8 at once: queueing or batching)" in falling["note"]
    waits = ttft_vs_input(n, rng.exponential(3.0, n.size) + 0.0001 * n, concurrency=8)  # the wait dwarfs the prefill
    assert waits["model"] is None and "queueing" in waits["note"]
    alone = ttft_vs_input(n, rng.normal(1.0, 0.3, n.size), concurrency=1)
    assert alone["model"] is None and "queueing" not in alone["note"]
    growing = ttft_vs_input(n, 0.1 + 0.001 * n + rng.normal(0, 0.05, n.size), concurrency=1)
    assert growing["model"] == "linear" and growing["slope_s_per_token"] == pytest.approx(0.001, rel=0.05)
