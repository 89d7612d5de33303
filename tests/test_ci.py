"""Gates for CI (docs/ci.md): thresholds judged with their intervals, exit codes 0 / 99 / 2 / 1, what CI reads.

The fast tests judge synthetic runs (`tokenload.analysis.synthetic`: a known law) through the real CLI; the
slow ones run `tokenload run` against an independent scripted server with a 200 ms TTFT (tests/slotserver.py)
and against the simulator, as the repository's own pipeline files do.
"""

from __future__ import annotations

import json
import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml

from fakeserver import FakeServer
from loadkit import run_cli, sim_run, write_scenario
from slotserver import SlotServer

from tokenload.analysis.synthetic import Law, write_synthetic_run
from tokenload.cli import build_parser, main
from tokenload.errors import ConfigError
from tokenload.load import stoprules
from tokenload.load.tokenstats import Hist
from tokenload.thresholds import parse, step_keys, valid_names, verdict
from tokenload.workload.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "loadtest.yml"
GITLAB = ROOT / ".gitlab-ci.yml"
BREACHED = 99


# --- the expressions ----------------------------------------------------------------------------------------------

def test_an_interval_decides_pass_fail_or_inconclusive() -> None:
    """Breached only when the whole interval lies beyond the bound; straddling it is inconclusive."""
    assert verdict("<", 1.0, 0.8, (0.7, 0.9)) == "pass"
    assert verdict("<", 1.0, 1.2, (1.1, 1.3)) == "fail"
    assert verdict("<", 1.0, 0.98, (0.91, 1.07)) == "inconclusive"
    assert verdict(">=", 0.9, 0.95, (0.91, 0.98)) == "pass" and verdict(">=", 0.9, 0.8, (0.7, 0.88)) == "fail"
    assert verdict("<", 1.0, 1.2, (1.1, None)) == "fail"  # a lower bound (censored) can fail...
    assert verdict("<", 1.0, 0.9, (0.9, None)) == "inconclusive"  # ...never pass
    assert verdict("<", 1.0, 0.5, None) == "pass" and verdict("<", 1.0, None, None) == "inconclusive"


def test_a_handful_of_observations_gets_an_interval_open_where_the_data_end() -> None:
    """Too few to bootstrap (a slow real server's 4 requests): four first tokens of 12.9 s breach `ttft.p95 < 1`
    but cannot pass `ttft.p95 < 30` (before, the value alone decided: a confident pass on 4 requests)."""
    import numpy as np

    from tokenload.analysis.thresholds import _few

    four = np.array([12.6, 12.7, 12.9, 12.9])
    assert _few(four, 0.95) == (12.9, None) and _few(four, 0.5) == (12.6, None)
    assert verdict("<", 1.0, 12.9, _few(four, 0.95)) == "fail"
    assert verdict("<", 30.0, 12.9, _few(four, 0.95)) == "inconclusive"
    lo, hi = _few(np.arange(1.0, 41.0), 0.5)  # 40 values: both ends inside the data
    assert lo is not None and hi is not None and lo < 20.5 < hi


def test_the_names_come_from_the_summary_types_and_an_unknown_one_lists_them() -> None:
    assert parse("ttft.p95 < 1.2").percentile == ("ttft", 95.0)
    assert parse("steps[users=8].tpot.p50 <= 0.05").step_key == "tpot_p50_s"
    assert parse('models["sim-7b"].e2e.p99 < 8').selector == "sim-7b"
    assert parse("formula.mape_simple < 0.15").name == "formula.mape_simple"
    assert {"output_tok_s", "goodput_rps", "ttft.p95", "ttft_inexact"} <= set(step_keys())
    with pytest.raises(ConfigError) as bad:
        parse("ttft.q95 < 1")
    message = str(bad.value)
    assert "'ttft.q95' names no number" in message and valid_names() in message
    assert "slo_attainment" in message and "steps[users=N].NAME" in message and "formula.{mape_simple" in message
    for wrong in ("ttft.p95 1.2", "ttft.p95 < fast", "steps[user=8].ttft.p95 < 1", "ttft.p95 <= +10%",
                  "ttft.p100 < 1"):
        with pytest.raises(ConfigError):
            parse(wrong)
    assert parse("ttft.p95 <= +10%", baseline=True).relative == pytest.approx(0.10)
    assert parse("capacity >= baseline - 1", baseline=True).offset == -1.0
    with pytest.raises(ConfigError, match="known only at the end"):
        parse("formula.mape_simple < 0.2", abort_on_fail=True)


