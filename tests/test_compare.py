"""Run comparison: the Mann-Whitney test and the files `tokenload compare` writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
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


def test_compare_pairs_steps_by_load_level_and_says_when_none_are_shared(tmp_path: Path) -> None:
    from tokenload.analysis import compare_runs

    off = write_synthetic_run(tmp_path / "off", Law(), n=6000, seed=1)
    peak = write_synthetic_run(tmp_path / "peak", Law(users=(1, 2, 4, 8, 16), capacity=4), n=6000, seed=3)
    other = write_synthetic_run(tmp_path / "other", Law(users=(3, 6)), n=2000, seed=4)
    c = compare_runs([off, peak, other], ["off", "peak", "other"], tmp_path / "cmp")
    peak_levels = [x for x in c["levels"] if x["label"] == "peak"]
    assert [x["load_level"] for x in peak_levels] == [1, 2, 4, 8, 16]
    ttft = {x["load_level"]: x["ttft"] for x in peak_levels}
    # Below its capacity of 4 the peak run follows the same law; above it requests queue.
    assert all(ttft[u]["verdict"] == "same" for u in (1, 2, 4))
    assert ttft[16]["verdict"] == "slower" and ttft[16]["delta_p50_ci95"][0] > 0
    assert all(0 <= ttft[u]["p_holm"] <= 1 and ttft[u]["p_holm"] >= ttft[u]["p_value"] for u in ttft)
    head = next(line for line in c["headline"] if line.startswith("peak TTFT"))
    assert "slower at 2 of 5 matched levels (8 users, 16 users)" in head
    assert all(d["verdict"] == "no shared load level" for d in c["deltas"] if d["label"] == "other")
    assert any(line.startswith("other TTFT: no load level in common") for line in c["headline"])
    assert any(line.startswith("peak output throughput: ") for line in c["headline"])
    html = (tmp_path / "cmp" / "comparison.html").read_text()
    assert "matched by load level" in html and "16 users" in html


def test_a_level_with_no_finished_request_in_one_run_is_compared_without_a_ratio(tmp_path: Path) -> None:
    # A searched run's probe can be decided before any of its requests finished (late and early first tokens)
    # and its streams cut: the demo's comparison then stopped on None / float at that level.
    from tokenload.analysis import compare_runs
    from tokenload.analysis.synthetic import generate, manifest_for, write_run

    off = write_synthetic_run(tmp_path / "off", Law(users=(1, 2, 4)), n=3000, seed=1)
    law = Law(users=(1, 2, 4))
    df = generate(law, n=3000, seed=2)
    cut = df["active_users"].eq(4)
    df.loc[cut, "in_flight"], df.loc[cut, "status"] = True, "cancelled"
    peak = write_run(tmp_path / "peak", df, manifest_for(law, df))
    c = compare_runs([off, peak], ["off", "peak"], tmp_path / "cmp")
    at4 = next(x for x in c["levels"] if x["load_level"] == 4)
    assert at4["ttft"]["n"] == 0 and at4["ttft"]["ratio_p50"] is None and at4["ttft"]["n_baseline"] > 100
    assert at4["ttft"]["verdict"] == "no finished request"  # not "same": there was nothing to compare
    at2 = next(x for x in c["levels"] if x["load_level"] == 2)
    assert at2["ttft"]["ratio_p50"] == pytest.approx(1.0, abs=0.1)
    assert (tmp_path / "cmp" / "comparison.html").is_file()


def test_a_level_measured_twice_is_compared_by_its_step_with_the_most_requests(tmp_path: Path) -> None:
    # A searched run revisits a level: its last step there may be a five-request probe (the demo's comparison
    # then read TPOT "no meaningful difference" from 5 requests against a 4x slower peak).
    from tokenload.analysis import compare_runs
    from tokenload.analysis.synthetic import generate, manifest_for, write_run

    law = Law(users=(1, 2, 4))
    off = write_synthetic_run(tmp_path / "off", law, n=3000, seed=1)
    df = generate(law, n=3000, seed=2)
    again = df[df["active_users"].eq(4)].head(5).copy()  # a later probe back at 4 users, after a step above
    again["step"] = int(df["step"].max()) + 2
    shift = float(df["finished_at"].max() - again["started_at"].min()) + 60.0
    for column in ("scheduled_at", "started_at", "finished_at"):
        again[column] += shift
    again["request_id"] = again["request_id"].astype(str) + "-again"
    peak = write_run(tmp_path / "peak", pd.concat([df, again], ignore_index=True), manifest_for(law, df))
    c = compare_runs([off, peak], ["off", "peak"], tmp_path / "cmp")
    at4 = next(x for x in c["levels"] if x["load_level"] == 4)
    assert at4["step"] == int(df.loc[df["active_users"].eq(4), "step"].iloc[0]) and at4["ttft"]["n"] > 100, at4


def test_holm_adjustment_by_hand() -> None:
    from tokenload.analysis.stats import holm

    # Sorted 0.01, 0.03, 0.04 -> 3 x 0.01, 2 x 0.03, max(1 x 0.04, previous): monotone.
    assert holm([0.01, 0.04, 0.03, float("nan")])[:3] == pytest.approx([0.03, 0.06, 0.06])


def test_delta_interval_covers_a_planted_shift_small_and_large() -> None:
    from tokenload.analysis.compare import _delta_ci

    for n in (400, 20_000):  # bootstrap below BOOTSTRAP_MAX_N, order statistics above
        covered = 0
        for seed in range(40):
            rng = np.random.default_rng(seed)
            a = rng.exponential(1.0, n)
            lo, hi = _delta_ci(a, rng.exponential(1.0, n) + 0.3, 0.5, seed=seed)
            covered += lo < 0.3 < hi
            assert hi - lo < (0.5 if n == 400 else 0.1)
        assert covered >= 34, (n, covered)  # a 95% interval: 38 of 40 expected, 34 is far in the tail


@pytest.mark.slow
def test_compare_names_what_a_relay_adds_over_the_direct_run(tmp_path: Path) -> None:
    """Two real runs on one simulator, the second through a relay (tests/holdingrelay.py) that holds the
    headers until the first token and delays everything by 0.25 s, and sends longer prompts (512-1536 tokens
    where the direct run sent 64-1024: the server's prefill differs by about 0.2 s). `compare --relay` must
    find the relay's 0.25 s, not the raw difference: with the server's metrics sampled in both runs by
    subtracting the server's own time, without them from each run's TTFT-vs-input line; TTFB +0.25 s + the
    direct run's headers-to-first-token time, no change in the gaps between tokens, and the held headers.
    Without --relay, runs through two URLs are no relay comparison."""
    import shutil

    import pandas as pd
    from holdingrelay import HoldingRelay

    from loadkit import run_cli, write_scenario

    from tokenload.sim import launch

    delay = 0.25
    body = ('[prompt]\ntokens = {{ dist = "uniform", min = {lo}, max = {hi} }}\n[output]\nmax_tokens = 16\n'
            'ignore_eos = true\n[load]\nkind = "constant"\nusers = 1\nstep_s = 14\nstep_warmup_s = 0.5\n'
            '[stop]\ndrain_s = 2\n[server]\ndiscover = false\ninterval_s = 0.1\n')
    (tmp_path / "d").mkdir()
    (tmp_path / "r").mkdir()
    direct_scenario = write_scenario(tmp_path / "d", body.format(lo=64, hi=1024))
    relay_scenario = write_scenario(tmp_path / "r", body.format(lo=512, hi=1536))
    profile = tmp_path / "profile.toml"  # TTFT 0.15 s + 0.4 ms a prompt token (linear), 10 ms an output token
    profile.write_text('extends = "fast"\nprefill_base_s = 0.15\nprefill_per_token_s = 0.0004\n'
                       'prefill_exponent = 1.0\ndecode_base_s = 0.01\n')
    with launch(["--profile", str(profile)]) as sim:
        port = int(sim.base_url.split(":")[-1].split("/")[0])
        metrics = ("--server-metrics", f"http://127.0.0.1:{port}/metrics")
        direct = run_cli(direct_scenario, sim.base_url, tmp_path / "direct", "--protocol", "anthropic", *metrics)
        with HoldingRelay(port, delay) as relay:
            relayed = run_cli(relay_scenario, f"http://127.0.0.1:{relay.port}/api", tmp_path / "relay",
                              "--protocol", "anthropic", *metrics)
    assert direct.returncode == 0 and relayed.returncode == 0, direct.stderr[-1500:] + relayed.stderr[-1500:]
    assert relay.requests >= 10

    def compare(*dirs: Path, relay_flag: bool = True) -> dict:
        out = tmp_path / f"cmp-{len(list(tmp_path.glob('cmp-*')))}"
        assert main(["compare", *map(str, dirs), "--labels", "direct,relay", "--out", str(out), "--quiet",
                     *(["--relay"] if relay_flag else [])]) == 0
        return json.loads((out / "comparison.json").read_text())

    comparison = compare(tmp_path / "direct", tmp_path / "relay")
    overhead = comparison["overhead"][0]
    level = overhead["levels"][0]
    assert overhead["other_url"] and level["load"] == "1 user"
    added, ttft, ttfb, itl = level["ttft_added"], level["ttft"], level["ttfb"], level["itl"]
    # raw: the relay's 0.25 s and the longer prompts' prefill (about 0.2 s at the medians; 14-24 requests a run)
    assert ttft["delta_p50_s"] > delay + 0.05, ttft
    assert added["basis"] == "server" and abs(added["delta_s"] - delay) <= 0.05, added
    assert added["ci95"][0] <= delay + 0.05 and added["ci95"][1] >= delay - 0.05, added
    # the truth: what the relay was told to add, and the direct run's own wait between headers and first token
    ok = pd.read_parquet(tmp_path / "direct" / "requests.parquet").query("status == 'ok'")
    header_to_token = float((ok.ttft_s - ok.ttfb_s).median())
    assert abs(itl["delta_p50_s"]) <= 0.005 and abs(itl["delta_p95_s"]) <= 0.01, itl
    held = overhead["headers_held"]
    assert held["run"]["headers_held"] == held["run"]["headers_judged"] > 0
    assert held["baseline"]["headers_held"] == 0 and held["baseline"]["headers_judged"] > 0
    said = " ".join(comparison["headline"])
    assert f"relay adds at 1 user: TTFT +{added['delta_s']:.3g} [" in said
    assert "(the server's own time subtracted: the server's TTFT histogram: " in said
    assert f"as measured: TTFT +{ttft['delta_p50_s']:.3g} [" in said
    assert "relay: response headers came only with the first token in" in said

    # without the server's metrics: each run's TTFT-vs-input line, at one input length both sent
    for name in ("direct", "relay"):
        shutil.copytree(tmp_path / name, tmp_path / f"{name}-bare")
        (tmp_path / f"{name}-bare" / "server_metrics.parquet").unlink()
    bare = compare(tmp_path / "direct-bare", tmp_path / "relay-bare")["overhead"][0]["levels"][0]
    matched = bare["ttft_added"]
    assert matched["basis"] == "input" and 512 <= matched["at_input_tokens"] <= 1024, matched
    assert abs(matched["delta_s"] - delay) <= 0.06, matched
    assert abs(ttfb["delta_p50_s"] - (ttft["delta_p50_s"] + header_to_token)) <= 0.1, (ttfb, header_to_token)

    # not asked: two URLs are just two runs
    plain = compare(tmp_path / "direct", tmp_path / "relay", relay_flag=False)
    assert plain["overhead"] == [] and not any(" adds " in line for line in plain["headline"])
