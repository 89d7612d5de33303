"""Analysis on synthetic runs with a known law: fits, breakpoint rules, diagnosis, broken input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tokenload.analysis import analyze_run
from tokenload.analysis.fits import linear_fit, power_fit
from tokenload.analysis.records import REQUIRED_COLUMNS, load_run, write_run
from tokenload.analysis.report import verdict_rows
from tokenload.analysis.synthetic import Law, generate, manifest_for, write_synthetic_run
from tokenload.cli import main
from tokenload.errors import ConfigError
from tokenload.slo import Slo

NO_QUEUE = 10_000  # a capacity the ramp never reaches


# The brief's product: answers within 3 s (TTFT <= 1 s), TPOT not judged on its own.
BRIEF_SLO = Slo(ttft_s=1.0, tpot_s=None, e2e_s=3.0)


def summary_of(tmp_path: Path, law: Law, n: int = 10_000, seed: int = 0, **kwargs) -> dict:
    run_dir = write_synthetic_run(tmp_path / "run", law, n=n, seed=seed)
    return analyze_run(run_dir, write=False, **kwargs)


def close(value: float, truth: float, rel: float = 0.02) -> bool:
    return abs(value - truth) <= rel * abs(truth)


# ----- fits ---------------------------------------------------------------------------------------

def test_linear_law_recovered_within_2_percent(tmp_path: Path) -> None:
    law = Law()
    s = summary_of(tmp_path, law, n=20_000)
    ttft = s["fits"]["ttft_vs_input"]
    assert ttft["model"] == "linear"
    assert close(ttft["slope_s_per_token"], law.prefill_b)
    assert close(ttft["intercept_s"], law.prefill_a)
    assert ttft["sublinear"].startswith("not supported")
    # Queued steps (32 and 64 users, capacity 16) are left out of the fit, and the summary says so.
    assert ttft["steps_used"] == [1, 2, 3, 4, 5]
    e2e = s["fits"]["e2e_vs_output"]
    assert close(e2e["slope_s_per_token"], law.tpot_s)
    # e2e = prefill + TPOT x (N - 1): intercept = a + b * mean(n_in) - TPOT.
    assert close(e2e["intercept_s"], law.prefill_a + law.prefill_b * np.mean(law.input_tokens) - law.tpot_s)
    assert close(e2e["slope_over_tpot_p50"], 1.0)


def test_power_law_chosen_and_recovered(tmp_path: Path) -> None:
    law = Law(prefill_k=0.6, prefill_b=0.01, capacity=NO_QUEUE)
    summary = summary_of(tmp_path, law, n=20_000)
    ttft = summary["fits"]["ttft_vs_input"]
    assert ttft["model"] == "power"
    assert close(ttft["exponent"], 0.6)
    assert close(ttft["intercept_s"], law.prefill_a)
    assert ttft["sublinear"].startswith("supported")
    # A curve's s/token is its slope at one input length: the law's derivative there, and the verdict names it.
    at = ttft["slope_at_input_tokens"]
    assert close(ttft["slope_s_per_token"], law.prefill_b * law.prefill_k * at ** (law.prefill_k - 1), 0.05)
    row = next(text for topic, text, _ in verdict_rows(summary) if topic == "TTFT vs input")
    assert f"s/token at {at:,.0f} input tokens" in row, row


def test_fit_helpers_on_exact_data() -> None:
    x = np.linspace(10, 1000, 200)
    fit = linear_fit(x, 0.5 + 0.002 * x)
    assert fit is not None and close(fit.slope, 0.002, 1e-9) and close(fit.intercept, 0.5, 1e-9)
    pw = power_fit(x, 0.3 + 0.05 * x**1.4)
    assert pw is not None and close(pw.k, 1.4, 1e-3) and close(pw.a, 0.3, 1e-2)
    assert linear_fit(np.full(50, 7.0), np.arange(50.0)) is None  # x does not vary


def test_formula_both_forms_and_drivers(tmp_path: Path) -> None:
    s = summary_of(tmp_path, Law(capacity=NO_QUEUE))
    f = s["formula"]
    assert f["identity_mape"] < 1e-6  # with each request's own TPOT the exact form is true by definition
    # With each step's typical values the formula is a prediction: close here (TTFT varies with input only).
    assert 0 < f["mape_exact"] < 0.15 and 0 < f["mape_simple"] < 0.15 and f["holds"] is True
    assert close(f["simple_overshoot_p50_s"], 0.02, 0.05)  # the simple form overshoots by one TPOT
    assert s["fits"]["e2e_vs_output"]["residual_mape"] < 0.15
    assert s["e2e_drivers"]["r2_output"] > s["e2e_drivers"]["r2_input"]
    assert s["e2e_drivers"]["verdict"].startswith("supported")


def test_formula_with_typical_values_fails_when_tpot_is_bimodal(tmp_path: Path) -> None:
    df = generate(Law(capacity=NO_QUEUE, noise=0.0), n=4000, seed=5)
    slow = np.arange(len(df)) % 2 == 0
    df.loc[slow, "tpot_s"] *= 5  # half the requests decode five times slower: no typical TPOT exists
    df["e2e_s"] = df["ttft_s"] + df["tpot_s"] * (df["output_tokens"] - 1)
    df["finished_at"] = df["started_at"] + df["e2e_s"]
    f = analyze_run(write_run(tmp_path / "r", df, manifest_for(Law(), df)), write=False)["formula"]
    assert f["identity_mape"] < 1e-6
    assert f["mape_exact"] > 0.3 and f["holds"] is False


# ----- breakpoint -----------------------------------------------------------------------------------

def test_breakpoint_at_planted_capacity(tmp_path: Path) -> None:
    s = summary_of(tmp_path, Law(capacity=16))
    bp = s["breakpoint"]
    assert bp["active_users"] == 32 and bp["last_good_active_users"] == 16
    assert bp["reason"] == "slo"
    assert s["breakpoint_rules"]["knee"]["active_users"] == 32
    assert s["steps"][4]["slo_attainment"] > 0.9 > s["steps"][5]["slo_attainment"]


def test_knee_rule_alone(tmp_path: Path) -> None:
    s = summary_of(tmp_path, Law(capacity=8), slo_overrides={"ttft_s": 1e3, "e2e_s": 1e3})
    assert s["breakpoint"]["reason"] == "knee"
    assert s["breakpoint"]["active_users"] == 16
    assert "tok/s" in s["breakpoint"]["detail"] and "median e2e rose" in s["breakpoint"]["detail"]
    assert not s["breakpoint_rules"]["slo"]["fired"] and not s["breakpoint_rules"]["error_rate"]["fired"]


def test_error_rate_rule(tmp_path: Path) -> None:
    s = summary_of(tmp_path, Law(capacity=NO_QUEUE, error_rates={16: 0.3}, error_kind="rate_limited"))
    bp = s["breakpoint"]
    assert bp["reason"] == "error_rate" and bp["active_users"] == 16
    assert "above the 5.0% limit" in bp["detail"]
    assert not s["breakpoint_rules"]["knee"]["fired"]
    step16 = next(x for x in s["steps"] if x["active_users"] == 16)
    assert step16["errors_by_kind"] == {"rate_limited": step16["errors"]}


def test_slo_rule_alone_from_tpot_contention(tmp_path: Path) -> None:
    s = summary_of(tmp_path, Law(capacity=NO_QUEUE, tpot_batch_growth=0.05), slo=BRIEF_SLO)
    assert s["breakpoint"]["reason"] == "slo"
    assert s["breakpoint"]["active_users"] == 16
    assert not s["breakpoint_rules"]["knee"]["fired"]
    # TPOT grows with load, so the e2e fit keeps to the steps before it did.
    assert s["fits"]["e2e_vs_output"]["steps_used"][-1] < 5


def test_no_breakpoint_says_why(tmp_path: Path) -> None:
    s = summary_of(tmp_path, Law(capacity=NO_QUEUE))
    assert s["breakpoint"] is None
    assert "never broke" in s["breakpoint_note"]


# ----- diagnosis ------------------------------------------------------------------------------------

def test_diagnosis_decode_bound_brief_example(tmp_path: Path) -> None:
    law = Law(prefill_a=1.5, prefill_b=0.0, tpot_s=0.3, output_tokens=(40, 40), capacity=NO_QUEUE, noise=0.0)
    d = summary_of(tmp_path, law, n=3000, slo=BRIEF_SLO)["diagnosis"]
    assert d["bound"] == "decode"
    assert close(d["share_ttft"], 1.5 / 13.2)
    assert "you need TPOT <= 0.0375 s; today 0.3 s: cap max_tokens" in d["advice"][0]


def test_diagnosis_prefill_bound(tmp_path: Path) -> None:
    d = summary_of(tmp_path, Law(prefill_a=0.3, prefill_b=0.001, tpot_s=0.005, capacity=NO_QUEUE))["diagnosis"]
    assert d["bound"] == "prefill"
    assert "prompts of <= 700 input tokens meet it" in d["advice"][0]


def test_diagnosis_queue_bound(tmp_path: Path) -> None:
    d = summary_of(tmp_path, Law(capacity=8))["diagnosis"]
    assert d["bound"] == "queue"
    assert "keep concurrency <= 8 users" in d["advice"][0]
    assert "at 8 users to" in d["advice"][0]


def test_diagnosis_errors_bound(tmp_path: Path) -> None:
    law = Law(capacity=NO_QUEUE, error_rates={u: 0.2 for u in Law().users}, error_kind="overloaded")
    d = summary_of(tmp_path, law)["diagnosis"]
    assert d["bound"] == "errors"
    assert "failed with overloaded" in d["advice"][0] and "off-peak" in d["advice"][0]


# ----- files, CLI and broken input -------------------------------------------------------------------

SPEC_STEP_KEYS = {"step", "active_users", "requests", "errors", "error_rate", "rps", "output_tok_s", "ttft_p50_s",
                  "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "e2e_p95_s", "slo_attainment", "formula_mape"}


def test_cli_writes_summary_plots_and_self_contained_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = write_synthetic_run(tmp_path / "run", Law(error_rates={64: 0.2}), n=8000)
    assert main(["analyze", str(run_dir), "--slo-ttft", "1.5", "--slo-e2e", "4"]) == 0
    out = capsys.readouterr().out
    assert "verdict" in out and out.strip().endswith("report.html")
    s = json.loads((run_dir / "summary.json").read_text())
    assert set(s["fits"]["ttft_vs_input"]) >= {"model", "slope_s_per_token", "intercept_s", "exponent", "r2", "n"}
    assert set(s["fits"]["e2e_vs_output"]) >= {"slope_s_per_token", "intercept_s", "r2", "n"}
    assert set(s["formula"]) >= {"mape_simple", "mape_exact", "holds"}
    assert all(SPEC_STEP_KEYS <= set(step) for step in s["steps"])
    assert set(s["breakpoint"]) >= {"active_users", "reason", "detail"}
    assert set(s["diagnosis"]) >= {"bound", "share_ttft", "advice"}
    assert s["slo"]["ttft_s"] == 1.5 and s["slo"]["e2e_s"] == 4.0
    pngs = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert pngs == ["cdfs.png", "e2e_vs_output.png", "itl_vs_load.png", "latency_vs_users.png",
                    "throughput_vs_users.png", "timeline.png", "ttft_vs_input.png"]
    html = (run_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 7 and 'src="plots/' not in html
    # Report defects of issue 9: headings escaped once, no raw JSON, the steps tables scroll instead of clipping.
    assert "&amp;" not in html and "step&#x27;s (" in html.split("<h2>Fits")[1].split("</h2>")[0]
    assert '{"base_url"' not in html and "<div class='scroll'>" in html
    assert "Inter-token latency" in html and "warm-up excluded per step" in html
    assert html.index("Verdict") < html.index("<img") < html.index("Per step")


def test_optional_columns_absent_and_in_flight_excluded(tmp_path: Path) -> None:
    df = generate(Law(capacity=NO_QUEUE), n=4000)
    plain = write_run(tmp_path / "plain", df.drop(columns=["finished_at", "in_flight"]), {})
    assert analyze_run(plain, write=False)["run"]["in_flight"] == 0
    last = df.index[-50:]
    end = float(df["finished_at"].max())
    df.loc[last, "in_flight"] = True
    df.loc[last, "started_at"] = end - 0.5  # open for half a second when the run stopped
    df.loc[last, "e2e_s"] = 999.0  # a partial stream's "latency" must not reach any percentile
    s = analyze_run(write_run(tmp_path / "open", df, manifest_for(Law(), df)), write=False)
    assert s["run"]["in_flight"] == 50 and s["latency"]["e2e"]["p99"] < 10


def test_manifest_iso_times(tmp_path: Path) -> None:
    df = generate(Law(), n=500)
    run = load_run(write_run(tmp_path / "r", df, {"started_at": "2024-05-01T10:00:00Z", "ended_at": "2024-05-01T11:00:00"}))
    assert run.ended_at - run.started_at == 3600.0
    assert load_run(write_run(tmp_path / "m", df, {})).started_at == pytest.approx(df["started_at"].min())


def _run_cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("case", ["missing_dir", "not_a_run", "missing_columns", "corrupt"])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, case: str) -> None:
    target = tmp_path / "run"
    if case != "missing_dir":
        target.mkdir()
    if case == "missing_columns":
        generate(Law(), n=100).drop(columns=["ttft_s", "tpot_s"]).to_parquet(target / "requests.parquet")
    if case == "corrupt":
        (target / "requests.parquet").write_text("not parquet")
    code, err = _run_cli(["analyze", str(target)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("tokenload: error:") and "Traceback" not in err
    if case == "missing_columns":
        assert "ttft_s, tpot_s" in err
    with pytest.raises(ConfigError):
        load_run(target)


def test_empty_run_writes_report_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = pd.DataFrame({c: pd.Series([], dtype="float64") for c in REQUIRED_COLUMNS})
    run_dir = write_run(tmp_path / "run", empty, {"run_id": "x"})
    code, err = _run_cli(["analyze", str(run_dir), "--quiet"], capsys)
    assert code == 2 and "no requests" in err
    assert "the run recorded no requests" in (run_dir / "report.html").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["breakpoint"] is None


def test_only_errors_is_a_report_not_a_crash(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    df = generate(Law(), n=300)
    df["status"], df["error_kind"] = "error", "auth"
    for col in ("ttft_s", "tpot_s", "e2e_s"):
        df[col] = np.nan
    run_dir = write_run(tmp_path / "run", df, {})
    code, _ = _run_cli(["analyze", str(run_dir), "--quiet"], capsys)
    assert code == 0
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["diagnosis"]["bound"] == "errors" and "failed with auth" in s["diagnosis"]["advice"][0]
    assert any("no request succeeded" in p for p in s["problems"])
    assert "no request succeeded" in (run_dir / "report.html").read_text()


def test_csv_export_on_demand_has_every_record_and_column(tmp_path: Path) -> None:
    run_dir = write_synthetic_run(tmp_path / "run", n=500, seed=3)
    assert main(["analyze", str(run_dir), "--quiet", "--csv"]) == 0
    exported = pd.read_csv(run_dir / "requests.csv")
    original = pd.read_parquet(run_dir / "requests.parquet")
    assert list(exported.columns) == list(original.columns) and len(exported) == len(original)
    assert np.allclose(exported.ttft_s.to_numpy(), original.ttft_s.to_numpy(), equal_nan=True)


def test_report_tables_show_no_raw_python_values() -> None:
    """A flag reads yes / no and a missing value n/a ("usage fields reported True" reached the report)."""
    from tokenload.analysis.report import html_table

    table = html_table(["finding", "value"], [["usage fields reported", True], ["cached", False], ["ratio", None],
                                               ["TTFT p50 (s)", 1.717721234]])
    assert ">yes<" in table and ">no<" in table and ">n/a<" in table and ">1.718<" in table
    assert "True" not in table and "False" not in table and "None" not in table


def test_an_output_length_that_did_not_vary_is_not_judged(tmp_path: Path) -> None:
    """Fixed output length: the verdict says it cannot tell (it said "not supported here: ... output -0%")."""
    s = summary_of(tmp_path, Law(output_tokens=(40, 40), capacity=NO_QUEUE), n=3000)
    verdict = s["e2e_drivers"]["verdict"]
    assert verdict.startswith("cannot tell: output length barely varies (40-40 tokens"), verdict
    assert "-0%" not in verdict and "input length explains" in verdict
