"""Per model, the size law, which factor and which lever, on synthetic runs whose every effect is known (`DesignLaw`).

The runs against real servers (the simulator, an independent scripted server, the counterfactual runs that
check each prediction) are in test_levers_run.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenload.analysis import compare_runs
from tokenload.analysis.pipeline import analyze, analyze_run
from tokenload.analysis.plots import _series
from tokenload.analysis.records import write_run
from tokenload.analysis.report import verdict_rows
from tokenload.analysis.synthetic import DesignLaw, Law, generate_design, write_design_run, write_synthetic_run

SLO = {"ttft_s": 1.0, "e2e_s": 5.0}
LAW = DesignLaw()
RATIO = (30 / 7) ** LAW.size_exponent  # 2.50


@pytest.fixture(scope="module")
def designed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A factorial design of two models at 1 and 4 users, analysed (report written)."""
    run_dir = write_design_run(tmp_path_factory.mktemp("design") / "run", LAW, per_cell=6, slo=SLO)
    return analyze_run(run_dir) | {"_dir": str(run_dir)}


def test_each_model_gets_its_own_percentiles_steps_formula_and_fits(designed: dict[str, Any]) -> None:
    models = designed["models"]
    assert set(models) == {"syn-7b", "syn-30b"}
    for name, entry in models.items():
        assert entry["n"] == 144 and entry["size_b"] == LAW.models[name]
        assert entry["ci"]["ttft_p50_s"][0] <= entry["ttft_p50_s"] <= entry["ci"]["ttft_p50_s"][1]
        assert [s["load_level"] for s in entry["steps"]] == [1, 4]
        assert entry["formula"]["holds"] is True  # each model's own steps: the formula holds (pooled, it does not)
        assert abs(entry["fits"]["ttft_vs_input"]["exponent"] - LAW.prefill_k) < 0.05
    assert designed["formula"]["mape_exact"] > 4 * max(m["formula"]["mape_exact"] for m in models.values())
    assert designed["fits"]["ttft_vs_input"]["of_model"] == "syn-7b"  # the channel's own, not a line through both


def test_the_size_law_and_the_model_ratio_recover_the_law(designed: dict[str, Any]) -> None:
    law = designed["model_size_law"]
    for metric in ("ttft", "tpot"):
        assert law["ci"][metric][0] <= LAW.size_exponent <= law["ci"][metric][1]
        assert abs(law["exponent"][metric] - LAW.size_exponent) < 0.02
    assert law["verdict"].startswith("sub-linear: TPOT grows as size^0.6")
    (ratio,) = designed["model_ratios"]
    assert (ratio["model"], ratio["baseline"], ratio["matched_cells"]) == ("syn-30b", "syn-7b", 24)
    for metric in ("ttft", "tpot", "e2e"):
        assert ratio[metric]["ci"][0] <= RATIO <= ratio[metric]["ci"][1], (metric, ratio[metric])
    assert ratio["headline"].startswith("syn-30b vs syn-7b: TTFT x2.5")


def test_the_three_claims_are_judged_with_intervals(designed: dict[str, Any]) -> None:
    prefill = designed["prefill_law"]
    assert prefill["ci"][0] <= LAW.prefill_k <= prefill["ci"][1] and prefill["verdict"].startswith("supported")
    attribution = designed["attribution"]
    assert attribution["moved_together"] == [] and attribution["e2e_verdict"].startswith("supported: output length")
    e2e = attribution["e2e"]["shares"]
    assert e2e["output"]["ci"][0] > e2e["input"]["ci"][1]
    assert attribution["tpot"]["shares"]["model"]["share"] > 0.8  # TPOT moves with size and load only
    rows = {topic: text for topic, text, _ in verdict_rows(designed)}
    assert rows["Output length drives e2e?"] == attribution["e2e_verdict"]
    assert rows["Prefill sub-linear?"] == prefill["verdict"]
    assert rows["Sub-linear in model size?"] == designed["model_size_law"]["verdict"]


def true_medians(law: DesignLaw, model: str, n_in: float, cap: int, users: int, slo: dict[str, float],
                 seed: int = 1) -> dict[str, float]:
    """The law's medians and SLO attainment at one condition, drawn with the law's own noise."""
    rng = np.random.default_rng(seed)
    size = 200_000

    def noise() -> np.ndarray:
        return np.exp(rng.normal(-law.noise ** 2 / 2, law.noise, size))

    ttft = law.ttft(model, n_in, users) * noise()
    tpot = law.tpot(model, users) * noise()
    e2e = ttft + tpot * (cap - 1)
    meets = (ttft <= slo["ttft_s"]) & (e2e <= slo["e2e_s"])
    return {"ttft_s": float(np.median(ttft)), "tpot_s": float(np.median(tpot)), "e2e_s": float(np.median(e2e)),
            "attainment": float(meets.mean())}


