"""One SLO for the analysis and every command: synthetic runs with a known law, the CLI's flags."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tokenload.analysis import analyze_run
from tokenload.analysis.plots import breakpoint_marker
from tokenload.analysis.records import write_run
from tokenload.analysis.report import verdict_rows
from tokenload.analysis.synthetic import Law, generate, manifest_for
from tokenload.cli import build_parser, main
from tokenload.slo import DEFAULT, verdict
from tokenload.workload.scenario import load_scenario, packaged_names

NO_QUEUE = 10_000  # a capacity the ramp never reaches
SLO_FLAGS = ("--slo-ttft", "--slo-tpot", "--slo-itl", "--slo-e2e", "--slo-target", "--slo-max-error-rate")


def _run(tmp_path: Path, law: Law, n: int = 6000, **manifest: object) -> tuple[Path, pd.DataFrame]:
    df = generate(law, n=n)
    return write_run(tmp_path / "run", df, {**manifest_for(law, df), **manifest}), df


def _ttft_stop(reason: str, step: int, p95: float, limit: float) -> dict:
    """manifest.json's `stop` as `tokenload.load.stoprules.record` writes it for the TTFT auto-stop."""
    return {"rule": "breakpoint_ttft", "reason": reason, "key": "breakpoint_ttft_p95_s", "step": step,
            "condition": f"TTFT p95 {p95:.2f} s > {limit:g} s", "value": p95, "limit": limit}


def _rows(summary: dict) -> dict[str, str]:
    return {topic: finding for topic, finding, _ in verdict_rows(summary)}


# ----- verdicts around the breakpoint ---------------------------------------------------------------

def test_no_level_met_the_slo_is_below_the_range_not_the_lowest_level(tmp_path: Path) -> None:
    """Every request's TTFT is >= 0.2 s (the law's prefill): a 0.1 s TTFT bound fails from 1 user up."""
    run_dir, _ = _run(tmp_path, Law(capacity=NO_QUEUE), n=3000)
    s = analyze_run(run_dir, slo_overrides={"ttft_s": 0.1})
    assert "below 1 user (slo)" in (run_dir / "report.html").read_text()
    bp = s["breakpoint"]
    assert bp["load_level"] is None and bp["active_users"] is None and bp["below_range"] is True
    assert bp["lowest_load_level"] == 1 and bp["reason"] == "slo"
    assert _rows(s)["Breakpoint"].startswith("below 1 user (slo)")
    assert breakpoint_marker(s) is None  # charts draw no line at the lowest level


# A healthy channel: 200 ms to the first token, then 20 ms a token (50 tokens/s), never queueing.
HEALTHY_TTFT_S, HEALTHY_TPOT_S = 0.2, 0.02


@pytest.mark.parametrize("name", packaged_names())
def test_a_packaged_scenario_fits_its_slo_on_a_healthy_channel(name: str) -> None:
    """Its longest answer on a healthy channel meets the SLO it is judged by (its [slo], else the default): the
    default e2e <= 3 s failed the ramp's 256-token answers (5.3 s), so `run ramp` read "below 1 user"."""
    scenario = load_scenario(name)
    longest = scenario.output.max_tokens.upper
    assert longest is not None, name
    values = {"ttft": HEALTHY_TTFT_S, "tpot": HEALTHY_TPOT_S, "itl": HEALTHY_TPOT_S,
              "e2e": HEALTHY_TTFT_S + HEALTHY_TPOT_S * longest}
    assert verdict(scenario.slo, "ok", None, values), (name, scenario.slo.describe(), values)


def test_the_ramp_on_a_healthy_channel_is_not_below_one_user(tmp_path: Path) -> None:
    """The packaged ramp's answers (32-256 tokens) from a healthy channel that never queues, judged by the
    default SLO: no breakpoint (it was "below 1 user": e2e <= 3 s cannot hold for 256-token answers)."""
    ramp = load_scenario("ramp")
    assert ramp.slo == DEFAULT
    law = Law(capacity=NO_QUEUE, users=(1, 2, 4, 8), prefill_a=HEALTHY_TTFT_S, prefill_b=0.0, tpot_s=HEALTHY_TPOT_S,
              output_tokens=(32, ramp.output.max_tokens.upper or 0))
    run_dir, df = _run(tmp_path, law, n=2000)
    assert df["e2e_s"].quantile(0.9) > 3.0  # what the old default judged
    s = analyze_run(run_dir, write=False)
    assert s["breakpoint"] is None, s["breakpoint"]
    assert all(step["slo_attainment"] == 1.0 for step in s["steps"])


def test_a_breakpoint_inside_the_range_is_drawn_and_not_below_it(tmp_path: Path) -> None:
    run_dir, _ = _run(tmp_path, Law(capacity=16))
    s = analyze_run(run_dir, write=False)
    assert s["breakpoint"]["below_range"] is False and s["breakpoint"]["load_level"] == 32
    assert breakpoint_marker(s) == (32.0, "breakpoint 32 users (slo)")


