"""Verdict words that must not overclaim: prompt caching from repeats only, the formula on a prompt sweep.

Synthetic runs with a known law (tokenload.analysis.synthetic) and cache usage set by hand, so each verdict's
truth is known: llama.cpp's one cached token per request is not caching, and a 1-user prompt sweep obeys the
formula once each request's TTFT comes from its own input length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from tokenload.analysis import analyze_run
from tokenload.analysis.caching import report_rows
from tokenload.analysis.fits import planned_ttft
from tokenload.analysis.records import write_run
from tokenload.analysis.report import verdict_rows
from tokenload.analysis.synthetic import Law, generate, manifest_for

NO_QUEUE = 10_000


def _summary(tmp_path: Path, law: Law, df: pd.DataFrame) -> dict:
    return analyze_run(write_run(tmp_path / "run", df, manifest_for(law, df)), write=False)


def _cached_run(reads: np.ndarray | int, turns: bool) -> tuple[Law, pd.DataFrame]:
    law = Law(capacity=NO_QUEUE, users=(1, 2))
    df = generate(law, n=300, seed=3)
    df["cache_read_input_tokens"] = reads
    df["cache_creation_input_tokens"] = 0
    if turns:
        df["session_id"] = (np.arange(len(df)) // 3).astype(str)
        df["turn"] = np.arange(len(df)) % 3 + 1
    return law, df


def test_one_cached_token_per_request_without_repeats_is_cannot_tell(tmp_path: Path) -> None:
    """llama.cpp reports cached_tokens = 1 (the shared first token) on nearly every request."""
    law, df = _cached_run(1, turns=False)
    caching = _summary(tmp_path, law, df)["caching"]
    assert caching["honoured"] is None and caching["verdict"].startswith("cannot tell")
    assert caching["requests_with_cache_reads"] == 0  # one token of hundreds is no hit
    assert caching["hit_ratio"] < 0.01


def test_reads_without_a_repeated_prefix_are_no_verdict(tmp_path: Path) -> None:
    law, df = _cached_run(0, turns=False)
    df["cache_read_input_tokens"] = df["input_tokens"] // 2
    caching = _summary(tmp_path, law, df)["caching"]
    assert caching["honoured"] is None and caching["verdict"].startswith("cannot tell")


def test_later_turns_reading_one_token_are_not_honoured(tmp_path: Path) -> None:
    law, df = _cached_run(1, turns=True)
    caching = _summary(tmp_path, law, df)["caching"]
    assert caching["honoured"] is False and caching["verdict"].startswith("NOT honoured"), caching["verdict"]
    assert "noise, not hits" in caching["verdict"]


def test_later_turns_reading_their_prefix_are_honoured(tmp_path: Path) -> None:
    law, df = _cached_run(0, turns=True)
    later = df["turn"] > 1
    df.loc[later, "cache_read_input_tokens"] = (df.loc[later, "input_tokens"] * 0.8).astype(int)
    summary = _summary(tmp_path, law, df)
    caching = summary["caching"]
    assert caching["honoured"] is True and caching["verdict"].startswith("honoured")
    assert caching["requests_with_cache_reads"] == int(later.sum())
    rows = dict(report_rows(summary))
    assert rows["usage fields reported"] == "yes" and rows["cache hit ratio (later turns)"].endswith("%")


# ----- the formula test on a prompt sweep -----------------------------------------------------------

SWEEP = Law(users=(1,), capacity=NO_QUEUE, prefill_a=0.1, prefill_b=0.001, input_tokens=(128, 4096),
            output_tokens=(20, 100), noise=0.01)


def test_prompt_sweep_at_one_user_is_no_formula_miss(tmp_path: Path) -> None:
    """One step mixes 128..4,096-token prompts: one median TTFT for all of them misses by design, not by load."""
    df = generate(SWEEP, n=400, seed=2)
    summary = _summary(tmp_path, SWEEP, df)
    f = summary["formula"]
    assert f["typical_values_break_at"] is None, f
    assert f["holds"] is True and f["mape_exact"] < 0.05 and f["not_judged_steps"] == []
    row = next(text for label, text, _ in verdict_rows(summary) if label.startswith("Formula"))
    assert "misses" not in row


def test_prompt_sweep_too_small_to_fit_cannot_be_judged(tmp_path: Path) -> None:
    df = generate(SWEEP, n=400, seed=2).iloc[:8]
    f = _summary(tmp_path, SWEEP, df)["formula"]
    assert f["mape_simple"] is None and f["holds"] is False and f["not_judged_steps"] == [1]
    assert f["note"].startswith("cannot judge: input lengths vary")


def test_planned_ttft_uses_the_median_for_steady_lengths_and_the_line_for_varying_ones() -> None:
    steps = np.repeat([1, 2, 3], 20)
    n = np.concatenate([np.full(20, 500.0), np.linspace(100, 4000, 20), np.linspace(100, 4000, 20)])
    n[43:55] = np.nan  # step 3: 8 known lengths left, short and long: varying, too few to fit a line
    ttft = 0.1 + 0.001 * np.nan_to_num(n, nan=1000.0)
    predicted, unjudged = planned_ttft(steps, n, ttft, {1: 0.6, 2: 2.0, 3: 2.0})
    assert np.allclose(predicted[:20], 0.6)  # the step's median
    assert np.allclose(predicted[20:40], ttft[20:40])  # each request at its own length
    assert unjudged == [3] and np.isnan(predicted[40:]).all()  # no prediction where the formula cannot be judged


# ----- channel fidelity ------------------------------------------------------------------------------


def test_a_relay_that_ignores_max_tokens_and_holds_headers_is_named_in_the_verdict(tmp_path: Path) -> None:
    law = Law(capacity=NO_QUEUE, users=(1, 2))
    df = generate(law, n=200, seed=4)
    df["max_tokens"] = 8
    df["chunks"] = df["output_tokens"] = 16  # asked 8, got 16 (LiteLLM's Anthropic route)
    df["ttfb_s"] = df["ttft_s"]  # no headers until the first token
    df["output_tokens_source"] = "server"
    summary = _summary(tmp_path, law, df)
    f = summary["fidelity"]
    ok = int((df["status"] == "ok").sum())
    assert f["max_tokens_exceeded"] == ok and f["headers_held"] == f["headers_judged"] > 0
    row = next(text for label, text, _ in verdict_rows(summary) if label == "Channel fidelity")
    assert f"the channel ignores max_tokens: {ok} of {ok} answers" in row and "a relay buffers the response start" in row


def test_a_faithful_channel_gets_no_fidelity_row(tmp_path: Path) -> None:
    law = Law(capacity=NO_QUEUE, users=(1, 2))
    df = generate(law, n=200, seed=4)
    df.loc[df.index[:5], "output_tokens"] = df.loc[df.index[:5], "chunks"] + 3  # several tokens in a delta: normal
    summary = _summary(tmp_path, law, df)
    assert summary["fidelity"]["findings"] == []
    assert not [label for label, _, _ in verdict_rows(summary) if label == "Channel fidelity"]


def test_usage_below_the_streamed_deltas_is_a_finding(tmp_path: Path) -> None:
    law = Law(capacity=NO_QUEUE, users=(1, 2))
    df = generate(law, n=200, seed=4)
    df.loc[df.index[:7], "output_tokens"] = df.loc[df.index[:7], "chunks"] - 2
    f = _summary(tmp_path, law, df)["fidelity"]
    assert f["usage_below_deltas"] == int((df.loc[df.index[:7], "status"] == "ok").sum()) > 0
    assert any("usage undercounts" in finding for finding in f["findings"])


def test_the_bound_names_the_phase_whose_slo_term_is_missed(tmp_path: Path) -> None:
    """TTFT 1.3 s (the SLO asks 1 s) is 12% of a 10 s answer: the bound was "decode" by TTFT's share while the
    first fix said to shorten the prompt. The phase that misses the SLO is the bound, and the verdict says why."""
    from tokenload.slo import Slo

    law = Law(users=(1, 2), capacity=NO_QUEUE, prefill_a=0.5, prefill_b=0.0005, tpot_s=0.05,
              output_tokens=(150, 250), input_tokens=(100, 3000))
    df = generate(law, n=300, seed=4)
    run = write_run(tmp_path / "run", df, manifest_for(law, df))
    summary = analyze_run(run, Slo(ttft_s=1.0, tpot_s=None, e2e_s=None), write=False)
    d = summary["diagnosis"]
    assert d["share_ttft"] < 0.25 and d["bound"] == "prefill", d
    assert "shorten the prompt" in d["advice"][0]
    rows = dict((label, text) for label, text, _ in verdict_rows(summary))
    assert rows["Bound"].startswith("prefill (at low load TTFT p50 1.")
    # e2e missed as well as TTFT: the larger share of e2e decides, as before
    both = analyze_run(run, Slo(ttft_s=1.0, tpot_s=None, e2e_s=3.0), write=False)["diagnosis"]
    assert both["bound"] == "decode" and both["bound_reason"].startswith("TTFT is ")
    # the TPOT term alone missed: decode
    decode = analyze_run(run, Slo(ttft_s=2.0, tpot_s=0.04, e2e_s=None), write=False)["diagnosis"]
    assert decode["bound"] == "decode" and "decode misses" in decode["bound_reason"]


def test_one_step_is_named_as_one(tmp_path: Path) -> None:
    """A run of one load level fitted on "steps 1–1"."""
    law = Law(users=(1,), capacity=NO_QUEUE, input_tokens=(100, 3000))
    df = generate(law, n=200, seed=5)
    rows = dict((label, text) for label, text, _ in verdict_rows(_summary(tmp_path, law, df)))
    assert rows["TTFT vs input"].endswith(", step 1)") and "1–1" not in " ".join(rows.values())
