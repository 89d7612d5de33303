"""`tokenload run levers` against real servers, each number against its truth.

- An independent two-model server (tests/judgeserver.py: `judge-30b` at 2.5x `judge-7b`'s TTFT and TPOT, prefill
  as input^0.85) must come out as ratios within 5% of 2.5, a size exponent within 0.05 of 0.63 and a prefill
  exponent within 0.05 of 0.85, with lever rows for prompt, model, output cap and load.
- The simulator, likewise against what its truth file states (each model's time factor and size).
- Every lever's prediction, checked by running its counterfactual against the simulator: a run of the one
  condition the lever predicts (its prompt length, max_tokens, model and load), whose medians must lie inside the
  predicted 95% intervals.

The packaged scenario's design (4 prompt lengths x 3 output caps x 2 models at 1 and 4 users) runs with shorter
steps (one user until 24 requests finished, then 4 users for 20 s): the same truths in about a minute instead of
3.5.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from judgeserver import PREFILL_EXPONENT, SCALE, SIZE_EXPONENT, JudgeServer

from loadkit import run_cli, sim_run, truth_frame

from tokenload.analysis import analyze_run
from tokenload.analysis.levers import check_scenario, condition_rows
from tokenload.sim import launch
from tokenload.workload.scenario import packaged

# The packaged design with shorter steps: one user until 24 requests finished (one block), then 4 users for 20 s.
SHORT_STEPS = {"step_s = 60": "step_s = 20", "min_requests = 48": "min_requests = 24", "max_step_s = 150": "max_step_s = 90"}
# The simulator, compressed (10 ms per token for a 7B model, prefill 0.05 + 0.0002 n^0.85 s), and with a replica per
# user: no request waits for another's prefill or shares its decode batch, so a run of one condition is exactly the
# counterfactual a lever predicts (the design's mix around it no longer matters).
SIM_PROFILE = """
slots = 32
replicas = 4
prefill_base_s = 0.05
prefill_per_token_s = 0.0002
prefill_exponent = 0.85
prefill_interference = 0.0
decode_base_s = 0.01
decode_per_seq_s = 0.0
noise = 0.02
"""


def levers_scenario(tmp_path: Path, replace: dict[str, str] | None = None, name: str = "levers.toml") -> Path:
    """The packaged levers scenario, its text changed by `replace` (every key must occur)."""
    text = packaged("levers").read_text(encoding="utf-8")
    for old, new in (replace or SHORT_STEPS).items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def run_levers(scenario: Path, base_url: str, out: Path, *extra: str, model: str = "sim-7b") -> dict[str, Any]:
    result = run_cli(scenario, base_url, out, *extra, model=model, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(analyze_run(out))


def assert_claims(s: dict[str, Any], ratio: dict[str, float], prefill_exponent: float, within: float = 0.05) -> None:
    """Each model ratio within `within` of the truth's, the size exponent (30B over 7B) within 0.05 of the one the
    truth's ratio gives, the prefill exponent within 0.05; the verdicts and a lever row of each kind."""
    (r,) = s["model_ratios"]
    for metric in ("ttft", "tpot"):
        assert abs(r[metric]["ratio"] / ratio[metric] - 1) <= within, (metric, r[metric], ratio)
        exponent = math.log(ratio[metric]) / math.log(30 / 7)
        assert abs(s["model_size_law"]["exponent"][metric] - exponent) <= 0.05, (s["model_size_law"], exponent)
    assert abs(s["prefill_law"]["exponent"] - prefill_exponent) <= 0.05, s["prefill_law"]
    assert s["model_size_law"]["verdict"].startswith("sub-linear")
    assert s["prefill_law"]["verdict"].startswith("supported")
    assert s["e2e_drivers"]["verdict"].startswith("supported: output length")
    assert {row["lever"] for row in s["levers"]} == {"prompt", "model", "max_tokens", "load"}
    assert all(row["attainment"] is not None for row in s["levers"])