def test_a_scenario_declares_them_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    good = write_scenario(tmp_path, '[load]\nkind = "constant"\nusers = 2\nstep_s = 5\n[thresholds]\n'
                                    'checks = ["ttft.p95 < 1", { expr = "error_rate < 0.01", abort_on_fail = true }]\n'
                                    'inconclusive = "fail"\n')
    declared = load_scenario(good).thresholds
    assert [c.expr for c in declared.checks] == ["ttft.p95 < 1", "error_rate < 0.01"]
    assert [c.abort_on_fail for c in declared.checks] == [False, True] and declared.inconclusive == "fail"
    bad = write_scenario(tmp_path, '[load]\nkind = "constant"\nusers = 2\n[thresholds]\nchecks = ["ttft.p95 < 1 s"]\n')
    with pytest.raises(ConfigError, match=r"\[thresholds\] checks: threshold 'ttft.p95 < 1 s': the bound"):
        load_scenario(bad)


def test_the_live_statistics_decide_a_breach_only_on_enough_evidence() -> None:
    """`abort_on_fail`: 12 first tokens of 0.2 s against `ttft.p95 < 0.05` decide it; 9, or a bucket the bound
    cuts, do not."""
    hist = Hist()
    for _ in range(12):
        hist.add(0.2)
    assert hist.beyond(0.05, above=True) == 12 and hist.beyond(0.2, above=True) == 0  # 0.2 s's own bucket
    assert hist.beyond(1.0, above=False) == 12
    breach = stoprules.LiveThreshold("ttft.p95 < 0.05", hist.n, hist.beyond(0.05, True), 0.05, "TTFT at or above")
    reason = stoprules.threshold_breached(stoprules.Live(0.0, False, load_scenario("smoke").stop, thresholds=(breach,)))
    assert reason is not None and reason.startswith("threshold ttft.p95 < 0.05 breached (abort_on_fail): 12 of 12")
    few = stoprules.LiveThreshold("ttft.p95 < 0.05", 9, 9, 0.05, "TTFT at or above")
    assert stoprules.threshold_breached(stoprules.Live(0.0, False, load_scenario("smoke").stop,
                                                       thresholds=(few,))) is None


# --- analyze and compare on synthetic runs ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def law_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A baseline, the same channel again (another seed), and one 30% slower in TTFT and TPOT."""
    root = tmp_path_factory.mktemp("laws")
    base = Law(users=(1, 2, 4), capacity=1000, noise=0.1)
    slower = Law(users=(1, 2, 4), capacity=1000, noise=0.1, prefill_a=0.26, prefill_b=0.00039, tpot_s=0.026)
    return {"base": write_synthetic_run(root / "base", base, n=900, seed=1),
            "same": write_synthetic_run(root / "same", base, n=900, seed=2),
            "slower": write_synthetic_run(root / "slower", slower, n=900, seed=3)}


