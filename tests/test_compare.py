"""Run comparison: the Mann-Whitney test and the files `tokenload compare` writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenload.analysis.compare import mann_whitney
from tokenload.analysis.synthetic import Law, write_synthetic_run
from tokenload.cli import main


def test_mann_whitney_detects_a_planted_shift_and_not_a_null_one() -> None:
    rng = np.random.default_rng(7)
    base = rng.lognormal(0.0, 0.5, 3000)
    shifted = rng.lognormal(0.1, 0.5, 3000)
    same = rng.lognormal(0.0, 0.5, 3000)
    hit = mann_whitney(base, shifted)
    assert hit["p_value"] < 1e-6 and hit["effect"] > 0.5
    assert mann_whitney(base, same)["p_value"] > 0.05


def test_mann_whitney_exact_small_case_and_ties() -> None:
    # Hand count: b beats a in 8 of 9 pairs plus one tie -> U_b = 8.5.
    res = mann_whitney(np.array([1.0, 2.0, 3.0]), np.array([3.0, 4.0, 5.0]))
    assert res["u"] == 8.5 and res["effect"] == pytest.approx(8.5 / 9)
    flipped = mann_whitney(np.array([3.0, 4.0, 5.0]), np.array([1.0, 2.0, 3.0]))
    assert flipped["effect"] == pytest.approx(1 - res["effect"]) and flipped["p_value"] == pytest.approx(res["p_value"])
    assert mann_whitney(np.ones(10), np.ones(10))["p_value"] == 1.0


def test_compare_cli_writes_files_and_flags_only_real_shifts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    off = write_synthetic_run(tmp_path / "off", Law(), n=6000, seed=1)
    same = write_synthetic_run(tmp_path / "same", Law(), n=6000, seed=2)
    peak = write_synthetic_run(tmp_path / "peak", Law(capacity=8, tpot_s=0.03), n=6000, seed=3)
    out = tmp_path / "cmp"
    code = main(["compare", str(off), str(same), str(peak), "--labels", "off-peak,again,peak", "--out", str(out)])
    assert code == 0
    assert capsys.readouterr().out.strip().endswith("comparison.html")
    data = json.loads((out / "comparison.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["off-peak", "again", "peak"]
    verdicts = {(d["label"], d["metric"]): d for d in data["deltas"]}
    assert not any(verdicts[("again", m)]["significant"] for m in ("ttft", "tpot", "e2e"))
    assert verdicts[("peak", "tpot")]["verdict"] == "slower"
    assert verdicts[("peak", "tpot")]["ratio_p50"] == pytest.approx(1.5, rel=0.02)
    assert verdicts[("peak", "e2e")]["significant"]
    assert {p.name for p in (out / "plots").glob("*.png")} == {
        "cdfs.png", "latency_vs_users.png", "throughput_vs_users.png", "ttft_vs_input.png", "e2e_vs_output.png"}
    html = (out / "comparison.html").read_text()
    assert html.count("data:image/png;base64,") == 5 and "off-peak vs again vs peak" in html


def test_compare_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = write_synthetic_run(tmp_path / "a", Law(), n=500)
    assert main(["compare", str(run)]) == 2
    assert main(["compare", str(run), str(run), "--labels", "only-one"]) == 2
    assert main(["compare", str(run), str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 3 and "Traceback" not in err