def test_levers_against_an_independent_two_model_server(tmp_path: Path) -> None:
    server = JudgeServer()
    try:
        s = run_levers(levers_scenario(tmp_path), server.base_url, tmp_path / "run", "--protocol", "openai-chat",
                       "--model", "judge-7b", "--model", "judge-30b", model="judge-7b")
    finally:
        server.close()
    assert set(s["models"]) == {"judge-7b", "judge-30b"}
    assert_claims(s, {"ttft": SCALE, "tpot": SCALE}, PREFILL_EXPONENT)
    assert abs(math.log(SCALE) / math.log(30 / 7) - SIZE_EXPONENT) < 1e-9
    assert s["levers"][0]["change"] == "switch to judge-7b (7B)"  # the only lever that meets TTFT <= 1 s at 4096 tokens


@pytest.fixture(scope="module")
def sim_levers(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], pd.DataFrame]:
    root = tmp_path_factory.mktemp("sim-levers")
    (root / "profile.toml").write_text(SIM_PROFILE, encoding="utf-8")
    with launch(["--profile", str(root / "profile.toml"), "--truth", str(root / "truth.jsonl")]) as sim:
        # An SLO the heaviest cell misses (TTFT 0.71 s, e2e 3.9 s) and the 7B model meets: every lever is priced.
        s = run_levers(levers_scenario(root), sim.base_url, root / "run", "--model", "sim-30b", "--slo-ttft", "0.5",
                       "--slo-e2e", "3")
    return s, truth_frame(root / "truth.jsonl")


@pytest.fixture(scope="module")
def sim_records(sim_levers: tuple[dict[str, Any], pd.DataFrame]) -> pd.DataFrame:
    return pd.read_parquet(Path(sim_levers[0]["run"]["run_dir"]) / "requests.parquet")


def served(records: pd.DataFrame, truth: pd.DataFrame) -> dict[str, float]:
    """The model ratios the simulator served, from its truth file's own times, matched as the analysis matches
    (geometric mean within each load x prompt x output cell): under a busy machine its late timers serve less
    than the 2.5x its law states."""
    m = records.merge(truth, left_on="server_request_id", right_on="request_id", suffixes=("", "_truth"))
    m = m[(m["status"] == "ok") & (m["output_tokens"] > 1)]
    m = m.assign(ttft=np.log(m["first_token"] - m["arrival"]),
                 tpot=np.log((m["last_token"] - m["first_token"]) / (m["output_tokens_truth"] - 1)))
    cells = m.groupby(["active_users", "prompt_tokens_target", "max_tokens", "model"])[["ttft", "tpot"]].mean()
    diff = cells.xs("sim-30b", level="model") - cells.xs("sim-7b", level="model")
    return {metric: float(np.exp(diff[metric].dropna().mean())) for metric in ("ttft", "tpot")}


def test_levers_against_the_simulator_and_its_truth_file(sim_levers: tuple[dict[str, Any], pd.DataFrame],
                                                         sim_records: pd.DataFrame) -> None:
    s, truth = sim_levers
    scale = truth.groupby("model")[["model_scale", "model_size_b"]].first()
    ratio = float(scale.loc["sim-30b", "model_scale"] / scale.loc["sim-7b", "model_scale"])
    exponent = math.log(ratio) / math.log(scale.loc["sim-30b", "model_size_b"] / scale.loc["sim-7b", "model_size_b"])
    assert abs(ratio - 2.5) < 0.01 and abs(exponent - 0.63) < 0.005  # what the truth file states of its law
    # What it served: within 5% of its law on a quiet machine; 10% below under a load average of 14 (its 10 ms
    # decode steps of the 7B model came late, those of the 30B far less so). The analysis must see what it served.
    assert_claims(s, served(sim_records, truth), 0.85, within=0.03)
    assert len(truth) == s["run"]["requests"]


