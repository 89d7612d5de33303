"""The breakpoint search end to end: real Locust against an independent server whose capacity is known.

The server has 8 batch slots, TTFT 0.2 s + 0.5 ms per prompt token, TPOT 20 ms;
64-token prompts and 32 output tokens; the SLO is TTFT <= 0.5 s for 90% of
requests. Up to 8 users never queue (TTFT 0.232 s); from 9 on, requests wait
for a slot and TTFTs past 0.5 s appear. So the capacity is 8 (the issue allows
8 to 10) and the first failing level 9 to 12.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from loadkit import run_cli, write_scenario
from slotserver import SlotServer

pytestmark = pytest.mark.slow

SCENARIO = """
name = "search-slots"
[prompt]
tokens = 64
[output]
max_tokens = 32
[load]
kind = "search"
min = {min}
max = 32
max_probe_s = 20
probe_warmup_s = 1
[slo]
ttft_s = 0.5
target = 0.9
"""


def searched(tmp_path: Path, server: SlotServer, low: int) -> tuple[dict, pd.DataFrame]:
    out = tmp_path / "run"
    proc = run_cli(write_scenario(tmp_path, SCENARIO.format(min=low)), server.url + "/v1", out,
                   "--protocol", "openai-chat", model="gpt-test", timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    analysed = run_cli_analyze(out)
    assert analysed.returncode == 0, analysed.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    return summary, pd.read_parquet(out / "requests.parquet")


def run_cli_analyze(out: Path):  # type: ignore[no-untyped-def]
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(out)], capture_output=True, text=True,
                          timeout=120)


def test_the_search_finds_an_eight_slot_servers_capacity(tmp_path: Path) -> None:
    server = SlotServer(slots=8, ttft_base_s=0.2, ttft_per_token_s=0.0005, tpot_s=0.02)
    try:
        summary, df = searched(tmp_path, server, low=2)
    finally:
        server.close()
    s = summary["search"]
    assert s["over"] == "users"
    assert 8 <= s["capacity"] <= 10, s["verdict"]
    assert 9 <= s["first_failing"] <= 12, s["verdict"]
    assert len(s["probes"]) <= 10
    assert s["interval"][0] == s["capacity"] < s["interval"][1] <= s["first_failing"]
    assert s["binding"] == "ttft"
    assert s["verdict"].startswith(f"capacity {s['capacity']} users ({s['first_failing']} fails: TTFT p90")
    # the boundary level was held twice and passed twice
    assert [p["verdict"] for p in s["probes"] if p["level"] == s["capacity"]] == ["pass", "pass"]
    # every probe's numbers are its records' truth: n and attainment recounted from requests.parquet
    for p in s["probes"]:
        rows = df[(df["step"] == p["step"]) & (df["phase"] == "measure") & (df["status"] == "ok")]
        assert p["n"] == len(rows)
        assert p["attainment"] == pytest.approx((rows["ttft_s"] <= 0.5).mean())
        assert p["tokens"] <= int(df.loc[df["step"] == p["step"], ["input_tokens", "output_tokens"]].sum().sum())
    assert s["tokens"] == sum(p["tokens"] for p in s["probes"])
    assert server.max_busy <= 8
    assert (tmp_path / "run" / "plots" / "capacity.png").is_file()


def test_a_server_too_slow_for_the_lowest_level_has_its_capacity_below_the_range(tmp_path: Path) -> None:
    server = SlotServer(slots=8, ttft_base_s=0.8, ttft_per_token_s=0.0, tpot_s=0.005)
    try:
        summary, _ = searched(tmp_path, server, low=2)
    finally:
        server.close()
    s = summary["search"]
    assert s["capacity"] is None and s["below_range"] and s["first_failing"] == 2
    assert [p["verdict"] for p in s["probes"]] == ["fail"]
    assert "capacity below 2 users" in s["verdict"]