def test_auto_stop_is_named_not_incomplete_and_related_to_the_slo_breakpoint(tmp_path: Path) -> None:
    """The live rule stopped the ramp at 32 users (of 64 planned); the SLO broke at 32 too, or lower."""
    law = Law(capacity=8, users=(1, 2, 4, 8, 16, 32))
    plan = [{"step": i + 1, "users": u} for i, u in enumerate((*law.users, 64))]
    reason = "auto-stop: step 6 (32 users) TTFT p95 9.10 s > 5 s ([stop] breakpoint_ttft_p95_s)"
    run_dir, _ = _run(tmp_path, law, plan=plan, stop_reason=reason, stop=_ttft_stop(reason, 6, 9.1, 5.0))
    s = analyze_run(run_dir, write=False)
    complete = s["run"]["completeness"]
    assert complete["truncated"] is False and complete["note"] is None
    assert complete["auto_stop"] == "TTFT p95 9.10 s > 5 s, [stop] breakpoint_ttft_p95_s"
    rows = _rows(s)
    assert "Run incomplete" not in rows and "Missing" not in rows
    stop = s["auto_stop"]
    assert stop["rule"] == "breakpoint_ttft_p95_s" and stop["load_level"] == 32 and stop["breakpoint"] == "16 users"
    assert rows["Auto-stop"].startswith("auto-stop at 32 users (TTFT p95 9.10 s > 5 s, [stop] breakpoint_ttft_p95_s); "
                                        "the SLO breakpoint is 16 users, lower")


def test_auto_stop_with_no_slo_breakpoint_says_the_live_rule_was_stricter(tmp_path: Path) -> None:
    law = Law(capacity=NO_QUEUE, users=(1, 2, 4))
    reason = "auto-stop: step 3 (4 users) TTFT p95 0.60 s > 0.5 s ([stop] breakpoint_ttft_p95_s)"
    run_dir, _ = _run(tmp_path, law, plan=[{"step": i, "users": 2 ** i} for i in range(5)], stop_reason=reason,
                      stop=_ttft_stop(reason, 3, 0.6, 0.5))
    s = analyze_run(run_dir, write=False)
    assert s["breakpoint"] is None
    assert "the live rule fired before the SLO did" in s["breakpoint_note"]
    assert "the SLO (TTFT <= 1 s and TPOT <= 0.2 s for 90% of requests) held up to 4 users" in s["auto_stop"]["verdict"]


def test_a_slow_channel_with_only_open_requests_is_not_errors_bound(tmp_path: Path) -> None:
    """Zero errors, three first tokens, no request finished: the bound is unknown, the error rate 0."""
    df = generate(Law(capacity=NO_QUEUE, users=(1,)), n=3)
    df["in_flight"] = True
    df[["tpot_s", "e2e_s"]] = np.nan
    df["finished_at"] = np.nan
    run_dir = write_run(tmp_path / "run", df, manifest_for(Law(), df))
    d = analyze_run(run_dir, write=False)["diagnosis"]
    assert d["bound"] is None and d["error_rate"] == 0.0
    assert any("no request finished: 3 of 3 were still open" in line for line in d["advice"])


# ----- what the SLO judges ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["context_length", "bad_request", "auth", "not_found_model"])
def test_configuration_and_input_errors_are_not_judged(tmp_path: Path, kind: str) -> None:
    """30% of the 4-user step fails on the user's input or configuration: the channel met the SLO."""
    run_dir, df = _run(tmp_path, Law(capacity=NO_QUEUE, error_rates={4: 0.1}, error_kind=kind))
    s = analyze_run(run_dir, write=False)
    step = next(x for x in s["steps"] if x["active_users"] == 4)
    failed = int(df[df.active_users.eq(4)].status.eq("error").sum())
    assert failed > 20
    assert step["slo_attainment"] == 1.0 and step["slo_n"] == step["requests"] - failed
    assert s["breakpoint"] is None
    assert s["slo"]["attainment"] == 1.0 and s["slo"]["not_judged"] == int(df.status.eq("error").sum())


def test_load_errors_are_judged_against_max_error_rate(tmp_path: Path) -> None:
    run_dir, df = _run(tmp_path, Law(capacity=NO_QUEUE, error_rates={4: 0.08}, error_kind="overloaded"))
    step_rate = df[df.active_users.eq(4)].status.eq("error").mean()
    assert 0.05 < step_rate < 0.15
    strict = analyze_run(run_dir, write=False)
    assert strict["breakpoint"]["reason"] == "error_rate" and strict["breakpoint"]["load_level"] == 4
    lax = analyze_run(run_dir, write=False, slo_overrides={"max_error_rate": 0.2, "target": 0.8})
    assert lax["breakpoint"] is None and lax["slo"]["max_error_rate"] == 0.2


