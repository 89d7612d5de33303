"""Locust's web UI with tokenload: honest request statistics, the tokenload tab, one run per start.

Real `tokenload run --web` (and plain `locust -f`) against the real simulator
over loopback; the browser test drives Debian's Chromium through Playwright.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from loadkit import free_port, run_command, write_scenario

from tokenload.sim import launch

CHROMIUM = Path("/usr/bin/chromium")
# Where the browser test also saves its screenshot (the README's: docs/webui-tokenload-tab.png).
SCREENSHOT_ENV = "TOKENLOAD_SCREENSHOT"
SCENARIO = """
[prompt]
tokens = 32
[output]
max_tokens = 24
ignore_eos = true
[load]
kind = "constant"
users = 4
step_s = 3
[stop]
drain_s = 2
"""


class WebRun:
    """`tokenload run --web` in the background: its URL, JSON helpers, and a Ctrl-C at the end."""

    def __init__(self, scenario: Path, base_url: str, out: Path, *extra: str) -> None:
        self.port = free_port()
        self.out = out
        command = run_command(scenario, base_url, out, "--web", "--web-port", str(self.port), *extra)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "TERM": "dumb"})
        self._lines: queue.Queue[str] = queue.Queue()
        self._stderr: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self._lines.put), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self._stderr.append), daemon=True)]
        for reader in self._readers:
            reader.start()
        try:
            self.url = self._lines.get(timeout=40).strip()
        except queue.Empty:
            self.kill()
            raise AssertionError(f"no URL on stdout; stderr: {''.join(self._stderr)}") from None

    @staticmethod
    def _read(stream: Any, put: Callable[[str], None]) -> None:
        for line in stream:
            put(line)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def start(self) -> None:
        data = urllib.parse.urlencode({"user_count": 1, "spawn_rate": 1}).encode()
        with urllib.request.urlopen(self.url + "swarm", data=data, timeout=10) as response:
            assert json.loads(response.read())["success"]

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
        """Poll the tab's data until `predicate` holds."""
        deadline = time.monotonic() + timeout
        while True:
            data = self.get("tokenload/stats.json")
            if predicate(data):
                return data
            assert time.monotonic() < deadline, data
            time.sleep(0.5)

    def stop(self) -> tuple[int, list[str], str]:
        """Ctrl-C (as a terminal would send it), then the exit code, stdout lines and stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        for reader in self._readers:
            reader.join(timeout=10)
        lines = []
        while not self._lines.empty():
            lines.append(self._lines.get().strip())
        return self.proc.returncode, [self.url, *lines], "".join(self._stderr)

    def kill(self) -> None:
        """After a failed test: Ctrl-C (so `tokenload run` stops Locust, which runs in a session of its own)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGINT)  # a second Ctrl-C kills Locust's process group
                self.proc.wait(timeout=30)


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hexport = fields[1].rsplit(":", 1)
            if int(hexport, 16) == port and fields[3] == "0A":  # TCP_LISTEN
                found.add(address)
    return found


