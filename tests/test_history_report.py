"""`tokenload history`: windows, statistics and advice checked against known days and the simulator's truth."""

from __future__ import annotations

import json
import shutil
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from simfixtures import DemoRun, DiurnalWatch

from tokenload.cli import main
from tokenload.dayclock import DAY_S, utc_offset_s
from tokenload.history.store import Sample, open_store
from tokenload.history.views import MIN_PER_HOUR, analyze_history, bridged, runs

CHANNEL = "anthropic relay.example sim-7b"


def _at_hour(hour: float, day: int = 0, period_s: float = DAY_S) -> float:
    t = 1_700_000_000.0 + day * period_s
    return t - (t + utc_offset_s(t)) % period_s + hour / 24 * period_s


def _synthetic_db(path: Path, ttft_of_hour: dict[int, float], per_hour: int = 8, days: int = 2,
                  active_users: int = 1, seed: int = 0, channel: str = CHANNEL, hours: range | list[int] = range(24)
                  ) -> None:
    """A history whose median TTFT per hour is known: `ttft_of_hour[h]` (default 1.0 s) with 5% noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for day in range(days):
        for hour in hours:
            for k in range(per_hour):
                ttft = ttft_of_hour.get(hour, 1.0) * float(rng.lognormal(0, 0.05))
                rows.append({"request_id": f"{seed}-{active_users}-{day}-{hour}-{k}", "status": "ok",
                             "started_at": _at_hour(hour + (k + 0.5) / per_hour, day), "ttft_s": ttft,
                             "tpot_s": 0.02, "e2e_s": ttft + 0.02 * 31, "output_tokens": 32, "input_tokens": 64,
                             "active_users": active_users})
    with closing(open_store(path)) as store:
        store.add_sample(Sample(f"synthetic-{seed}-{active_users}", channel, "probe", rows[0]["started_at"]), rows)


def test_runs_join_across_midnight() -> None:
    levels = ["low", "low", None, "high", "high", "same"] + ["same"] * 16 + ["low", "low"]
    assert runs(levels, "low") == [[22, 23, 0, 1]]
    assert runs(levels, "high") == [[3, 4]]


def test_a_lone_hour_without_evidence_does_not_split_a_window() -> None:
    def row(level: str | None, ratio: float | None) -> dict:
        return {"level": level, "ratio": ratio}

    table = [row("same", 1.0)] * 24
    table[12:18] = [row("high", 2.0), row("high", 2.1), row(None, None), row("high", 2.0), row("same", 1.5),
                    row("high", 2.2)]
    assert runs(bridged(table, "high"), "high") == [[12, 13, 14, 15, 16, 17]]
    table[14] = row("same", 1.0)  # an hour that argues against the window splits it
    assert runs(bridged(table, "high"), "high") == [[12, 13], [15, 16, 17]]


def test_known_windows_and_their_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "h.db"
    day = {h: 0.4 for h in (2, 3, 4)} | {h: 3.0 for h in (22, 23, 0)}
    _synthetic_db(db, day)
    _synthetic_db(db, {10: 9.0}, per_hour=2, active_users=16, seed=1)  # stress runs: slow at 10:00, flat otherwise
    out = tmp_path / "report"
    assert main(["history", "--db", str(db), "--since", "100000d", "--out", str(out), "--csv"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "history.json").read_text())[CHANNEL]
    ttft = result["metrics"]["ttft"]
    assert ttft["peak"]["hours"] == [22, 23, 0] and ttft["peak"]["label"] == "22:00-01:00"
    assert ttft["off_peak"]["hours"] == [2, 3, 4] and ttft["off_peak"]["label"] == "02:00-05:00"
    peak, off = ttft["peak"]["stats"], ttft["off_peak"]["stats"]
    assert peak["ttft_p50_s"] == pytest.approx(3.0, rel=0.03) and off["ttft_p50_s"] == pytest.approx(0.4, rel=0.03)
    assert peak["ttft_p50_ci95"][0] < 3.0 < peak["ttft_p50_ci95"][1] * 1.03
    assert peak["requests"] == 3 * 8 * 2
    assert result["comparison"]["ttft"]["ratio"] == pytest.approx(7.5, rel=0.05)
    assert result["comparison"]["ttft"]["p_value"] < 1e-6
    assert set(result["comparison_by_load"]) == {"1", "16"}  # matched by load level: like with like
    assert result["comparison_by_load"]["16"]["ttft"]["ratio"] == pytest.approx(1.0, rel=0.1)
    assert result["hours"]["ttft"][10]["level"] == "same" and result["probe_requests"] == 24 * 8 * 2
    assert result["metrics"]["ttft"]["peak"]["stats"]["formula_mape_exact"] == pytest.approx(0.0, abs=1e-6)
    assert peak["ttft_vs_input"]["model"] is None and "input length" in peak["ttft_vs_input"]["note"]
    assert "advice: at 02:00-05:00 TTFT p50 is 0.4 s vs 3 s at 22:00-01:00 (7.5x)" in printed
    assert result["metrics"]["tpot"]["note"].startswith("no hour differs")
    cells = result["heatmap"]["ttft_p50_s"]
    weekday = (int((_at_hour(3) + utc_offset_s(_at_hour(3))) // DAY_S) + 3) % 7
    assert cells[weekday][3] == pytest.approx(0.4, rel=0.05) and cells[weekday][12] == pytest.approx(1.0, rel=0.05)
    assert [d["requests"] for d in result["daily"]] == [24 * 8] * 2
    for name in ("history.html", "heatmap.png", "hours.png", "daily.png", "history.csv", "hours.csv"):
        assert (out / name).stat().st_size > 0
    assert len((out / "hours.csv").read_text().splitlines()) == 25
    assert len((out / "history.csv").read_text().splitlines()) == 1 + 24 * 8 * 2 + 24 * 2 * 2


def test_each_channel_gets_its_own_section_and_channel_picks_them(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    db, other = tmp_path / "h.db", "openai-chat relay.example gpt-x"
    _synthetic_db(db, {h: 2.0 for h in (9, 10)}, per_hour=6)
    _synthetic_db(db, {h: 2.0 for h in (18, 19)}, per_hour=6, seed=1, channel=other)
    assert main(["history", "--db", str(db), "--since", "100000d", "--out", str(tmp_path / "all")]) == 0
    both = json.loads((tmp_path / "all" / "history.json").read_text())
    assert both[CHANNEL]["metrics"]["ttft"]["peak"]["hours"] == [9, 10]
    assert both[other]["metrics"]["ttft"]["peak"]["hours"] == [18, 19]
    assert (tmp_path / "all" / "heatmap-1.png").is_file() and (tmp_path / "all" / "heatmap-2.png").is_file()
    capsys.readouterr()
    assert main(["history", "--db", str(db), "--since", "100000d", "--channel", "gpt-x",
                 "--out", str(tmp_path / "one")]) == 0
    assert list(json.loads((tmp_path / "one" / "history.json").read_text())) == [other]
    assert capsys.readouterr().out.startswith(f"{other}: 288 requests")


def test_too_few_data_and_a_flat_channel_say_so(tmp_path: Path) -> None:
    few = tmp_path / "few.db"
    _synthetic_db(few, {3: 0.2}, per_hour=MIN_PER_HOUR - 1, days=1)
    with closing(open_store(few)) as store:
        result = analyze_history(store.query())
    assert result["metrics"]["ttft"]["peak"] is None and result["metrics"]["ttft"]["off_peak"] is None
    assert result["metrics"]["ttft"]["note"].startswith("too few data to tell: only 0 of 24 hours")
    assert result["advice"][0].startswith("too few data")
    flat = tmp_path / "flat.db"
    _synthetic_db(flat, {}, per_hour=10)
    with closing(open_store(flat)) as store:
        result = analyze_history(store.query())
    assert result["metrics"]["ttft"]["peak"] is None and "looks flat" in result["metrics"]["ttft"]["note"]


def test_too_few_data_counts_the_hours_that_have_enough(tmp_path: Path) -> None:
    """A first watch: one hour held 9 successful requests, the next 2: "only 1 of 24 hours" (it said 0, counting
    the hours that had enough requests both in them and in the rest of the day)."""
    db = tmp_path / "h.db"
    _synthetic_db(db, {}, per_hour=9, days=1, hours=[7])
    _synthetic_db(db, {}, per_hour=2, days=1, seed=1, hours=[8])
    with closing(open_store(db)) as store:
        result = analyze_history(store.query())
    assert [h["ok"] for h in result["hours"]["ttft"][7:9]] == [9, 2]
    assert result["metrics"]["ttft"]["note"].startswith(f"too few data to tell: only 1 of 24 hours have {MIN_PER_HOUR}+")


def test_bad_history_options_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "--db", str(tmp_path / "none.db")]) == 2
    assert "no history database" in capsys.readouterr().err
    _synthetic_db(tmp_path / "h.db", {})
    assert main(["history", "--db", str(tmp_path / "h.db"), "--channel", "nothing-like-it"]) == 2
    assert f"the database holds: {CHANNEL}" in capsys.readouterr().err
    assert main(["history", "--db", str(tmp_path / "h.db"), "--since", "yesterday"]) == 2
    assert main(["history", "--db", str(tmp_path / "h.db"), "--since", "1h"]) == 1  # the rows are from 2023
    assert "no requests in the chosen time span" in capsys.readouterr().err


def test_watch_help_says_how_to_run_it_as_a_service(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["watch", "--help"])
    text = capsys.readouterr().out
    assert "systemctl --user enable --now tokenload-watch" in text and "*/15 * * * * tokenload watch" in text


def test_a_compressed_diurnal_day_is_found_within_one_hour(diurnal_watch: DiurnalWatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's acceptance run: watch the diurnal simulator through a 48 s day (`watch_a_diurnal_day`, run
    side by side with the other long runs: tests/simfixtures.py), then `history`."""
    period, db, truth, key = diurnal_watch.period_s, diurnal_watch.db, diurnal_watch.truth, diurnal_watch.key
    out = tmp_path / "report"
    assert main(["history", "--db", str(db), "--period", f"{period:g}s", "--out", str(out), "--csv"]) == 0
    printed = capsys.readouterr().out
    result = next(iter(json.loads((out / "history.json").read_text()).values()))
    peak, off = result["metrics"]["ttft"]["peak"], result["metrics"]["ttft"]["off_peak"]
    assert peak and off, printed
    # diurnal.toml: peak 13:00-17:00 (load 2.5), off-peak 01:00-06:00 (load 0.5)
    assert abs(peak["hours"][0] - 13) <= 1 and abs(peak["hours"][-1] - 16) <= 1
    assert abs(off["hours"][0] - 1) <= 1 and abs(off["hours"][-1] - 5) <= 1
    # the heatmap shows them: its peak cells are well above its off-peak cells
    cells = np.array([[np.nan if v is None else v for v in row] for row in result["heatmap"]["ttft_p50_s"]])
    assert np.nanmedian(cells[:, 14:16]) > 2 * np.nanmedian(cells[:, 2:5])
    # the window medians against the server's truth (queue + prefill as the simulator ran them)
    served = {t["request_id"]: t["first_token"] - t["arrival"] for t in map(json.loads, truth.read_text().splitlines())}
    with closing(open_store(db)) as store:
        rows = store.query()
    for window in (peak, off):
        in_window = rows[rows["started_at"].map(lambda t: int((t + utc_offset_s(t)) % period / period * 24))
                         .isin(window["hours"]) & (rows["status"] == "ok")]
        truth_p50 = float(np.median([served[r] for r in in_window["server_request_id"]]))
        # the client's TTFT adds its own loopback and scheduling time to the server's
        assert truth_p50 - 0.002 < window["stats"]["ttft_p50_s"] < truth_p50 * 1.1 + 0.01
    assert 3.0 < result["comparison"]["ttft"]["ratio"] < 6.0  # 2.5 / 0.5 on the server, less the client's overheads
    assert f"peak window (TTFT): {peak['label']}" in printed
    # no secret in the database, the report or the export
    for path in [*db.parent.glob("h.db*"), *out.iterdir()]:
        assert key.encode() not in path.read_bytes() and key[-12:].encode() not in path.read_bytes()
    assert key not in printed


