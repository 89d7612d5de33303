"""The simulator's day: `load_by_hour`, `time_scale` and `day_phase_h`, checked against measured TTFT."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from simfixtures import worst_lateness_s

from tokenload.channel import Channel
from tokenload.cli import main
from tokenload.dayclock import DAY_S, day_hour, utc_offset_s
from tokenload.errors import ConfigError
from tokenload.sim import load_profile, serve_in_thread
from tokenload.sim.profile import load_at, with_overrides
from tokenload.transport.httpx_client import stream_once

DIURNAL = load_profile("diurnal")


def _at_hour(hour: float, period_s: float) -> float:
    """A unix time whose folded local hour is `hour` for a day of `period_s`."""
    t = 1_800_000_000.0
    t -= (t + utc_offset_s(t)) % period_s  # start of a (compressed) local day
    return t + hour / 24 * period_s


def test_the_diurnal_curve_defines_off_peak_and_peak_windows() -> None:
    assert [h for h in range(24) if DIURNAL.load_by_hour[h] < 1] == [1, 2, 3, 4, 5]
    assert [h for h in range(24) if DIURNAL.load_by_hour[h] > 1] == [13, 14, 15, 16]
    for scale in (1.0, 360.0):
        profile = with_overrides(DIURNAL, time_scale=scale)
        period = DAY_S / scale
        assert load_at(profile, _at_hour(3.5, period)) == 0.5
        assert load_at(profile, _at_hour(14.5, period)) == 2.5
        assert load_at(profile, _at_hour(20.5, period)) == 1.0
        assert day_hour(_at_hour(14.5, period), period) == pytest.approx(14.5)
    shifted = with_overrides(DIURNAL, time_scale=360.0, day_phase_h=12.0)
    assert load_at(shifted, _at_hour(2.5, 240.0)) == 2.5  # 02:30 + 12 h = 14:30
    assert load_at(load_profile("default"), _at_hour(14.5, DAY_S)) == 1.0


@pytest.mark.parametrize("bad", [[1.0] * 23, [1.0] * 23 + [0.0], ["x"] * 24])
def test_a_bad_curve_is_refused(bad: list) -> None:
    with pytest.raises(ConfigError, match="load_by_hour"):
        with_overrides(DIURNAL, load_by_hour=bad)


def test_sim_flags_are_validated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--profile", "diurnal", "--time-scale", "0"]) == 2
    assert "time_scale: must be >= 0.001" in capsys.readouterr().err
    assert main(["sim", "--profile", "diurnal", "--day-phase", "25"]) == 2


def _ttft_now(hour: float, truth: Path) -> tuple[float, float, float]:
    """Median TTFT measured, and by the server's truth, of 5 requests while the simulated clock stands at `hour`;
    and how late the simulator wrote its latest token meanwhile."""
    scale = 0.001  # a day of 1,000 real days: the hour does not move during the test
    base = day_hour(time.time(), DAY_S / scale)
    with serve_in_thread("diurnal", time_scale=scale, day_phase_h=(hour - base) % 24, noise=0.0, truth_path=truth,
                         prefill_base_s=0.04, prefill_per_token_s=0.0, decode_base_s=0.002) as sim:
        channel = Channel(base_url=sim.base_url, model="sim-7b")
        measured = sorted(stream_once(channel, "hello " * 20, 4)["ttft_s"] for _ in range(5))
    served = sorted(t["first_token"] - t["arrival"] for t in map(json.loads, truth.read_text().splitlines()))
    return measured[2], served[2], worst_lateness_s(sim)


def test_ttft_follows_the_hour_of_the_simulated_day(tmp_path: Path) -> None:
    """The server's own TTFT is the prefill times the hour's load, within 4 ms and what the simulator's own
    lateness added (a busy machine wrote an off-peak first token 35 ms late)."""
    off_peak, normal, peak = (_ttft_now(h, tmp_path / f"{h}.jsonl") for h in (3.5, 9.5, 14.5))
    # prefill 0.04 s x load: 0.02 s, 0.04 s, 0.10 s, exactly on the server's side
    for (_, served, late), expected in zip((off_peak, normal, peak), (0.02, 0.04, 0.10)):
        assert expected - 0.004 < served < expected + 0.004 + late, (served, expected, late)
    assert off_peak[0] < normal[0] < peak[0]  # and the client sees the same order