def _done(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda d: len(d["runs"]) >= n and d["runs"][n - 1]["state"] == "done"


def _parquet_rps(run_dir: Path) -> tuple[pd.DataFrame, float]:
    df = pd.read_parquet(run_dir / "requests.parquet")
    return df, len(df) / (df.finished_at.max() - df.started_at.min())


def test_web_run_counts_real_requests_and_each_start_is_a_run(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, SCENARIO)
    out = tmp_path / "run"
    with launch() as sim:
        web = WebRun(scenario, sim.base_url, out)
        try:
            assert web.url == f"http://127.0.0.1:{web.port}/"
            if Path("/proc/net/tcp").exists():
                assert _listening(web.port) == {"0100007F"}  # 127.0.0.1 only, never 0.0.0.0
            web.wait(lambda d: d["summary"]["requests"] > 0)
            live = web.get("stats/requests")
            # One Locust request per LLM request: no TTFT/TPOT/E2E pseudo-requests beside the POST row.
            assert {(s["method"], s["name"]) for s in live["stats"]} == {("POST", "sim-7b"), ("", "Aggregated")}
            tab = next(e for e in live["extended_stats"] if e["key"] == "tokenload")
            assert tab["data"][-1]["name"] == "Aggregated" and tab["data"][-1]["requests"] > 0
            first = web.wait(_done(1))
            locust_rps = web.get("stats/requests")["total_rps"]
            tab_ttft_p50 = first["summary"]["ttft_p50_s"]
            csv = urllib.request.urlopen(web.url + "tokenload/stats.csv", timeout=10).read().decode()
            web.start()  # a second test from the UI: a run of its own
            second = web.wait(_done(2))
            rc, stdout, stderr = web.stop()
        finally:
            web.kill()
    assert rc == 0, stderr
    assert "Ctrl-C" in stderr
    run1, run2 = out, tmp_path / "run-2"
    assert stdout[-2:] == [str(run1), str(run2)]
    df1, rps1 = _parquet_rps(run1)
    assert locust_rps == pytest.approx(rps1, rel=0.05)
    summary1 = json.loads((run1 / "summary.json").read_text())
    assert tab_ttft_p50 == pytest.approx(summary1["steps"][0]["ttft_p50_s"], rel=0.10)
    assert first["summary"]["requests"] == len(df1)
    aggregated = next(line for line in csv.splitlines() if line.startswith("Aggregated"))
    assert aggregated.split(",")[2] == str(len(df1))
    df2 = pd.read_parquet(run2 / "requests.parquet")
    runs = second["runs"]
    assert [r["run_dir"] for r in runs] == [str(run1), str(run2)] and runs[0]["run_id"] != runs[1]["run_id"]
    assert set(df1.run_id) == {runs[0]["run_id"]} and set(df2.run_id) == {runs[1]["run_id"]}
    assert df1.finished_at.max() < df2.started_at.min()  # no request of one test in the other's run
    assert second["summary"]["requests"] == len(df2)
    for run_dir in (run1, run2):  # analysed separately: one 3 s step each, not a step spanning both tests
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["stop_reason"] == "plan complete"
        steps = json.loads((run_dir / "summary.json").read_text())["steps"]
        assert len(steps) == 1 and steps[0]["requests"] == len(pd.read_parquet(run_dir / "requests.parquet"))
        assert (run_dir / "report.html").is_file()


def test_master_and_two_workers_merge_their_token_stats(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, SCENARIO)
    out = tmp_path / "run"
    with launch() as sim:
        web = WebRun(scenario, sim.base_url, out, "--processes", "2")
        try:
            first = web.wait(_done(1), timeout=90)
            web.start()  # the workers switch to the second run's directory too
            second = web.wait(_done(2), timeout=90)
            rc, _, stderr = web.stop()
        finally:
            web.kill()
    assert rc == 0, stderr
    for data, run_dir in ((first, out), (second, tmp_path / "run-2")):
        df = pd.read_parquet(run_dir / "requests.parquet")
        assert df.worker.nunique() == 2 and set(df.run_id) == {data["run"]["run_id"]}
        summary = data["summary"]
        assert summary["requests"] == len(df)  # every worker's requests, none twice
        assert summary["output_tokens"] == df.output_tokens.sum()
        assert summary["ttft_p50_s"] == pytest.approx(float(np.percentile(df.ttft_s.dropna(), 50)), rel=0.10)
        assert data["rows"][-1]["name"] == "Aggregated" and data["rows"][-1]["requests"] == len(df)


def test_headless_locust_csv_has_the_token_statistics(tmp_path: Path) -> None:
    """Plain `locust --headless --processes 2 --csv PREFIX`: Locust's stats count requests only,
    PREFIX_tokenload.csv has the token statistics, and the workers (no --run-dir of their own)
    write into the master's run directory."""
    scenario = write_scenario(tmp_path, SCENARIO)
    prefix = tmp_path / "csv" / "out"
    with launch() as sim:
        from tokenload.load.runner import locustfile

        result = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(locustfile()), "--headless", "--scenario", str(scenario),
             "--host", sim.base_url, "--run-dir", str(tmp_path / "run"), "--csv", str(prefix), "--processes", "2"],
            check=False, capture_output=True, text=True, timeout=90, cwd=tmp_path,
            env={**os.environ, "ANTHROPIC_MODEL": "sim-7b"})
    assert result.returncode == 0, result.stderr[-2000:]
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert df.worker.nunique() == 2 and not (tmp_path / "segments").exists()
    stats = pd.read_csv(f"{prefix}_stats.csv")
    # Locust rewrites its CSV once a second and not at exit, from its workers' reports (every 3 s): it may miss
    # the last seconds' requests, on a busy machine all of them (no row but the aggregate, a CI run). What
    # it has are requests, never our token statistics.
    assert set(stats["Type"].dropna()) <= {"POST"}
    assert 0 <= int(stats.loc[stats.Name == "Aggregated", "Request Count"].iloc[0]) <= len(df)
    tokens = pd.read_csv(f"{prefix}_tokenload.csv")
    agg = tokens[tokens.Step == "Aggregated"].iloc[0]
    # Like Locust's own, the master's view misses what workers finish after they were told to quit
    # (Locust waits 0.5 s for their last report); requests.parquet has every request.
    assert 0.5 * len(df) < agg["Request Count"] <= len(df)
    # Its median is of the requests it saw: between the order statistics of all of them that the ones it missed
    # allow (a busy machine's last requests, slower, missed: 0.068 s where all read 0.090), give or take 10%.
    ttfts = np.sort(df.ttft_s.dropna().to_numpy())
    seen = min(int(agg["Request Count"]), len(ttfts))
    middle = (seen - 1) / 2
    low, high = ttfts[math.floor(middle)], ttfts[min(len(ttfts) - 1, math.ceil(middle) + len(ttfts) - seen)]
    assert 0.9 * low <= agg["TTFT 50% (ms)"] / 1000 <= 1.1 * high, (low, high, seen, len(ttfts))