def test_analyze_judges_thresholds_into_the_summary_junit_and_the_step_summary(
        law_runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("requests.parquet", "manifest.json"):
        (run_dir / name).write_bytes((law_runs["base"] / name).read_bytes())
    step_summary = tmp_path / "step-summary.md"
    step_summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    junit = tmp_path / "junit.xml"
    code = main(["analyze", str(run_dir), "--quiet", "--junit", str(junit), "--threshold", "ttft.p95 < 0.05",
                 "--threshold", "ttft.p95 < 50", "--threshold", "steps[users=2].tpot.p50 <= 0.05",
                 "--threshold", "error_rate < 0.5"])
    assert code == BREACHED
    results = json.loads((run_dir / "summary.json").read_text())["thresholds"]
    assert [r["result"] for r in results] == ["fail", "pass", "pass", "pass"]
    breached = results[0]
    # The law's TTFT p95 is the prefill of long prompts (0.2 + 0.0003 x up to 2000 tokens): far above 0.05 s.
    assert breached["value"] > 0.5 and breached["ci"][0] > 0.05 and breached["bound"] == 0.05
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "ttft.p95 < 0.05" in line)
    assert "✗" in row and f"{breached['value']:.3g}" in row and f"[{breached['ci'][0]:.3g}," in row
    cases = ET.parse(junit).getroot().findall("./testsuite/testcase")
    assert len(cases) == 4 and [c.get("name") for c in cases if c.find("failure") is not None] == ["ttft.p95 < 0.05"]
    failure = cases[0].find("failure")
    assert failure is not None and "< 0.05" in failure.get("message", "") and f"{breached['value']:.3g}" in failure.get("message", "")
    text = step_summary.read_text()
    assert text.startswith("earlier step\n") and "✗ 1 of 4 threshold(s) breached" in text and "| ✗ | `ttft.p95 < 0.05`" in text
    assert "<summary>Verdict</summary>" in text and "Plots: " in text


def test_analyze_a_step_the_run_lacks_is_exit_2(law_runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(law_runs["same"]), "--quiet", "--threshold", "steps[users=3].ttft.p95 < 1"]) == 2
    assert "this run has no step at 3 users; its steps: 1 user, 2 users, 4 users" in capsys.readouterr().err


@pytest.mark.parametrize(("candidate", "code"), [("slower", BREACHED), ("same", 0)])
def test_compare_against_a_baseline_summary_fails_a_30_percent_slower_run_and_passes_noise(
        law_runs: dict[str, Path], candidate: str, code: int, tmp_path: Path) -> None:
    """The baseline kept as its summary.json (no records): judged from both steps' intervals."""
    from tokenload.analysis.pipeline import analyze_run

    kept = tmp_path / "baseline-summary.json"
    kept.write_text(json.dumps(analyze_run(law_runs["base"], write=False)))
    junit = tmp_path / "junit.xml"
    assert main(["compare", str(kept), str(law_runs[candidate]), "--junit", str(junit), "--threshold",
                 "ttft.p95 <= +10%", "--threshold", "tpot.p50 <= +10%"]) == code
    failures = ET.parse(junit).getroot().findall("./testsuite/testcase/failure")
    assert len(failures) == (2 if code else 0)


def test_compare_run_directories_judges_from_its_bootstrap_intervals(law_runs: dict[str, Path], tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compare", str(law_runs["base"]), str(law_runs["slower"]), str(law_runs["same"]), "--quiet",
                 "--labels", "base,slower,same", "--out", str(tmp_path / "cmp"), "--threshold", "tpot.p50 <= +10%"])
    assert code == BREACHED
    results = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["thresholds"]
    by_run = {r["where"].split(":")[0]: r for r in results}
    assert by_run["slower"]["result"] == "fail" and by_run["same"]["result"] != "fail"
    # TPOT 0.026 against 0.02: +30%, the delta's interval wholly above +10%.
    assert by_run["slower"]["value"] == pytest.approx(0.30, abs=0.05) and by_run["slower"]["ci"][0] > 0.10
    assert by_run["slower"]["relative"] and "compare's bootstrap interval" in by_run["slower"]["note"]
    row = next(line for line in capsys.readouterr().out.splitlines() if "✗" in line)
    assert f"{100 * by_run['slower']['value']:+.3g}%" in row and "slower: at" in row


@pytest.mark.parametrize(("capacity", "result"), [(7, "pass"), (6, "fail")])
def test_capacity_against_the_baselines_minus_one(law_runs: dict[str, Path], capacity: int, result: str) -> None:
    """`capacity >= baseline - 1` puts the baseline's own capacity (8) on the right: 7 passes, 6 does not."""
    from tokenload.analysis.pipeline import analyze
    from tokenload.analysis.thresholds import judge_against

    candidate = analyze(law_runs["same"], write=False)
    candidate.summary["search"] = {**_SEARCH, "capacity": capacity}
    (judged,) = judge_against({"search": {**_SEARCH, "capacity": 8}}, candidate,
                              [parse("capacity >= baseline - 1", baseline=True)], None, "candidate")
    assert (judged["result"], judged["value"], judged["bound"]) == (result, capacity, 7)
    assert judged["note"] == "the baseline's 8 -1" and judged["where"] == "candidate: the whole run"