def test_window_fits_and_formula_follow_the_rows_law(tmp_path: Path) -> None:
    """TTFT = 0.2 s + 2 ms x input tokens, TPOT 10 ms, 20 tokens: the window's fit and formula errors are known."""
    from tokenload.history.report import WINDOW_HEADERS, verdict_lines, window_rows
    from tokenload.history.views import fold, window_stats

    n = np.arange(100, 1100, 10)
    ttft = 0.2 + 0.002 * n
    rows = [{"request_id": f"r{i}", "status": "ok", "started_at": _at_hour(14 + i / len(n)), "ttft_s": float(t),
             "tpot_s": 0.01, "e2e_s": float(t) + 0.01 * 19, "output_tokens": 20, "input_tokens": int(k)}
            for i, (k, t) in enumerate(zip(n, ttft))]
    with closing(open_store(tmp_path / "h.db")) as store:
        store.add_sample(Sample("s", CHANNEL, "probe", rows[0]["started_at"]), rows)
        frame = store.query()
    stats = window_stats(fold(frame), np.random.default_rng(0))
    fit = stats["ttft_vs_input"]
    assert fit["model"] == "linear" and fit["slope_s_per_token"] == pytest.approx(0.002)
    assert fit["intercept_s"] == pytest.approx(0.2) and fit["r2"] == pytest.approx(1.0)
    assert stats["formula_mape_exact"] == pytest.approx(0.0, abs=1e-9)
    simple = np.mean(0.01 / (ttft + 0.19)) * 100  # the simple form counts one TPOT too many
    assert stats["formula_mape_simple"] == pytest.approx(simple)
    assert stats["requests"] == len(n) and stats["load_error_rate"] == 0.0
    assert stats["ttft_p50_s"] == pytest.approx(float(np.median(ttft)))
    result = {"metrics": {"ttft": {"peak": {"label": "14:00-15:00", "stats": stats, "ratio": 2.0}, "off_peak": None},
                          "tpot": {"peak": None, "off_peak": None}},
              "first_at": None, "last_at": None, "requests": len(n), "samples": 1, "period_s": DAY_S, "advice": []}
    [row] = window_rows(result)
    assert row[:3] == ["peak by TTFT", "14:00-15:00", len(n)]
    assert row[-1] == "linear: 0.2 s + 2 ms/token, R2 1.00" and row[-2] == f"{simple:.1f}%"
    # The N-1 form is exact by definition (TPOT spans the first to the last token): its 0.0% is not shown.
    line = next(line for line in verdict_lines(CHANNEL, result) if line.startswith("peak window"))
    assert line.endswith(f"formula TTFT + TPOT x N off by {simple:.1f}%") and "N-1" not in line
    assert not any("N-1" in header for header in WINDOW_HEADERS)


