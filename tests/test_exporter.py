"""`--prometheus-port`: live metrics scraped over HTTP during a real run (and a watch), checked against the records.

A real simulator with a share of faults (500s: errors without a TTFT; cut streams: errors with one), a real
`tokenload run` in a child process, `/metrics` fetched over loopback and parsed with prometheus_client's
own parser; at the end every count must equal requests.parquet's (or the history database's).
"""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from loadkit import free_port, run_command, write_scenario

from tokenload.exporter import TTFT_BUCKETS, LiveMetrics
from tokenload.sim import launch

FAULTS = 'extends = "fast"\n[faults]\n"status code=500 body=json" = 0.15\n"disconnect after=2" = 0.1\n'


def scrape(port: int) -> list[Any]:
    """Every sample on http://127.0.0.1:PORT/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: list[Any], name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def scrape_when(port: int, ready: Any, timeout_s: float = 60.0) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            samples = scrape(port)
            if ready(samples):
                return samples
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"no scrape of port {port} met the condition in {timeout_s:g} s")


def assert_matches(samples: list[Any], df: pd.DataFrame, run_id: str) -> None:
    """Counts, buckets and sums of the scrape equal the records'."""
    ttft = df.ttft_s.dropna().to_numpy()  # the record's definition: a request got a first token
    assert value(samples, "tokenload_ttft_seconds_count", run_id=run_id) == len(ttft) > 0
    for bound in TTFT_BUCKETS:
        assert value(samples, "tokenload_ttft_seconds_bucket", run_id=run_id, le=str(float(bound))) == \
            int((ttft <= bound).sum())
    assert value(samples, "tokenload_ttft_seconds_bucket", run_id=run_id, le="+Inf") == len(ttft)
    assert value(samples, "tokenload_ttft_seconds_sum", run_id=run_id) == pytest.approx(ttft.sum())
    for column, name in (("tpot_s", "tpot"), ("itl_p50_s", "itl"), ("e2e_s", "e2e")):
        assert value(samples, f"tokenload_{name}_seconds_count", run_id=run_id) == df[column].notna().sum()
    by_status = Counter(zip(df.status, df.error_kind.fillna("")))
    scraped: Counter[tuple[str, str]] = Counter()
    for s in samples:  # summed over the steps
        if s.name == "tokenload_requests_total" and s.labels["run_id"] == run_id:
            scraped[s.labels["status"], s.labels["error_kind"]] += int(s.value)
    assert scraped == by_status
    assert value(samples, "tokenload_output_tokens_total", run_id=run_id) == df.output_tokens.sum()