# Changes this close count as the same: the design run and the check run are different runs of a shared machine, and
# a 0.8% TPOT effect of 4 users over 1 that the simulator's late timers made in one (predicted x0.9921 [0.9827,
# 0.9973]) was absent from the next (x1.000 [0.9974, 1.003]). A lever of 1% is no lever.
SAME = 0.01


def measured_change(new: np.ndarray, today: np.ndarray) -> tuple[float, float, float]:
    """The ratio of the two medians and its 95% bootstrap interval: the check run's own sampling noise."""
    rng = np.random.default_rng(0)
    draws = [np.median(rng.choice(new, len(new))) / np.median(rng.choice(today, len(today))) for _ in range(2000)]
    lo, hi = np.quantile(draws, [0.025, 0.975])
    return float(np.median(new) / np.median(today)), float(lo), float(hi)


def test_each_lever_predicts_what_its_counterfactual_run_measures(
        sim_levers: tuple[dict[str, Any], pd.DataFrame], tmp_path: Path) -> None:
    """Each lever's change over today (its medians over the baseline's), predicted with a 95% interval, against a
    run of the lever's condition beside today's: the measured change, within its own 95% interval (the check's 8
    to 12 requests a condition), meets the predicted interval. Side by side, because this shared machine's own
    speed drifts between runs (the simulator's 10 ms steps came 2% late in one run and 16% in another)."""
    s, _ = sim_levers
    (tmp_path / "profile.toml").write_text(SIM_PROFILE, encoding="utf-8")
    misses, checked = [], []
    with launch(["--profile", str(tmp_path / "profile.toml")]) as sim:
        for lever in s["levers"]:
            out = tmp_path / lever["lever"]
            scenario = tmp_path / f"{lever['lever']}.toml"
            scenario.write_text(check_scenario(lever, s["lever_baseline"], requests=8, max_step_s=120), encoding="utf-8")
            first, *others = sorted({lever["condition"]["model"], s["lever_baseline"]["condition"]["model"]})
            result = run_cli(scenario, sim.base_url, out, *(x for m in others for x in ("--model", m)), model=first,
                             timeout=240)
            assert result.returncode == 0, result.stderr[-3000:]
            records = pd.read_parquet(out / "requests.parquet")
            checked.append(lever["lever"])
            for key in ("ttft_s", "tpot_s", "e2e_s"):
                new, today = (condition_rows(records, x["condition"])[key].to_numpy(float)
                              for x in (lever, s["lever_baseline"]))
                assert min(len(new), len(today)) >= 5, (lever["change"], len(new), len(today))
                ratio, low, high = measured_change(new, today)
                predicted = lever["vs_today"][key]
                lo, hi = predicted["ci"]
                if not (low <= hi * (1 + SAME) and lo * (1 - SAME) <= high):
                    misses.append(f"{lever['change']}: {key} measured x{ratio:.4g} [{low:.4g}, {high:.4g}] "
                                  f"(n={len(new)}/{len(today)}), predicted x{predicted['ratio']:.4g} [{lo:.4g}, {hi:.4g}]")
    assert sorted(checked) == ["load", "max_tokens", "model", "prompt"]
    assert not misses, "\n".join(misses)


def test_a_lockstep_sweep_run_cannot_tell_which_length_drives_e2e(tmp_path: Path) -> None:
    """Two sweeps of three values advance together (the n-th request takes the n-th of each): no share is given."""
    run = sim_run(tmp_path, """
[prompt]
tokens = [128, 512, 2048]
[output]
max_tokens = [8, 32, 128]
ignore_eos = true
[load]
kind = "constant"
users = 2
step_s = 6
""", sim_args=["--profile", "fast"])
    verdict = run.summary["e2e_drivers"]["verdict"]
    assert "moved together (r = 1.00): which drives e2e cannot be told from this run; use [design]" in verdict
    assert "%" not in verdict
    assert {r["lever"] for r in run.summary["levers"] if r["attainment"] is None} == {"prompt", "max_tokens"}