def test_a_power_fit_says_where_its_slope_was_taken() -> None:
    """A power law's slope differs at every input length: the text names the one it was taken at."""
    from tokenload.history.report import _fit_text

    fit = {"model": "power", "intercept_s": 0.1, "slope_s_per_token": 0.0012, "r2": 0.98, "exponent": 0.7,
           "slope_at_input_tokens": 512.0}
    assert _fit_text(fit) == "power: 0.1 s + 1.2 ms/token at 512 input tokens, R2 0.98, exponent 0.70"


@pytest.mark.parametrize("worst", [0.0, 0.3])
def test_the_error_heatmap_draws_zero_as_zero(worst: float) -> None:
    """An hour without errors is drawn in the scale's lightest colour, also when no hour had any (matplotlib's
    own scale for an all-zero grid is -0.1..+0.1, which drew every zero mid-orange)."""
    import matplotlib.pyplot as plt

    from tokenload.history.report import heatmap_image

    data = np.full((7, 24), np.nan)  # hours without samples stay blank
    data[2] = data[4] = 0.0
    data[2, 5] = worst
    fig, ax = plt.subplots(figsize=(8, 3))
    image = heatmap_image(fig, ax, data, "load_error_rate")
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].astype(float) / 255

    def drawn(hour: int, day: int) -> np.ndarray:
        x, y = ax.transData.transform((hour + 0.5, day + 0.5))
        return pixels[int(round(pixels.shape[0] - y)), int(round(x))]

    lightest = np.array(image.cmap(0.0)[:3])
    assert np.abs(drawn(12, 4) - lightest).max() < 0.02, drawn(12, 4)
    if worst:
        assert drawn(5, 2).sum() < drawn(12, 4).sum() - 0.5  # an hour with errors stands out
    plt.close(fig)