def test_tpot_itl_and_any_subset_of_thresholds_are_judged(tmp_path: Path) -> None:
    """The law's TPOT is 0.02 s (ITL p99 0.04 s); TTFT >= 0.2 s and e2e up to 2.3 s."""
    run_dir, _ = _run(tmp_path, Law(capacity=NO_QUEUE))
    only = {"ttft_s": None, "e2e_s": None}
    assert analyze_run(run_dir, write=False, slo_overrides={**only, "tpot_s": 0.03})["breakpoint"] is None
    tpot = analyze_run(run_dir, write=False, slo_overrides={**only, "tpot_s": 0.015})
    assert tpot["breakpoint"]["below_range"] and "TPOT <= 0.015 s" in tpot["breakpoint"]["detail"]
    assert analyze_run(run_dir, write=False, slo_overrides={**only, "itl_s": 0.05})["breakpoint"] is None
    itl = analyze_run(run_dir, write=False, slo_overrides={**only, "itl_s": 0.03})
    assert itl["breakpoint"]["below_range"] and itl["slo"]["itl_s"] == 0.03 and itl["slo"]["ttft_s"] is None
    e2e = analyze_run(run_dir, write=False, slo_overrides={"ttft_s": None, "e2e_s": 0.5})
    assert e2e["steps"][0]["slo_attainment"] == 0.0


def test_analyze_starts_from_the_runs_scenario_slo_and_flags_override_it(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    law = Law(capacity=NO_QUEUE)
    df = generate(law, n=3000)
    manifest = manifest_for(law, df)
    manifest["scenario"]["slo"] = {"ttft_s": 0.8, "tpot_s": 0.05, "target": 0.95, "max_error_rate": 0.01}
    run_dir = write_run(tmp_path / "run", df, manifest)
    assert main(["analyze", str(run_dir), "--quiet"]) == 0
    slo = json.loads((run_dir / "summary.json").read_text())["slo"]
    assert {k: slo[k] for k in DEFAULT.to_dict()} == {"ttft_s": 0.8, "tpot_s": 0.05, "itl_s": None, "e2e_s": None,
                                                      "target": 0.95, "max_error_rate": 0.01}
    assert main(["analyze", str(run_dir), "--quiet", "--slo-e2e", "2", "--slo-tpot", "off", "--slo-target", "0.8"]) == 0
    slo = json.loads((run_dir / "summary.json").read_text())["slo"]
    assert (slo["ttft_s"], slo["tpot_s"], slo["e2e_s"], slo["target"]) == (0.8, None, 2.0, 0.8)
    capsys.readouterr()


# ----- the flags --------------------------------------------------------------------------------------

def _slo_actions(command: str) -> dict[str, tuple[object, str | None, str | None]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[attr-defined]
    return {a.option_strings[0]: (a.default, a.help, a.metavar) for a in sub._actions
            if a.option_strings and a.option_strings[0].startswith("--slo-")}


def test_every_command_has_the_same_slo_flags_help_and_defaults() -> None:
    reference = _slo_actions("analyze")
    assert tuple(reference) == SLO_FLAGS
    assert "(default 1)" in str(reference["--slo-ttft"][1]) and "(default 0.2)" in str(reference["--slo-tpot"][1])
    assert "(default not judged)" in str(reference["--slo-e2e"][1])
    for command in ("run", "compare", "doctor", "watch"):
        assert _slo_actions(command) == reference, command


@pytest.mark.parametrize("argv", [
    ["compare", "a", "b", "--slo-ttft", "-1"],
    ["analyze", "a", "--slo-target", "1.5"],
    ["doctor", "--slo-e2e", "0"],
    ["run", "smoke", "--slo-max-error-rate", "2"],
    ["watch", "--slo-itl", "fast"],
])
def test_a_bad_slo_flag_is_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tokenload: error:") and argv[-2] in err


def test_compare_judges_every_run_by_the_baselines_slo_with_the_flags(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    law = Law(capacity=NO_QUEUE, users=(1, 2, 4))
    dirs = []
    for name, slo in (("base", {"ttft_s": 0.1}), ("other", {"ttft_s": 50.0})):
        df = generate(law, n=1500)
        manifest = manifest_for(law, df)
        manifest["scenario"]["slo"] = slo
        dirs.append(str(write_run(tmp_path / name, df, manifest)))
    out = tmp_path / "cmp"
    assert main(["compare", *dirs, "--out", str(out), "--quiet"]) == 0
    c = json.loads((out / "comparison.json").read_text())
    assert c["slo"]["ttft_s"] == 0.1 and c["slo"]["e2e_s"] is None
    assert all(r["breakpoint"]["below_range"] for r in c["runs"])  # the other run's own 50 s bound is not used
    assert main(["compare", *dirs, "--out", str(out), "--quiet", "--slo-ttft", "5", "--slo-e2e", "10"]) == 0
    c = json.loads((out / "comparison.json").read_text())
    assert (c["slo"]["ttft_s"], c["slo"]["e2e_s"]) == (5.0, 10.0)
    assert all(r["breakpoint"] is None and r["slo_attainment"] == 1.0 for r in c["runs"])
    capsys.readouterr()


def test_flags_that_leave_no_threshold_are_refused(capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", "--slo-ttft", "off", "--slo-tpot", "off"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "turned off every threshold" in err