@pytest.mark.slow
def test_run_metrics_during_and_at_the_end_equal_the_records(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 32
[output]
max_tokens = 10
[load]
kind = "steps"
users = [2, 4]
step_s = 3
[stop]
drain_s = 3
""")
    (tmp_path / "profile.toml").write_text(FAULTS)
    port = free_port()
    with launch(["--profile", str(tmp_path / "profile.toml")]) as sim:
        proc = subprocess.Popen(run_command(scenario, sim.base_url, tmp_path / "run", "--prometheus-port", str(port)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "TERM": "dumb"})
        try:
            during = scrape_when(port, lambda s: value(s, "tokenload_active_users") > 0
                                 and value(s, "tokenload_ttft_seconds_count") > 0)
            assert proc.poll() is None  # scraped while the run goes
            assert proc.stdout is not None
            run_dir = Path(proc.stdout.readline().strip())  # printed before the exporter lingers for a last scrape
            end = scrape(port)
            _out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    df = pd.read_parquet(run_dir / "requests.parquet")
    run_id = df.run_id.iloc[0]
    assert df.run_id.nunique() == 1
    assert value(during, "tokenload_ttft_seconds_count", run_id=run_id) < len(df.ttft_s.dropna())
    assert_matches(end, df, run_id)
    assert set(df.status) >= {"ok", "error"} and df[df.status == "error"].ttft_s.notna().any()  # both kinds of error
    assert {s.labels["step"] for s in end if s.name == "tokenload_requests_total"} == {str(s) for s in df.step} \
        == {"1", "2"}
    assert value(end, "tokenload_active_users", run_id=run_id) == 0
    assert "until scraped once more" in err


@pytest.mark.slow
def test_a_master_exports_its_workers_records(tmp_path: Path) -> None:
    """`--master --prometheus-port` and a `--worker` with a directory of its own (two processes on loopback): the
    worker's records, which reach the master over Locust's messages, count."""
    scenario = write_scenario(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 8
[load]
kind = "constant"
users = 3
step_s = 3
[stop]
drain_s = 3
""")
    port, master_port = free_port(), str(free_port())
    out = tmp_path / "run"
    with launch(["--profile", "fast"]) as sim:
        master = subprocess.Popen(run_command(scenario, sim.base_url, out, "--master", "--master-port", master_port,
                                              "--prometheus-port", str(port)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            worker = subprocess.run(run_command(scenario, sim.base_url, tmp_path / "worker", "--worker", "--master-port",
                                                master_port),
                                    capture_output=True, text=True, timeout=60)
            assert master.stdout is not None
            assert Path(master.stdout.readline().strip()) == out
            end = scrape(port)
            _out, err = master.communicate(timeout=30)
        finally:
            master.kill()
    assert worker.returncode == 0 and master.returncode == 0, err
    df = pd.read_parquet(out / "requests.parquet")
    assert df.worker.nunique() == 1 and df.worker.iloc[0] != "local"
    assert_matches(end, df, df.run_id.iloc[0])


@pytest.mark.slow
def test_watch_metrics_equal_the_history_rows(tmp_path: Path) -> None:
    (tmp_path / "profile.toml").write_text(FAULTS)
    port = free_port()
    db = tmp_path / "history.db"
    with launch(["--profile", str(tmp_path / "profile.toml")]) as sim:
        proc = subprocess.Popen([sys.executable, "-m", "tokenload", "watch", "--base-url", sim.base_url, "--model",
                                 "sim-7b", "--db", str(db), "--every", "1s", "--samples", "4", "--requests", "3",
                                 "--prometheus-port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:  # the samples are done and committed when it says so
                if "sample(s) taken" in line:
                    break
            end = scrape(port)
            proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0
    with sqlite3.connect(db) as con:
        df = pd.read_sql_query("SELECT * FROM requests", con)
    assert len(df) >= 4
    assert_matches(end, df, "watch")


def test_a_scrape_after_the_end_but_before_the_linger_is_the_final_one() -> None:
    """The watch said its samples were taken and a scraper read the numbers before the command began to linger:
    that scrape read the final numbers, so the linger ends at once (it waited its whole 30 s for another)."""
    metrics = LiveMetrics("r").serve("127.0.0.1", 0)
    try:
        metrics.seal()
        scrape(metrics.port)
        assert metrics.linger(5.0)
        unsealed = LiveMetrics("s").serve("127.0.0.1", 0)
        try:
            assert not unsealed.linger(0.2)  # no scrape since: the numbers were not read
        finally:
            unsealed.close()
    finally:
        metrics.close()


class _Gate(Collector):
    """A collector that holds the page being made until the test opens it."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # registering asks this, not `collect`, which would wait for the gate

    def collect(self) -> Iterator[Metric]:
        self.open.wait(10)
        return iter(())


def test_the_linger_ends_only_once_the_scrapers_page_is_written() -> None:
    """The command exits as soon as its linger ends, so the scrape that ends it must have its page by then: counted
    when the registry was read, it let a watch exit mid-page and its scraper read headers with an empty page."""
    metrics = LiveMetrics("r").serve("127.0.0.1", 0)
    gate = _Gate()
    metrics.registry.register(gate)  # read after every tokenload metric: the page is held, not the reading
    try:
        metrics.observe([{"status": "ok", "step": 1, "output_tokens": 3, "ttft_s": 0.1}])
        metrics.seal()
        with ThreadPoolExecutor(1) as pool:
            page = pool.submit(scrape, metrics.port)
            assert not metrics.linger(1.0)  # read but not written: not answered yet
            gate.open.set()
            assert metrics.linger(10.0)
            assert value(page.result(timeout=10), "tokenload_ttft_seconds_count", run_id="r") == 1
    finally:
        gate.open.set()
        metrics.close()


def test_a_port_in_use_is_one_line_before_any_load(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, "[load]\nkind = \"constant\"\nusers = 1\nstep_s = 1\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Nothing listens on port 9: any request sent would fail, but none may be sent (the port check comes first).
        result = subprocess.run(run_command(scenario, "http://127.0.0.1:9/api", tmp_path / "run",
                                            "--prometheus-port", str(port)),
                                capture_output=True, text=True, timeout=60)
        watch = subprocess.run([sys.executable, "-m", "tokenload", "watch", "--base-url", "http://127.0.0.1:9/api",
                                "--db", str(tmp_path / "h.db"), "--prometheus-port", str(port)],
                               capture_output=True, text=True, timeout=60)
    for res in (result, watch):
        assert res.returncode == 2
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        assert f"--prometheus-port {port}" in res.stderr
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "h.db").exists()


def test_bucket_counts_are_cumulative_like_the_records() -> None:
    """The exporter alone, fed rows, no HTTP: a NaN (Arrow null read through pandas) is not an observation."""
    from prometheus_client import generate_latest

    from tokenload.exporter import LiveMetrics

    metrics = LiveMetrics("r1")
    rows = [{"status": "ok", "error_kind": None, "step": 0, "output_tokens": 5, "ttft_s": t, "tpot_s": 0.01,
             "itl_p50_s": 0.01, "e2e_s": 1.0} for t in (0.04, 0.2, 0.2, 9.0)]
    rows.append({"status": "error", "error_kind": "server_error", "step": 1, "output_tokens": 0, "ttft_s": np.nan,
                 "tpot_s": None, "itl_p50_s": None, "e2e_s": None})
    assert metrics.observe(rows) == 5
    samples = [s for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples]
    assert value(samples, "tokenload_ttft_seconds_count") == 4
    assert value(samples, "tokenload_ttft_seconds_bucket", le="0.2") == 3
    assert value(samples, "tokenload_ttft_seconds_bucket", le="7.5") == 3
    assert value(samples, "tokenload_requests_total", status="error", error_kind="server_error", step="1") == 1
    assert value(samples, "tokenload_output_tokens_total") == 20