def test_a_window_too_thin_to_compare_says_so() -> None:
    from tokenload.history.report import verdict_lines

    tpot = {"peak_p50_s": 0.02, "off_peak_p50_s": 0.01, "ratio": 2.0, "p_value": 0.001, "effect": 0.9,
            "n_peak": 8, "n_off_peak": 9}
    result = {"first_at": None, "last_at": None, "requests": 10, "samples": 3, "period_s": DAY_S, "advice": [],
              "metrics": {"ttft": {"peak": None, "off_peak": None}, "tpot": {"peak": None, "off_peak": None}},
              "comparison": {"ttft": None, "tpot": tpot, "e2e": None}}
    lines = verdict_lines(CHANNEL, result)
    assert "peak vs off-peak TTFT: too few successful requests in a window to compare (need 5 in each)" in lines
    assert ("peak vs off-peak TPOT p50: 0.02 s vs 0.01 s (2.00x, Mann-Whitney p=0.001, P(slower)=0.90; n=8/9)"
            in lines)


@pytest.mark.slow
def test_searched_stress_runs_put_the_capacity_of_each_window_beside_its_latency(
        demo_run: DemoRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's two real searched runs (off-peak and peak simulator) recorded on the history's channel at
    03:00 and 23:00: `history add` keeps their capacities, `history` names each window's."""
    db = tmp_path / "h.db"
    _synthetic_db(db, {h: 0.4 for h in (2, 3, 4)} | {h: 3.0 for h in (22, 23, 0)})
    found = {}
    for phase, hour in (("offpeak", 3.5), ("peak", 23.5)):
        run = tmp_path / phase
        shutil.copytree(demo_run.out / phase, run)
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["started_at"] = _at_hour(hour)  # recorded at that hour, on the synthetic history's channel
        manifest["channel"] = {**manifest["channel"], "protocol": "anthropic", "base_url": "https://relay.example/api",
                               "model": "sim-7b"}
        (run / "manifest.json").write_text(json.dumps(manifest))
        search = json.loads((run / "summary.json").read_text())["search"]
        assert search["capacity"] is not None
        found[phase] = (search["capacity"], search["interval"][1])
        assert main(["history", "add", str(run), "--db", str(db)]) == 0
    with closing(open_store(db)) as store:
        kept = store.capacities(CHANNEL)
    assert [(c.capacity, c.upper) for c in kept] == [found["offpeak"], found["peak"]]  # what each run's summary says
    out = tmp_path / "report"
    capsys.readouterr()
    assert main(["history", "--db", str(db), "--since", "100000d", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    capacity = json.loads((out / "history.json").read_text())[CHANNEL]["capacity"]
    assert [r["hour"] for r in capacity["runs"]] == [3, 23]
    assert capacity["off_peak"]["capacity"] == found["offpeak"][0] and capacity["peak"]["capacity"] == found["peak"][0]
    (off, off_hi), (peak, peak_hi) = found["offpeak"], found["peak"]
    assert (f"capacity by searched stress runs (2): off-peak (02:00-05:00): {off:g} users (boundary in "
            f"[{off:g}, {off_hi:g}]), peak (22:00-01:00): {peak:g} users (boundary in [{peak:g}, {peak_hi:g}])"
            in printed), printed
    assert f"capacity by hour of day: 03:00 {off:g} users" in printed
    assert off > peak  # the demo's peak channel is the slower one