def test_every_lever_prediction_holds_the_laws_own_value(designed: dict[str, Any]) -> None:
    base = designed["lever_baseline"]
    assert base["condition"] == {"input_tokens": 4096, "max_tokens": 128, "model": "syn-30b", "load": "4 users"}
    levers = {row["lever"]: row for row in designed["levers"]}
    assert set(levers) == {"prompt", "model", "max_tokens", "load"}
    for row in [base, *levers.values()]:
        c = row["condition"]
        users = int(c["load"].split()[0])
        truth = true_medians(LAW, c["model"], c["input_tokens"], c["max_tokens"], users, SLO)
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            lo, hi = row["ci"][key]
            assert lo <= truth[key] <= hi, (row.get("change", "baseline"), key, truth[key], row["ci"][key])
        assert row["ci"]["attainment"][0] - 0.05 <= truth["attainment"] <= row["ci"]["attainment"][1] + 0.05


def test_the_levers_are_ranked_and_the_first_fix_is_the_top_one(designed: dict[str, Any], tmp_path: Path) -> None:
    rows = designed["levers"]
    assert rows[0]["lever"] == "model" and rows[0]["meets_slo"] is True  # 7B: TTFT 0.68 s, e2e 4.0 s
    assert [r["attainment"] for r in rows] == sorted((r["attainment"] for r in rows), reverse=True)
    assert all(not r["meets_slo"] for r in rows[1:])
    assert "alone, these meet it: switch to syn-7b" in designed["lever_verdict"]
    first = {topic: text for topic, text, _ in verdict_rows(designed)}["First fix"]
    assert first.startswith("switch to syn-7b (7B): TTFT ") and "s/token x 127 = " in first
    prompt = next(r for r in rows if r["lever"] == "prompt")
    assert prompt["change"] == "halve the prompt (4096 -> 2048 input tokens)"
    cap = next(r for r in rows if r["lever"] == "max_tokens")
    assert cap["change"] == "halve max_tokens (128 -> 64)" and cap["condition"]["max_tokens"] == 64
    html = (Path(designed["_dir"]) / "report.html").read_text(encoding="utf-8")
    assert html.index("<h2>Which lever</h2>") < html.index("<h2>Verdict</h2>")


def test_a_cap_that_meets_the_slo_is_found(tmp_path: Path) -> None:
    """One model at one load: TTFT 0.52 s at 4096 tokens, 20 ms/token: e2e <= 2 s holds up to about 74 tokens."""
    law = DesignLaw(models={"syn-7b": 7.0}, users=(1,), load_growth=0.0)
    s = analyze_run(write_design_run(tmp_path / "run", law, per_cell=8, slo={"e2e_s": 2.0}), write=False)
    cap = next(r for r in s["levers"] if r["lever"] == "max_tokens")
    n = cap["condition"]["max_tokens"]
    assert cap["meets_slo"] and cap["change"].startswith(f"cap max_tokens at {n} (from 128")
    exact = math.floor((2.0 - law.ttft("syn-7b", 4096, 1)) / law.tpot("syn-7b", 1)) + 1
    assert exact * 0.85 <= n <= exact  # the grid's cap below the exact one


def test_a_lockstep_sweep_cannot_tell_which_length_drives_e2e(tmp_path: Path) -> None:
    law = DesignLaw(prompts=(128, 512, 1024), outputs=(16, 64, 128), lockstep=True)
    s = analyze_run(write_design_run(tmp_path / "run", law, per_cell=8, slo=SLO), write=False)
    verdict = s["e2e_drivers"]["verdict"]
    assert verdict.startswith("input length and output length moved together (r = 1.00): which drives e2e cannot "
                              "be told from this run; use [design]")
    assert "%" not in verdict  # never a share
    assert s["attribution"]["moved_together"][0]["factors"] == ["input", "output"]
    unknown = {r["lever"]: r for r in s["levers"] if r["attainment"] is None}
    assert set(unknown) == {"prompt", "max_tokens"}
    assert all("cannot be told from this run" in r["note"] for r in unknown.values())
    assert {r["lever"] for r in s["levers"] if r["attainment"] is not None} == {"model", "load"}


