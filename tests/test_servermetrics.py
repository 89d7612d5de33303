"""Server metrics: the vocabulary, the per-window numbers, scraping over loopback HTTP, and a whole run
against an independent 4-slot server whose truth is known (tests/gaugeserver.py)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from gaugeserver import GaugeServer

from fakeserver import FakeServer, body_script
from loadkit import run_cli, write_scenario

from tokenload.errors import ConfigError
from tokenload.load import records
from tokenload.rundir import MANIFEST_FILE, SERVER_METRICS_FILE
from tokenload.servermetrics import scrape, series
from tokenload.servermetrics.vocabulary import NAMES, TERMS, lookup, servers
from tokenload.workload.scenario import Scenario

# Exposition texts in each server's own shape (names, label sets, counter/histogram forms as they publish them).
VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="m"} 4.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 5.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 5.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.5
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 6.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.28
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 7.557572e+06
"""
LLAMACPP = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 440
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 960
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.5
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 6.25
"""
TGI = """# TYPE tgi_queue_size gauge
tgi_queue_size 5
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 8
# TYPE tgi_request_queue_duration histogram
tgi_request_queue_duration_bucket{le="0.1"} 2
tgi_request_queue_duration_bucket{le="+Inf"} 3
tgi_request_queue_duration_sum 0.4
tgi_request_queue_duration_count 3
# TYPE tgi_request_input_length histogram
tgi_request_input_length_bucket{le="+Inf"} 3
tgi_request_input_length_sum 300
tgi_request_input_length_count 3
"""


def _terms(text: str) -> dict[str, float]:
    """term -> value of the non-histogram samples of one exposition text."""
    out: dict[str, float] = {}
    for name, _, value in scrape.parse(text):
        hit = lookup(name)
        if hit and hit[1] == "value":
            out[hit[0]] = value
    return out


def test_each_servers_names_map_onto_one_vocabulary() -> None:
    assert _terms(VLLM) == {"running": 3.0, "waiting": 2.0, "kv_cache_usage": 0.42, "prompt_tokens": 1200.0}
    assert _terms(SGLANG) == {"running": 6.0, "waiting": 1.0, "kv_cache_usage": 0.28, "generation_tokens": 7.557572e6}
    assert _terms(LLAMACPP) == {"running": 4, "waiting": 3, "kv_cache_usage": 0.5, "prompt_tokens": 440,
                                "generation_tokens": 960, "prefill_seconds": 6.25}
    assert _terms(TGI) == {"running": 8, "waiting": 5, "prompt_tokens": 300}
    # histogram parts map (the _sum gives a mean), the _created timestamps do not; unknown families are not
    assert lookup("vllm:request_queue_time_seconds_bucket") == ("queue_time", "bucket")
    assert lookup("vllm:request_queue_time_seconds_sum") == ("queue_time", "sum")
    assert lookup("vllm:prompt_tokens_created") is None and lookup("python_gc_objects_collected_total") is None
    assert lookup("vllm:gpu_cache_usage_perc") == ("kv_cache_usage", "value")
    assert all(term in TERMS for term, _ in NAMES.values())
    assert servers({n for n, _, _ in scrape.parse(VLLM + TGI)}) == ["TGI", "vLLM"]


def test_the_docs_table_lists_every_mapped_name() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "server-metrics.md").read_text(encoding="utf-8")
    missing = [name for name in NAMES if f"`{name}`" not in doc]
    assert not missing, f"docs/server-metrics.md does not list {missing}"


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    bounds = np.array([0.1, 0.5, 1.0, np.inf])
    # 10 observations: 2 <= 0.1, 6 in (0.1, 0.5], 2 in (0.5, 1.0]
    assert series.quantile(bounds, np.array([2.0, 8.0, 10.0, 10.0]), 0.5) == pytest.approx((0.1 + 0.4 * 0.5, 10, 0.1, 0.5))
    # in +Inf: the last finite bound, a lower bound
    assert series.quantile(bounds, np.array([0.0, 0.0, 0.0, 4.0]), 0.5) == (1.0, 4, 1.0, np.inf)
    assert series.quantile(bounds, np.zeros(4), 0.5) is None


def _frame(rows: list[tuple[float, str, str, float]]) -> pd.DataFrame:
    raw = pd.DataFrame(rows, columns=["time", "name", "labels", "value"]).assign(source="s")
    return series.mapped(raw)


def test_windows_take_gauge_means_counter_deltas_and_bucket_deltas() -> None:
    rows = []
    for t in range(10):  # running 1 for t < 5 then 3; a counter +10/s reset to 0 at t = 6; a histogram growing
        rows.append((float(t), "vllm:num_requests_running", '{"model_name":"a"}', 1.0 if t < 5 else 3.0))
        rows.append((float(t), "vllm:num_requests_running", '{"model_name":"b"}', 1.0))
        rows.append((float(t), "vllm:generation_tokens_total", "{}", 10.0 * t if t < 6 else 10.0 * (t - 6)))
        rows.append((float(t), "vllm:request_queue_time_seconds_bucket", '{"le":"0.1"}', float(t)))
        rows.append((float(t), "vllm:request_queue_time_seconds_bucket", '{"le":"1"}', 3.0 * t))
        rows.append((float(t), "vllm:request_queue_time_seconds_bucket", '{"le":"+Inf"}', 3.0 * t))
    df = _frame(rows)
    assert series.window_gauge(df, "running", 0, 5) == (2.0, 2.0, 5)  # two models' series add up
    assert series.window_gauge(df, "running", 5, 10) == (4.0, 4.0, 5)
    assert series.window_gauge(df, "running", 20, 30) is None
    assert series.window_rate(df, "generation_tokens", 0, 4) == pytest.approx(10.0)
    assert series.window_rate(df, "generation_tokens", 4, 8) == pytest.approx(20 / 4)  # 40 -> 50, reset, 0 -> 20
    # from t=2 to t=8: 6 more <= 0.1, 12 more in (0.1, 1]: the median (rank 9) sits 3/12 into (0.1, 1]
    assert series.window_quantile(df, "queue_time", 2, 8, 0.5) == pytest.approx((0.1 + 0.9 * 3 / 12, 18, 0.1, 1.0))


def test_origin_metrics_are_found_and_a_relays_404_is_a_note(fake_server: FakeServer) -> None:
    fake_server.route(lambda r: body_script(200, VLLM.encode(), "text/plain; version=0.0.4")
                      if r.path == "/metrics" else body_script(404, b"nope"))
    found = scrape.resolve([], fake_server.url + "/api/v1", interval_s=0.5)
    assert found.urls == [fake_server.url + "/metrics"] and found.found == ["vLLM"] and found.note is None
    assert fake_server.requests[-1].path == "/metrics" and "authorization" not in fake_server.requests[-1].headers
    fake_server.route(lambda r: body_script(404, b"not found", "text/plain"))
    missing = scrape.resolve([], fake_server.url + "/api")
    assert missing.urls == [] and missing.note == f"no server metrics: {fake_server.url}/metrics answered HTTP 404"
    fake_server.route(lambda r: body_script(200, b"<html><body>relay dashboard</body></html>"))
    assert "HTML page" in str(scrape.resolve([], fake_server.url).note)
    assert scrape.resolve([], fake_server.url, discover=False).urls == []


def test_a_given_url_that_is_no_metrics_is_refused_before_the_run(fake_server: FakeServer) -> None:
    fake_server.route(lambda r: body_script(401, b'{"error":"unauthorized"}', "application/json"))
    with pytest.raises(ConfigError, match=r"server metrics: .*/metrics answered HTTP 401; give the server's"):
        scrape.resolve([f"http://user:secret@127.0.0.1:{fake_server.port}/metrics?key=s3"], "http://x")
    try:
        scrape.resolve([f"http://user:secret@127.0.0.1:{fake_server.port}/metrics?key=s3"], "http://x")
    except ConfigError as exc:
        assert "secret" not in str(exc) and "s3" not in str(exc)


def test_the_sampler_writes_every_sample_with_its_time(fake_server: FakeServer, tmp_path: Path) -> None:
    count = {"n": 0}

    def answer(r: object) -> object:
        count["n"] += 1
        return body_script(200, LLAMACPP.replace("requests_processing 4", f"requests_processing {count['n'] % 5}")
                           .encode(), "text/plain")

    fake_server.route(answer)  # type: ignore[arg-type]
    sources = scrape.resolve([fake_server.url + "/metrics"], "http://unused", interval_s=0.2)
    before = time.time()
    (tmp_path / "segments").mkdir()
    sampler = scrape.Sampler(sources, lambda: tmp_path).start()
    time.sleep(1.1)
    latest = sampler.latest()  # what the live line shows
    assert latest["waiting"] == 3 and latest["kv_cache_usage"] == 0.5 and latest["running"] in range(5)
    sealed_at = time.time()
    sealed = records.seal(tmp_path)  # the run is finalised while the sampler goes on (a web session's next start)
    time.sleep(0.5)
    sampler.stop()
    assert not (tmp_path / "segments").exists()  # a sealed run is never written again
    segments = sorted((sealed / "server").glob("*.arrow"))
    entry = scrape.collect(sealed, tmp_path)
    assert entry is not None
    df = series.load(tmp_path / SERVER_METRICS_FILE)
    assert df is not None and list(df.columns) == ["time", "source", "name", "labels", "value"]
    scrapes = df["time"].nunique()
    assert 4 <= scrapes <= 7 and entry["scrapes"] == scrapes and entry["failed_scrapes"] == 0
    assert len(segments) == scrapes  # written as they came, one segment a round, not at the end
    assert entry["servers"] == ["llama.cpp"] and entry["samples"] == len(df) == 6 * scrapes
    assert before <= df["time"].min() and df["time"].max() <= sealed_at
    running = df[df["name"] == "llamacpp:requests_processing"]["value"].tolist()
    assert running == [float((i + 2) % 5) for i in range(scrapes)]  # resolve's check was scrape 1


def test_a_failing_source_is_asked_less_often(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.route(lambda r: body_script(200, VLLM.encode(), "text/plain"))
    (tmp_path / "segments").mkdir()
    sampler = scrape.Sampler(scrape.resolve([fake_server.url + "/metrics"], "http://x", interval_s=0.1),
                             lambda: tmp_path)
    fake_server.route(lambda r: body_script(503, b"down", "text/plain"))
    sampler.start()
    time.sleep(1.5)
    sampler.stop()
    entry = scrape.collect(tmp_path / "segments", tmp_path)
    assert entry is not None and entry["samples"] == 0
    # 3 failures at 0.1 s, then waits of 0.2, 0.4, 0.8 s: about 6 scrapes in 1.5 s instead of 15
    assert 4 <= entry["failed_scrapes"] <= 8 and entry["last_problem"].endswith("answered HTTP 503")


def test_the_server_section_is_checked_like_every_other() -> None:
    base = {"load": {"kind": "constant", "users": 1, "step_s": 1}}
    parsed = Scenario.from_dict({**base, "server": {"metrics_url": ["http://h:8000/metrics"], "interval_s": 2}},
                                "s.toml", Path("."), "s")
    assert parsed.server.metrics_url == ("http://h:8000/metrics",) and parsed.server.interval_s == 2
    again = Scenario.from_dict(json.loads(json.dumps(parsed.to_dict())), "resolved", Path("."), "s")
    assert again.server == parsed.server
    for bad, message in (({"metrics": "x"}, r"s.toml: \[server\] metrics: unknown key; allowed keys: metrics_url"),
                         ({"metrics_url": ["gpu:8000"]}, r"\[server\] metrics_url: expected an http\(s\) URL"),
                         ({"interval_s": 0}, r"\[server\] interval_s: must be at least 0.1")):
        with pytest.raises(ConfigError, match=message):
            Scenario.from_dict({**base, "server": bad}, "s.toml", Path("."), "s")
    assert parsed.with_server_metrics(["http://other/metrics"]).server.metrics_url == ("http://other/metrics",)
    with pytest.raises(ConfigError, match="^--server-metrics: expected an http"):
        parsed.with_server_metrics(["file:///etc/passwd"])


@pytest.fixture
def slot_server() -> Iterator[GaugeServer]:
    fake = FakeServer()
    yield GaugeServer(fake, slots=4)
    fake.close()


@pytest.mark.slow
def test_a_four_slot_server_explains_the_breakpoint(slot_server: GaugeServer, tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, """
[load]
kind = "steps"
users = [2, 4, 8]
step_s = 4
step_warmup_s = 0.5
[output]
max_tokens = 8
[stop]
drain_s = 3
[server]
interval_s = 0.25
""")
    out = tmp_path / "run"
    done = run_cli(scenario, slot_server.url, out, "--protocol", "anthropic", model="slot-4", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"server metrics: {slot_server.url}/metrics (vLLM;" in done.stderr
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["server_metrics"]["sources"] == [slot_server.url + "/metrics"]
    analyzed = run_cli_analyze(out)
    steps = {s["load_level"]: s for s in analyzed["steps"]}
    assert sorted(steps) == [2, 4, 8]
    for users, step in steps.items():
        server = step["server"]
        assert set(server) == {"running_mean", "waiting_mean", "queue_time_p50_s", "server_ttft_p50_s",
                               "client_minus_server_ttft_p50_s"}
        # what the server's schedule really held over the step's window (`start` is after its warm-up); the
        # gauges are sampled every 0.25 s, so a few-second step's mean is off by a sample's share (seen: 0.302)
        running, waiting = slot_server.mean_state(step["start"], step["end"])
        assert abs(server["running_mean"] - running) <= 0.5 and abs(server["waiting_mean"] - waiting) <= 0.5, \
            (users, server, running, waiting)
        # the check, where the server's schedule held the step's users: a starved 2-core machine can pause
        # the users, or leave a finished stream unread in the client, which still counts it (seen: 2 users on the
        # client's side, 1.29 running on the server's, its schedule agreeing)
        if running + waiting >= users - 0.25:
            assert abs(server["running_mean"] - min(users, 4)) <= 0.5, (users, server)
            assert abs(server["waiting_mean"] - max(users - 4, 0)) <= 1, (users, server)
        # nothing sits between client and server: the difference is within the server's TTFT bucket's width
        # (0.04-0.06 s at 2 and 4 users; 0.25-0.5 s at 8, where a request waits about 0.26 s)
        assert abs(server["client_minus_server_ttft_p50_s"]) <= (0.02 if users <= 4 else 0.25), (users, server)
    # one service takes 0.05 + 7 x 0.03 = 0.26 s: at 8 users a request waits about one service time
    assert 0.15 <= steps[8]["server"]["queue_time_p50_s"] <= 0.4 and steps[2]["server"]["queue_time_p50_s"] < 0.01
    more = {d["step"]: d for d in analyzed["server_metrics"]["steps"]}
    assert more[steps[8]["step"]]["server_ttft_p50_bucket_s"] == [0.25, 0.5]  # where the true p50 (~0.31 s) lies
    assert more[steps[2]["step"]]["server_ttft_p50_bucket_s"] == [0.04, 0.06]
    bp = analyzed["breakpoint"]
    assert bp is not None and bp["load_level"] == 8, analyzed["breakpoint_rules"]
    said = re.search(r"server side: at 8 users 4 requests ran and ([\d.]+) waited: every batch slot was busy, TTFT "
                     r"grew by the queue time", bp["detail"])
    assert said and abs(float(said.group(1)) - steps[8]["server"]["waiting_mean"]) <= 0.15, bp["detail"]
    assert analyzed["diagnosis"]["advice"][0] == bp["server_cause"]
    assert (out / "plots" / "server_gauges.png").stat().st_size > 10_000
    report = (out / "report.html").read_text()
    assert "<h2>Server side</h2>" in report and f"Scraped from {slot_server.url}/metrics (vLLM)" in report
    assert "scraped from its Prometheus metrics" in report  # the gauges panel's caption
    # compare puts both runs' server views side by side (here the run against itself)
    from tokenload.analysis.compare import compare_runs

    comparison = compare_runs([out, out], labels=["a", "b"], out_dir=tmp_path / "cmp")
    by_load = {x["load_level"]: x["server"] for x in comparison["levels"]}
    assert by_load[8]["baseline"] == by_load[8]["run"] == steps[8]["server"]
    assert [r["server_cause"] for r in comparison["runs"]] == [bp["server_cause"]] * 2
    assert "Server side, matched by load level" in (tmp_path / "cmp" / "comparison.html").read_text()


def run_cli_analyze(run_dir: Path) -> dict:
    from tokenload.analysis.pipeline import analyze_run

    return analyze_run(run_dir)


def _truth_range(truth: list[dict], lo: float, hi: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """(min, max) of running and of waiting by the truth file over [lo, hi] (a scrape's send..receive)."""
    spans = [((r["admitted"] - r["queue_s"], r["admitted"]), (r["admitted"], r["last_token"])) for r in truth]
    points = {lo, hi} | {t for pair in spans for span in pair for t in span if lo <= t <= hi}
    running = [sum(a <= t < b for _, (a, b) in spans) for t in points]
    waiting = [sum(a <= t < b for (a, b), _ in spans) for t in points]
    return (min(running), max(running)), (min(waiting), max(waiting))


def test_the_simulators_gauges_agree_with_its_truth_file(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from simfixtures import anthropic_body, raw_request

    from tokenload.sim import serve_in_thread

    with serve_in_thread("fast", truth_path=tmp_path / "t.jsonl", slots=2, decode_base_s=0.02) as sim:
        origin = sim.base_url.rsplit("/api", 1)[0]
        found = scrape.resolve([], sim.base_url)  # found at the root, as a vLLM server's would be
        assert found.urls == [origin + "/metrics"] and found.found == ["vLLM"]
        seen: list[tuple[float, float, float, float]] = []
        with ThreadPoolExecutor(6) as pool, scrape.client() as http:
            sent = [pool.submit(raw_request, sim.base_url, "/v1/messages", anthropic_body(f"q{i}", 20))
                    for i in range(6)]
            while not all(f.done() for f in sent):
                before = time.time()
                rows: dict[str, float] = {}
                for name, _, value in scrape.scrape(http, found.urls[0]):  # one series per model: add them
                    rows[name] = rows.get(name, 0.0) + value
                seen.append((before, time.time(), rows["vllm:num_requests_running"],
                             rows["vllm:num_requests_waiting"]))
                time.sleep(0.03)
        assert all(f.result().status == 200 for f in sent)
    truth = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(truth) == 6 and all(r["admitted"] is not None for r in truth)
    assert len(seen) >= 10 and max(s[2] for s in seen) == 2 and max(s[3] for s in seen) >= 3
    for lo, hi, running, waiting in seen:
        (r_min, r_max), (w_min, w_max) = _truth_range(truth, lo, hi)
        assert r_min <= running <= r_max and w_min <= waiting <= w_max, (lo, hi, running, waiting)


def test_bad_server_metrics_flags_stop_the_run_before_it_starts(fake_server: FakeServer, tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, '[load]\nkind = "constant"\nusers = 1\nstep_s = 1\n')
    fake_server.route(lambda r: body_script(404, b"no such page", "text/plain"))
    for flag, message in (("gpu-host:8000", "tokenload: error: --server-metrics: expected an http(s) "
                                            "URL such as http://host:8000/metrics, got 'gpu-host:8000'"),
                          (fake_server.url + "/metrics", f"tokenload: error: server metrics: {fake_server.url}/metrics "
                                                        "answered HTTP 404; give the server's Prometheus /metrics")):
        out = tmp_path / "never"
        done = run_cli(scenario, fake_server.url, out, "--protocol", "anthropic", "--server-metrics", flag, timeout=60)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert message in done.stderr and not out.exists()
    assert all(r.path == "/metrics" for r in fake_server.requests)  # nothing but the one check was sent


@pytest.mark.slow
def test_a_relay_without_metrics_says_so_once(fake_server: FakeServer, tmp_path: Path) -> None:
    from fakeserver import stream_script

    fake_server.route(lambda r: body_script(404, b"not found", "text/plain") if r.path == "/metrics"
                      else stream_script("anthropic", ["a ", "b"], 0.01, 0.01))
    scenario = write_scenario(tmp_path, '[load]\nkind = "constant"\nusers = 1\nstep_s = 1\n[stop]\ndrain_s = 1\n')
    out = tmp_path / "run"
    done = run_cli(scenario, fake_server.url + "/api", out, "--protocol", "anthropic", timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    note = f"no server metrics: {fake_server.url}/metrics answered HTTP 404"
    assert json.loads((out / MANIFEST_FILE).read_text())["server_metrics"] == {"sources": [], "note": note}
    assert done.stderr.count(note) == 1 and not (out / SERVER_METRICS_FILE).exists()
    assert sum(r.path == "/metrics" for r in fake_server.requests) == 1
    summary = run_cli_analyze(out)
    assert summary["server_metrics"] == {"note": note} and all("server" not in s for s in summary["steps"])


def _two_step_run(tmp_path: Path, server: GaugeServer, users: str) -> dict:
    """A short closed-loop run of two steps against `server`, analysed."""
    scenario = write_scenario(tmp_path, f"""
[load]
kind = "steps"
users = {users}
step_s = 4
step_warmup_s = 0.5
[output]
max_tokens = 8
[stop]
drain_s = 3
[server]
interval_s = 0.25
""")
    out = tmp_path / "run"
    done = run_cli(scenario, server.url, out, "--protocol", "anthropic", model="slot-4", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_cli_analyze(out)


@pytest.mark.slow
def test_time_added_in_front_of_the_server_is_named(tmp_path: Path) -> None:
    """A relay with 2 connections in front of a 16-slot server: at 8 users the client's TTFT grows, the server's not."""
    fake = FakeServer()
    try:
        analyzed = _two_step_run(tmp_path, GaugeServer(fake, slots=16, relay_slots=2), "[1, 8]")
    finally:
        fake.close()
    low, high = sorted(analyzed["steps"], key=lambda s: s["load_level"])
    assert high["server"]["waiting_mean"] < 0.3 and high["server"]["running_mean"] <= 2.3  # the server never queued
    assert high["server"]["server_ttft_p50_s"] < 0.1 and high["ttft_p50_s"] > 0.5  # ~3 services of 0.26 s in the relay
    assert high["server"]["client_minus_server_ttft_p50_s"] > 0.4
    cause = analyzed["server_metrics"]["cause"]
    assert cause["kind"] == "between" and cause["text"].startswith("the server's own TTFT stayed at 0.05 s while the "
                                                                   "client's grew to ")
    assert "the time is added between you and the server" in analyzed["diagnosis"]["advice"][0]


@pytest.mark.slow
def test_a_full_kv_cache_is_named_before_the_queue(tmp_path: Path) -> None:
    fake = FakeServer()
    try:
        analyzed = _two_step_run(tmp_path, GaugeServer(fake, slots=4, kv_per_request=0.245), "[2, 8]")
    finally:
        fake.close()
    low, high = sorted(analyzed["steps"], key=lambda s: s["load_level"])
    assert abs(low["server"]["kv_cache_usage_mean"] - 0.49) <= 0.1 and high["server"]["kv_cache_usage_mean"] > 0.85
    assert analyzed["server_metrics"]["cause"]["text"] == ("at 8 users the KV cache reached 98%: new requests had to "
                                                          "wait for cache space: shorter prompts or outputs, or fewer "
                                                          "users, fit it")


def test_the_live_line_shows_the_servers_gauges() -> None:
    from tokenload.commands.run import live_line

    live = {"step": 3, "users": 8, "target_users": 8, "step_rps": 3.2, "requests": 40, "errors": 0, "elapsed_s": 12}
    assert " · 0 errors · 12 s" in live_line(live)
    shown = live_line({**live, "server": {"running": 4.0, "waiting": 4.0, "kv_cache_usage": 0.98}})
    assert " · 0 errors · server KV 98% 4 running 4 waiting · 12 s" in shown


def test_probe_says_where_one_requests_time_went(tmp_path: Path) -> None:
    """One request through a relay that holds it 0.5 s: the server's TTFT bucket says the time was not its own."""
    import subprocess
    import sys

    fake = FakeServer()
    try:
        relayed = GaugeServer(fake, relay_delay_s=0.5)
        command = [sys.executable, "-m", "tokenload", "probe", "--base-url", relayed.url, "--protocol", "anthropic",
                   "--model", "slot-4", "--server-metrics", relayed.url + "/metrics"]
        done = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        server = json.loads(done.stdout)["server"]
        assert server["servers"] == ["vLLM"] and server["running_before"] == 0 and server["waiting_before"] == 0
        assert server["server_ttft_bucket_s"] == [0.04, 0.06] and server["queue_time_bucket_s"] == [0.0, 0.001]
        said = re.fullmatch(r"the server's TTFT was at most 0.06 s of the client's ([\d.]+) s: at least ([\d.]+) s "
                            r"were added between you and the server", server["note"])
        assert said, server["note"]
        client, added = float(said[1]), float(said[2])  # the relay holds 0.5 s; a busy machine adds to it
        assert client >= 0.5 and added == pytest.approx(client - 0.06, abs=0.002), server["note"]
        text = subprocess.run(command, capture_output=True, text=True, timeout=60, env={"TERM": "dumb", **os.environ})
        assert "server (vLLM): the server's TTFT was at most 0.06 s" in text.stdout
        assert [r.path for r in fake.requests].count("/metrics") == 4  # two scrapes per probe, no more
    finally:
        fake.close()


def _write_samples(run_dir: Path, rows: list[tuple[float, str, str, float]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"time": [r[0] for r in rows], "source": ["http://gpu:8000/metrics"] * len(rows),
                             "name": [r[1] for r in rows], "labels": [r[2] for r in rows],
                             "value": [r[3] for r in rows]}), run_dir / SERVER_METRICS_FILE)


def _gauges_per_step(run_dir: Path, capacity: int) -> list[tuple[float, str, str, float]]:
    """vLLM gauges of a `capacity`-slot server at five instants inside each step of an analysed run."""
    from tokenload.analysis.pipeline import analyze_run

    rows = []
    for step in analyze_run(run_dir, write=False)["steps"]:
        users = int(step["load_level"])
        for t in np.linspace(step["start"], step["end"], 7)[1:-1]:
            rows += [(t, "vllm:num_requests_running", '{"model_name":"m"}', float(min(users, capacity))),
                     (t, "vllm:num_requests_waiting", '{"model_name":"m"}', float(max(users - capacity, 0)))]
    return rows


def test_the_servers_cause_follows_the_errors_when_errors_bound_the_run(tmp_path: Path) -> None:
    from tokenload.analysis.pipeline import analyze_run
    from tokenload.analysis.synthetic import Law, write_synthetic_run

    run_dir = write_synthetic_run(tmp_path / "run", Law(users=(4, 8, 16), capacity=8, error_rates={16: 0.3}), n=3000)
    _write_samples(run_dir, _gauges_per_step(run_dir, 8))
    summary = analyze_run(run_dir, write=False)
    assert [(s["server"]["running_mean"], s["server"]["waiting_mean"]) for s in summary["steps"]] == \
        [(4.0, 0.0), (8.0, 0.0), (8.0, 8.0)]
    cause = summary["server_metrics"]["cause"]["text"]
    assert cause.startswith("at 16 users 8 requests ran and 8 waited: every batch slot was busy")
    advice = summary["diagnosis"]["advice"]
    assert summary["diagnosis"]["bound"] == "errors" and "failed with overloaded" in advice[0] and advice[1] == cause


def test_names_outside_the_vocabulary_are_kept_raw_and_said_so(tmp_path: Path) -> None:
    from tokenload.analysis.pipeline import analyze_run
    from tokenload.analysis.synthetic import Law, write_synthetic_run

    run_dir = write_synthetic_run(tmp_path / "run", Law(users=(1, 2)), n=400)
    start = float(pd.read_parquet(run_dir / "requests.parquet")["started_at"].min())
    _write_samples(run_dir, [(start + i, "my_server_busy_workers", "{}", 3.0) for i in range(20)])
    summary = analyze_run(run_dir)
    view = summary["server_metrics"]
    assert view["terms"] == [] and view["raw_names"] == 1 and view["cause"] is None
    assert all(s["server"] == {} for s in summary["steps"])
    assert "none of its 1 metric names is in tokenload's vocabulary" in (run_dir / "report.html").read_text()
    assert not (run_dir / "plots" / "server_gauges.png").exists()


@pytest.mark.slow
def test_the_web_tab_shows_the_servers_gauges_live_and_the_run_keeps_them(tmp_path: Path) -> None:
    from test_webui import WebRun, _done

    scenario = write_scenario(tmp_path, '[load]\nkind = "constant"\nusers = 6\nstep_s = 4\n[stop]\ndrain_s = 2\n'
                                        '[server]\ninterval_s = 0.25\n')
    fake = FakeServer()
    try:
        server = GaugeServer(fake, slots=4, kv_per_request=0.2)
        web = WebRun(scenario, server.url, tmp_path / "run", "--protocol", "anthropic")
        try:
            busy = web.wait(lambda d: bool(d["server"]) and d["server"]["waiting"] > 0, timeout=40)["server"]
            web.wait(_done(1))  # the plan ends (a Ctrl-C mid-run leaves Locust's UI up)
            rc, _, stderr = web.stop()
        finally:
            web.kill()
    finally:
        fake.close()
    assert busy["running"] == 4 and 0 < busy["waiting"] <= 2 and busy["kv_cache_usage"] == pytest.approx(0.8)
    assert rc == 0, stderr
    assert not (tmp_path / "run" / "server_live.json").exists()  # the live hand-off is gone with the session
    # and the start's samples are in its run directory, analysed like a headless run's (6 users on 4 slots)
    run_dir = tmp_path / "run"
    df = series.load(run_dir / SERVER_METRICS_FILE)
    manifest = json.loads((run_dir / MANIFEST_FILE).read_text())
    assert df is not None and manifest["server_metrics"]["samples"] == len(df) > 0
    assert manifest["started_at"] - 1 <= df["time"].min() and df["time"].max() <= manifest["ended_at"] + 3
    row = json.loads((run_dir / "summary.json").read_text())["steps"][0]
    step, (running, waiting) = row["server"], server.mean_state(row["start"], row["end"])
    # what the server's schedule held over the step, and 4 + 2 where it held all 6 users (a starved machine can
    # leave a finished stream unread in the client: seen 3.75 running and 0.375 waiting)
    assert abs(step["running_mean"] - running) <= 0.5 and abs(step["waiting_mean"] - waiting) <= 0.5, (step, running,
                                                                                                        waiting)
    if running + waiting >= 6 - 0.25:
        assert abs(step["running_mean"] - 4) <= 0.5 and abs(step["waiting_mean"] - 2) <= 1, step


@pytest.mark.slow
def test_a_run_killed_with_sigkill_keeps_the_server_samples_up_to_the_kill(tmp_path: Path) -> None:
    """`kill -9` of `tokenload run`: the samples scraped until then are on disk (they were written a round at a
    time), and `analyze` (which finalises such a run) turns them into server_metrics.parquet and steps[].server
    that agree with the 4-slot server's truth: 6 users, 4 running, 2 waiting."""
    import subprocess

    from test_load_process import _group_alive, _start, _wait_until

    scenario = write_scenario(tmp_path, '[load]\nkind = "constant"\nusers = 6\nstep_s = 60\nstep_warmup_s = 0.5\n'
                                        '[output]\nmax_tokens = 8\n[stop]\ndrain_s = 1\n[server]\ninterval_s = 0.25\n')
    out = tmp_path / "run"
    fake = FakeServer()
    try:
        server = GaugeServer(fake, slots=4)
        proc, pgid = _start(scenario, server.url, out, "--protocol", "anthropic", "--model", "slot-4", records=4)
        time.sleep(2.0)
        killed_at = time.time()
        proc.kill()
        proc.communicate(timeout=10)
        assert _wait_until(lambda: not _group_alive(pgid), 15) is not None
        assert list((out / "segments" / "server").glob("*.arrow"))  # on disk before anyone finalised the run
        done = subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(out), "--quiet"],
                              capture_output=True, text=True, timeout=120)
    finally:
        fake.close()
    assert done.returncode == 0, done.stderr[-2000:]
    df = series.load(out / SERVER_METRICS_FILE)
    assert df is not None
    # the last round before the kill is there (rounds are 0.25 s apart; a round is written as it ends)
    assert killed_at - 1.0 <= df["time"].max() <= killed_at
    entry = json.loads((out / MANIFEST_FILE).read_text())["server_metrics"]
    assert entry["sources"] == [server.url + "/metrics"] and entry["samples"] == len(df)
    assert entry["scrapes"] >= df["time"].nunique() >= 8
    step = json.loads((out / "summary.json").read_text())["steps"][0]["server"]
    assert abs(step["running_mean"] - 4) <= 0.5 and abs(step["waiting_mean"] - 2) <= 1, step


def test_the_time_outside_the_server_comes_from_blocks_of_whole_requests(tmp_path: Path) -> None:
    """llama.cpp's prompt_seconds_total grows by each request's prefill as it ends; scraped every 0.25 s, a
    request straddles some scrapes. Each request's first token took its prefill + 0.05 s: the time outside the
    server is 0.05 s, from the blocks of whole requests; a failed request's block is left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenload.analysis.records import load_run, write_run
    from tokenload.analysis.server import outside_server
    from tokenload.analysis.synthetic import Law, generate, manifest_for

    law = Law(users=(1,), capacity=100)
    df = generate(law, n=40, seed=1)
    t, starts, finished, ttfts = 1_700_000_000.0, [], [], []
    rng = np.random.default_rng(3)
    prefill = rng.uniform(0.3, 1.2, len(df))
    for p in prefill:  # one user: each request starts as the last one ends
        starts.append(t)
        ttfts.append(p + 0.05)
        t += p + 0.05 + 0.5
        finished.append(t)
    df = df.assign(started_at=starts, scheduled_at=starts, ttft_s=ttfts, finished_at=finished, step=1)
    df.loc[7, "status"], df.loc[7, "error_kind"] = "error", "server_error"
    run_dir = write_run(tmp_path / "run", df, manifest_for(law, df))
    scrapes = np.arange(starts[0] - 1, t + 1, 0.25)
    counted = [float(prefill[np.array(finished) <= s].sum()) for s in scrapes]
    table = pa.table({"time": scrapes, "source": ["http://127.0.0.1:9/metrics"] * len(scrapes),
                      "name": ["llamacpp:prompt_seconds_total"] * len(scrapes), "labels": ["{}"] * len(scrapes),
                      "value": counted})
    pq.write_table(table, run_dir / SERVER_METRICS_FILE)
    outside = outside_server(load_run(run_dir), starts[0], t)
    assert outside is not None and outside.source == "llama.cpp's prompt_seconds_total"
    assert outside.mean_s == pytest.approx(0.05, abs=1e-6)
    assert 20 <= outside.requests.sum() < len(df) - 1  # the failed request's block is out, the others in