@pytest.mark.slow
def test_plain_locust_says_why_it_stopped_and_rates_span_the_run(tmp_path: Path) -> None:
    """Plain `locust -f` with a model the channel does not serve: the fail-fast reason is an ERROR line of
    Locust's log (it reached only manifest.json), its fix names what plain Locust can set (the variable that
    set the model, not tokenload's `--model`), and PREFIX_tokenload.csv's rates are over the step's wall time
    (5 failures within milliseconds read 845 req/s)."""
    scenario = write_scenario(tmp_path, SCENARIO.replace("step_s = 3", "step_s = 30"))
    prefix = tmp_path / "lc"
    with launch() as sim:
        from tokenload.load.runner import locustfile

        result = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(locustfile()), "--headless", "--scenario", str(scenario),
             "--host", sim.base_url, "--run-dir", str(tmp_path / "run"), "--csv", str(prefix)],
            check=False, capture_output=True, text=True, timeout=90, cwd=tmp_path,
            env={**os.environ, "ANTHROPIC_MODEL": "claude-sonnet-4"})
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    reason = manifest["stop_reason"]
    assert reason.startswith("channel misconfigured") and "fix: set ANTHROPIC_MODEL to " in reason, reason
    assert "--model" not in reason
    errors = [line for line in result.stderr.splitlines() if "/ERROR/" in line]
    assert any(line.endswith(reason) for line in errors), result.stderr[-3000:]
    agg = pd.read_csv(f"{prefix}_tokenload.csv").set_index("Step").loc["Aggregated"]
    [step] = manifest["steps"]
    elapsed = step["ended_at"] - step["started_at"]
    assert agg["Request Count"] == agg["Failure Count"] == len(pd.read_parquet(tmp_path / "run" / "requests.parquet"))
    assert agg["Requests/s"] == pytest.approx(agg["Request Count"] / elapsed, rel=0.2), (agg["Requests/s"], elapsed)


def _chromium_reason() -> str | None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if not CHROMIUM.exists() and not shutil.which("chromium"):
        return "Debian's chromium is not installed (apt-get install -y chromium; .ci/run does it where apt works)"
    return None


LIVE_MIN_REQUESTS = 40