_SEARCH = {"over": "users", "unit": "users", "first_failing": None, "interval": [0, None], "binding": None,
           "shape": None, "probes": [], "tokens": 0, "duration_s": 0.0, "range": [1, 64], "below_range": False,
           "above_range": False, "stopped": None, "disagreements": [], "undecided": [], "slo": {}, "served": None,
           "verdict": ""}


def test_a_relative_bound_on_what_compare_does_not_measure_is_exit_2(law_runs: dict[str, Path],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(law_runs["base"]), str(law_runs["same"]), "--threshold", "ttft.p99 <= +10%"]) == 2
    assert "judges p50 or p95" in capsys.readouterr().err


# --- runs ---------------------------------------------------------------------------------------------------------

CONSTANT = """
name = "gate"
[prompt]
tokens = 32
[output]
max_tokens = 8
[load]
kind = "constant"
users = 4
step_s = {step_s}
[stop]
drain_min_s = 2
[thresholds]
checks = [{checks}]
"""


def test_an_unknown_name_is_exit_2_before_any_request(fake_server: FakeServer, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    scenario = write_scenario(tmp_path, CONSTANT.format(step_s=5, checks='"ttft.q95 < 0.05"'))
    assert main(["run", str(scenario), "--base-url", fake_server.url + "/v1", "--protocol", "openai-chat",
                 "--model", "gpt-test", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "'ttft.q95' names no number" in err and "valid names:" in err and len(err.strip().splitlines()) == 1
    assert not fake_server.requests and not (tmp_path / "run").exists()
    flagged = write_scenario(tmp_path, CONSTANT.format(step_s=5, checks='"ttft.p95 < 1"'))
    assert main(["run", str(flagged), "--base-url", fake_server.url + "/v1", "--protocol", "openai-chat",
                 "--model", "gpt-test", "--out", str(tmp_path / "run"), "--threshold", "steps[users=8].rps > 1"]) == 2
    assert "runs no step at 8 users; its steps: 4 users" in capsys.readouterr().err and not fake_server.requests


@pytest.mark.slow
@pytest.mark.parametrize(("bound", "code"), [("0.05", BREACHED), ("5", 0)])
def test_a_run_against_a_200_ms_server_is_gated_by_its_scenarios_thresholds(bound: str, code: int,
                                                                             tmp_path: Path) -> None:
    """An independent server whose TTFT is 200 ms: `ttft.p95 < 0.05` is breached (exit 99, a ✗ row with the
    number, its interval and the bound, one failing JUnit case), `ttft.p95 < 5` passes (exit 0)."""
    server = SlotServer(slots=16, ttft_base_s=0.2, ttft_per_token_s=0.0, tpot_s=0.005)
    junit = tmp_path / "junit.xml"
    try:
        result = run_cli(write_scenario(tmp_path, CONSTANT.format(step_s=4, checks=f'"ttft.p95 < {bound}"')),
                         server.url + "/v1", tmp_path / "run", "--protocol", "openai-chat", "--junit", str(junit),
                         model="gpt-test")
    finally:
        server.close()
    assert result.returncode == code, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str(tmp_path / "run")
    (judged,) = json.loads((tmp_path / "run" / "summary.json").read_text())["thresholds"]
    assert 0.2 <= judged["value"] < 0.3 and judged["ci"][0] >= 0.19 and judged["bound"] == float(bound)
    assert judged["result"] == ("fail" if code else "pass")
    row = next(line for line in result.stdout.splitlines() if f"ttft.p95 < {bound}" in line)
    assert ("✗" if code else "✓") in row and f"{judged['value']:.3g}" in row
    assert re.search(rf"\[{judged['ci'][0]:.3g}, {judged['ci'][1]:.3g}\]", row), row
    suite = ET.parse(junit).getroot()
    assert suite.tag == "testsuites" and suite.get("tests") == "1" and suite.get("failures") == str(int(bool(code)))
    failures = suite.findall("./testsuite/testcase/failure")
    assert len(failures) == int(bool(code))


@pytest.mark.slow
def test_abort_on_fail_stops_the_run_once_the_breach_is_decided(tmp_path: Path) -> None:
    """A 60 s plan against the 200 ms server: `ttft.p95 < 0.05` with abort_on_fail ends it after its first
    dozen first tokens, stop rule named, exit 99."""
    server = SlotServer(slots=16, ttft_base_s=0.2, ttft_per_token_s=0.0, tpot_s=0.005)
    checks = '{ expr = "ttft.p95 < 0.05", abort_on_fail = true }'
    try:
        result = run_cli(write_scenario(tmp_path, CONSTANT.format(step_s=60, checks=checks)), server.url + "/v1",
                         tmp_path / "run", "--protocol", "openai-chat", model="gpt-test")
    finally:
        server.close()
    assert result.returncode == BREACHED, result.stderr[-2000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["ended_at"] - manifest["started_at"] < 40, manifest  # the run's own span, not the 60 s plan
    assert manifest["stop"]["rule"] == "threshold_breached"
    assert manifest["stop_reason"].startswith("threshold ttft.p95 < 0.05 breached (abort_on_fail)")


@pytest.mark.slow
def test_the_packaged_ci_scenario_passes_against_the_simulator_as_the_pipeline_runs_it(tmp_path: Path) -> None:
    """The workflow's own command (tests below check it parses) against `tokenload sim`: exit 0, every check."""
    argv = _tokenload_commands(WORKFLOW)[-1]
    run = sim_run(tmp_path, Path("ci"), *argv[argv.index("--threshold"):],
                  sim_args=["--model", "sim-7b"], ok=False, timeout=180)
    assert run.result.returncode == 0, run.result.stdout[-3000:] + run.result.stderr[-2000:]
    results = json.loads((run.run_dir / "summary.json").read_text())["thresholds"]
    assert len(results) == 5 and all(r["result"] == "pass" for r in results), results


# --- the pipeline files -------------------------------------------------------------------------------------------

def _commands(path: Path) -> list[str]:
    """Every shell line of a GitHub workflow's `run` steps or a GitLab job's `script`."""
    data: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    if path == WORKFLOW:
        steps = [s for job in data["jobs"].values() for s in job["steps"]]
        return [line for s in steps if "run" in s for line in s["run"].splitlines()]
    return [line for job in data.values() if isinstance(job, dict) for line in job.get("script", [])]


def _tokenload_commands(path: Path) -> list[list[str]]:
    """The `tokenload` command lines, without their redirections and `&`."""
    out = []
    for line in _commands(path):
        words = shlex.split(line)
        if words and words[0] == "tokenload":
            out.append([w for w in words[1:] if w != "&" and not re.match(r"^\d?>", w) and w not in ("sim.url", "sim.log")])
    return out


@pytest.mark.parametrize("path", [WORKFLOW, GITLAB], ids=["github", "gitlab"])
def test_the_pipeline_files_commands_go_through_the_real_parser(path: Path) -> None:
    commands = _tokenload_commands(path)
    assert [c[0] for c in commands] == ["sim", "run"]
    sim, run = (build_parser().parse_args(c) for c in commands)
    assert run.scenario == "ci" and load_scenario(run.scenario).thresholds.checks
    assert run.base_url == f"http://127.0.0.1:{sim.port}/api" and run.model == sim.model
    for expr in run.threshold:
        parse(expr)
    assert str(run.junit).startswith(run.out)
    if path == GITLAB:
        job = yaml.safe_load(path.read_text(encoding="utf-8"))["loadtest"]
        assert job["artifacts"]["reports"]["junit"] == str(run.junit)
    else:
        steps = yaml.safe_load(path.read_text(encoding="utf-8"))["jobs"]["gate"]["steps"]
        upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
        assert upload["if"] == "always()" and str(run.out).startswith(upload["with"]["path"].rstrip("/"))


def test_docs_ci_md_shows_the_pipeline_files_as_they_are() -> None:
    text = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    assert WORKFLOW.read_text(encoding="utf-8") in blocks and GITLAB.read_text(encoding="utf-8") in blocks