def test_a_model_that_changed_with_load_has_no_size_law(tmp_path: Path) -> None:
    df = generate_design(LAW, per_cell=6)
    df = df[((df["model"] == "syn-7b") & (df["active_users"] == 1)) | ((df["model"] == "syn-30b")
                                                                       & (df["active_users"] == 4))]
    manifest = {"run_id": "x", "scenario": {"channel": {"models": list(LAW.models)}}}
    s = analyze_run(write_run(tmp_path / "run", df.reset_index(drop=True), manifest), write=False)
    law = s["model_size_law"]
    assert law["exponent"] == {"ttft": None, "tpot": None}
    assert "model size and load moved together" in law["verdict"] and "cannot be told from this run" in law["verdict"]
    assert s["model_ratios"][0]["matched_cells"] == 0 and "not compared" in s["model_ratios"][0]["headline"]


def test_declared_sizes_serve_ids_without_one(tmp_path: Path) -> None:
    df = generate_design(LAW, per_cell=4).replace({"model": {"syn-7b": "small", "syn-30b": "large"}})
    manifest = {"run_id": "x", "scenario": {"channel": {"models": ["small", "large"],
                                                        "model_sizes": {"small": 7, "large": 30}}}}
    s = analyze_run(write_run(tmp_path / "run", df, manifest), write=False)
    assert s["models"]["large"]["size_b"] == 30.0
    assert abs(s["model_size_law"]["exponent"]["tpot"] - LAW.size_exponent) < 0.03


def test_compare_of_one_run_compares_its_models(designed: dict[str, Any], tmp_path: Path) -> None:
    comparison = compare_runs([designed["_dir"]], out_dir=tmp_path / "cmp")
    assert [r["label"] for r in comparison["runs"]] == ["syn-7b", "syn-30b"]
    (models,) = comparison["models"]
    assert comparison["headline"][0] == models["headline"]
    assert models["headline"].startswith("syn-30b vs syn-7b: TTFT x2.5")
    assert models["tpot"]["ci"][0] <= RATIO <= models["tpot"]["ci"][1]


def test_compare_of_two_runs_of_other_models_is_about_the_models(tmp_path: Path) -> None:
    df = generate_design(LAW, per_cell=6)
    dirs = []
    for name in LAW.models:
        part = df[df["model"] == name].reset_index(drop=True)
        dirs.append(write_run(tmp_path / name, part, {"run_id": name, "scenario": {"channel": {"models": [name]}}}))
    comparison = compare_runs(dirs, labels=["small", "large"], out_dir=tmp_path / "cmp")
    (models,) = comparison["models"]
    assert models["headline"].startswith("syn-30b vs syn-7b: TTFT x2.5") and models["matched_cells"] == 24


def test_the_scatter_charts_colour_a_runs_models_apart(designed: dict[str, Any]) -> None:
    analysis = analyze(designed["_dir"], write=False)
    series = _series([("run", analysis)])
    assert [prefix for prefix, *_ in series] == ["syn-30b: ", "syn-7b: "]
    assert all(set(ok["model"].astype(str)) == {prefix[:-2]} for prefix, ok, _, _ in series)
    assert series[0][3]["ttft_vs_input"]["exponent"] == analysis.summary["models"]["syn-30b"]["fits"][
        "ttft_vs_input"]["exponent"]


def test_a_run_without_a_second_model_has_no_size_law(tmp_path: Path) -> None:
    law = DesignLaw(models={"syn-7b": 7.0})
    s = analyze_run(write_design_run(tmp_path / "run", law, per_cell=4), write=False)
    assert s["model_size_law"] is None and "model_ratios" not in s
    assert set(s["models"]) == {"syn-7b"} and {r["lever"] for r in s["levers"]} == {"prompt", "max_tokens", "load"}


def test_compare_of_peak_and_off_peak_prices_the_off_peak_lever(tmp_path: Path) -> None:
    night = write_synthetic_run(tmp_path / "night", Law(users=(1, 2, 4), tpot_s=0.02, capacity=10**6), n=600)
    noon = write_synthetic_run(tmp_path / "noon", Law(users=(1, 2, 4), tpot_s=0.04, capacity=10**6), n=600, seed=1)
    comparison = compare_runs([noon, night], labels=["noon", "night"], out_dir=tmp_path / "cmp")
    (row,) = comparison["levers"]
    assert row["lever"] == "off_peak" and row["change"] == "send at the time of night instead of noon"
    assert row["load"] == "4 users" and row["measured"] is True
    assert abs(row["tpot_s"] - 0.02) < 0.002 and abs(row["today"]["tpot_s"] - 0.04) < 0.004
    assert row["ci"]["e2e_s"][0] <= row["e2e_s"] <= row["ci"]["e2e_s"][1] < row["today"]["e2e_s"]
    assert row["headline"] in comparison["headline"] and comparison["models"] == []