@pytest.mark.skipif(_chromium_reason() is not None, reason=str(_chromium_reason()))
def test_browser_sees_live_token_stats_and_two_runs(tmp_path: Path) -> None:
    """Headless Chromium: start, the tokenload tab's live TTFT/TPOT match the records, stop, start again."""
    from playwright.sync_api import sync_playwright

    scenario = write_scenario(tmp_path, SCENARIO.replace("step_s = 3", "step_s = 40"))
    out = tmp_path / "run"
    with launch() as sim, sync_playwright() as pw:
        web = WebRun(scenario, sim.base_url, out)
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(web.url + "?tab=tokenload")
            aggregated = page.get_by_role("row").filter(has_text="Aggregated").last
            aggregated.wait_for(timeout=30_000)
            # Enough finished requests that the median does not hinge on which few the tab had seen.
            deadline = time.monotonic() + 60
            while int((cells := aggregated.get_by_role("cell").all_inner_texts())[2]) < LIVE_MIN_REQUESTS:
                assert time.monotonic() < deadline, cells
                time.sleep(0.5)
            page.wait_for_function("document.querySelector('#tokenload-run')?.dataset.ttftP50S > 0", timeout=30_000)
            live_requests = int(cells[2])
            live_ttft_ms, live_tpot_ms = (float(cells[i].split(" / ")[0]) for i in (5, 6))
            page.wait_for_selector("#tokenload-chart-ttft polyline", state="attached")
            web.wait(lambda d: len(d["series"]["t"]) >= 4)  # a few points on the charts over time
            page.get_by_role("button", name="Stop").click()
            web.wait(_done(1))
            page.wait_for_selector("#tokenload-runs a[href$='runs/1/report.html']", timeout=30_000)
            shot = page.screenshot(full_page=True, type="png")
            if os.environ.get(SCREENSHOT_ENV):
                Path(os.environ[SCREENSHOT_ENV]).write_bytes(shot)
            page.get_by_role("button", name="New").click()
            page.get_by_role("button", name="Start").click()
            web.wait(lambda d: len(d["runs"]) == 2 and d["summary"]["requests"] > 0)
            page.get_by_role("button", name="Stop").click()
            web.wait(_done(2))
            rc, stdout, stderr = web.stop()
        finally:
            browser.close()
            web.kill()
    assert rc == 0, stderr
    assert shot.startswith(b"\x89PNG") and len(shot) > 20_000
    df = pd.read_parquet(out / "requests.parquet")
    assert live_requests <= len(df)
    seen = df.nsmallest(live_requests, "finished_at")  # the requests the tab had seen when it was read
    assert live_ttft_ms / 1000 == pytest.approx(float(np.percentile(seen.ttft_s, 50)), rel=0.10, abs=0.002)
    assert live_tpot_ms / 1000 == pytest.approx(float(np.percentile(seen.tpot_s, 50)), rel=0.10, abs=0.002)
    assert (tmp_path / "run-2" / "requests.parquet").is_file() and stdout[-2:] == [str(out), str(tmp_path / "run-2")]


def test_tokenload_options_are_documented_where_locust_help_cannot_show_them() -> None:
    """Locust prints `--help` before it loads a locustfile: the locustfile's docstring and docs/locust.md list them."""
    from tokenload.load.runner import locustfile

    probe = ("import tokenload.load.plugin\n"
             "from locust.argument_parser import get_parser\n"
             "group = next(g for g in get_parser()._action_groups if g.title == 'tokenload')\n"
             "print(' '.join(a.option_strings[0] for a in group._group_actions))\n")
    ours = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                          timeout=60).stdout.split()
    assert ours == ["--scenario", "--run-dir", "--run-id"]
    shown = subprocess.run([sys.executable, "-m", "locust", "-f", str(locustfile()), "--help"], check=False,
                           capture_output=True, text=True, timeout=60).stdout
    assert "--headless" in shown
    docstring = locustfile().read_text()
    readme = (Path(__file__).resolve().parent.parent / "docs" / "locust.md").read_text()
    for option in ours:
        if option not in shown:
            assert option in docstring and f"`{option}" in readme, option
