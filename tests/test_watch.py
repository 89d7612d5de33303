"""`tokenload watch` against the real simulator: budget, down channel, signals, SIGKILL, two watchers, secrets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from tokenload.channel import Channel
from tokenload.cli import main
from tokenload.history.sampler import Watcher, WatchPlan, status_line
from tokenload.history.store import SqliteHistory, open_store
from tokenload.sim import serve_in_thread

SECRET = "sk-watch-SECRET-abcdef123456"


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A keyed simulator whose requests last about 1 s (32 tokens x 30 ms): a kill lands mid-sample."""
    truth = tmp_path_factory.mktemp("sim") / "truth.jsonl"
    with serve_in_thread("fast", api_key=SECRET, truth_path=truth, decode_base_s=0.03) as handle:
        yield handle


def _truth_tokens(path: Path) -> int:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(int(t.get("input_tokens") or 0) + int(t.get("output_tokens") or 0) for t in lines)


def _watch(args: list[str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tokenload", "watch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "ANTHROPIC_API_KEY": SECRET}, **kw)


def _committed(db: Path) -> tuple[int, int]:
    if not db.exists():
        return 0, 0
    with closing(SqliteHistory(db)) as store:
        return len(store.samples()), len(store.query())


def _wait_for(predicate: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_tiny_daily_budget_is_never_exceeded(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    with serve_in_thread("fast", truth_path=truth) as sim, closing(open_store(tmp_path / "h.db")) as store:
        channel = Channel(base_url=sim.base_url, model="sim-7b")
        budget = 700  # room for about two samples of 3 x (64 in + 32 out)
        lines: list[str] = []
        watcher = Watcher(store, channel, WatchPlan(every_s=0.01, max_tokens_per_day=budget),
                          on_sample=lambda r: lines.append(status_line(r)))
        assert watcher.run(max_samples=6) == 6
        used = store.tokens_used(watcher.fingerprint, 0, 2e10)
        frame = store.query()
        samples = store.samples()
    spent = _truth_tokens(truth)  # what the server really processed
    assert 0 < spent <= budget
    assert used == spent == int(frame["input_tokens"].sum() + frame["output_tokens"].sum())
    skipped = [s for s in samples if s.kind == "skipped"]
    assert skipped and all(s.tokens == 0 and "budget" in (s.note or "") for s in skipped)
    assert any("SKIPPED 3 (budget)" in line for line in lines)
    assert f"{budget - used:,} tokens left today" in lines[-1]


def test_two_watchers_of_one_channel_share_the_budget_and_never_exceed_it(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    # A sample books 408 tokens (3 x (64 x 1.5 + 8 + 32)) and spends 288: after three samples 500 are left,
    # enough for one booking, not two; two watchers that checked without booking would both go and overrun.
    budget = 3 * 288 + 500
    with serve_in_thread("fast", truth_path=truth) as sim:
        channel = Channel(base_url=sim.base_url, model="sim-7b")
        taken: list[int] = []

        def watch() -> None:  # one connection per thread, as two processes would have
            with closing(open_store(tmp_path / "h.db")) as store:
                taken.append(Watcher(store, channel, WatchPlan(every_s=0.01, max_tokens_per_day=budget)).run(8))

        threads = [threading.Thread(target=watch) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    with closing(open_store(tmp_path / "h.db")) as store:
        used = store.tokens_used(store.channels()[0][0], 0, 2e10)
        kinds = [s.kind for s in store.samples()]
    assert taken == [8, 8]
    assert 0 < _truth_tokens(truth) == used <= budget
    assert "reserved" not in kinds and kinds.count("skipped") >= 8


def test_a_reservation_left_by_a_killed_watcher_stays_booked(tmp_path: Path) -> None:
    from tokenload.history.store import Sample

    with closing(open_store(tmp_path / "h.db")) as store:
        assert store.reserve(Sample("s1", "c", "reserved", 100.0, tokens=400), 1000, 0, 200)
        assert not store.reserve(Sample("s2", "c", "reserved", 100.0, tokens=700), 1000, 0, 200)
    with closing(open_store(tmp_path / "h.db")) as store:  # "restarted"
        assert store.tokens_used("c", 0, 200) == 400
        store.add_sample(Sample("s1", "c", "probe", 100.0, tokens=250, requests=3), [])  # replaces the booking
        assert store.tokens_used("c", 0, 200) == 250 and [s.kind for s in store.samples()] == ["probe"]
        assert store.reserve(Sample("s3", "c", "reserved", 150.0, tokens=700), 1000, 0, 200)
        store.release("s3")
        assert store.tokens_used("c", 0, 200) == 250


def test_a_down_channel_is_recorded_as_errors_and_watching_goes_on(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = tmp_path / "h.db"
    rc = main(["watch", "--base-url", f"http://127.0.0.1:{port}/api", "--every", "0.05s", "--samples", "3",
               "--db", str(db)])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and all("errors 1/1 (bad_base_url)" in line for line in out)
    with closing(open_store(db)) as store:
        frame = store.query()
    assert len(frame) == 3 and set(frame["error_kind"]) == {"bad_base_url"}  # one request per failing sample


def test_a_channel_that_answered_and_then_refuses_went_down_it_is_not_a_wrong_address(tmp_path: Path) -> None:
    """The same watcher, and a restarted one reading the store, call a refusal after answers `connection_refused`
    (the channel went down), while a channel that never answered stays `bad_base_url` (the test above)."""
    with closing(open_store(tmp_path / "h.db")) as store:
        with serve_in_thread("fast") as sim:
            channel = Channel(base_url=sim.base_url, model="sim-7b")
            watcher = Watcher(store, channel, WatchPlan(every_s=0.01))
            assert watcher.run(max_samples=1) == 1
        assert watcher.run(max_samples=1) == 1  # the simulator is gone: its port refuses
        assert Watcher(store, channel, WatchPlan(every_s=0.01)).run(max_samples=1) == 1
        frame = store.query()
    assert list(frame["status"]) == ["ok"] * 3 + ["error"] * 2, frame[["status", "error_kind"]]
    assert list(frame["error_kind"].iloc[3:]) == ["connection_refused"] * 2


def test_restart_resumes_the_rhythm(tmp_path: Path) -> None:
    with serve_in_thread("fast") as sim, closing(open_store(tmp_path / "h.db")) as store:
        channel = Channel(base_url=sim.base_url, model="sim-7b")
        Watcher(store, channel, WatchPlan(every_s=3600)).run(max_samples=1)
        again = Watcher(store, channel, WatchPlan(every_s=3600))
        now = time.time()
        assert again.next_due(now) > now + 3000  # not a fresh sample at once
        stop = threading.Event()
        stop.set()
        assert Watcher(store, channel, WatchPlan(every_s=1), stop=stop).run() == 0


def test_bad_options_are_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["watch", "--every", "soon"]) == 2
    assert "--every 'soon' is not a positive duration" in capsys.readouterr().err
    assert main(["watch", "--requests", "0"]) == 2
    assert main(["watch", "--scenario", "/nonexistent.toml"]) == 2


def test_sigkill_mid_sample_then_restart_loses_and_duplicates_nothing(slow_sim: object, tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    args = ["--base-url", slow_sim.base_url, "--model", "sim-7b", "--every", "0.2s", "--db", str(db)]  # type: ignore[attr-defined]
    truth: Path = slow_sim.truth_path  # type: ignore[attr-defined]
    seen_before = len(truth.read_text().splitlines())
    proc = _watch(args)
    try:
        _wait_for(lambda: _committed(db)[0] >= 2, 60)
        time.sleep(0.7)  # a sample of 3 x ~1 s requests is in flight now
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    samples_before, rows_before = _committed(db)
    time.sleep(0.3)  # the simulator notices the closed connection and writes its truth line
    assert len(truth.read_text().splitlines()) - seen_before > rows_before  # the server saw the killed sample
    with closing(SqliteHistory(db)) as store:
        before = store.query()
        assert all(s.requests == 3 for s in store.samples())  # every committed sample is whole
    restart = _watch([*args, "--samples", "2"])
    out, err = restart.communicate(timeout=60)
    assert restart.returncode == 0, err
    assert len(out.splitlines()) == 2
    with closing(SqliteHistory(db)) as store:
        after = store.query()
        samples = store.samples()
    assert len(samples) == samples_before + 2 and len(after) == rows_before + 6
    assert after["request_id"].is_unique
    kept = after[after["request_id"].isin(before["request_id"])]
    assert len(kept) == rows_before and kept["ttft_s"].tolist() == before["ttft_s"].tolist()
    assert all(s.requests == 3 for s in samples)


def test_sigterm_stops_cleanly_after_the_request_in_flight(slow_sim: object, tmp_path: Path) -> None:
    """SIGTERM once the first sample's first request has ended (the simulator's truth says so; a fixed 1.5 s
    was too short on a busy machine, and nothing was committed): the sample ends early but whole."""
    db = tmp_path / "h.db"
    truth = slow_sim.truth_path  # type: ignore[attr-defined]
    ended = len(truth.read_text().splitlines())
    proc = _watch(["--base-url", slow_sim.base_url, "--model", "sim-7b", "--every", "1h", "--db", str(db)])  # type: ignore[attr-defined]
    assert proc.stderr is not None
    first = proc.stderr.readline()  # printed once the signal handlers are in place
    assert first.startswith("watching anthropic 127.0.0.1:")
    deadline = time.monotonic() + 30
    while len(truth.read_text().splitlines()) == ended and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # its second request (of ~1 s) is in flight
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "SIGTERM, stopping" in err and "1 sample(s) taken" in err
    samples, rows = _committed(db)
    assert samples == 1 and 1 <= rows <= 3  # the sample ends early but is committed whole
    assert len(out.splitlines()) == 1


def test_two_watchers_on_one_file_lose_nothing_and_no_secret_is_stored(slow_sim: object, tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    base = ["--base-url", slow_sim.base_url, "--every", "0.05s", "--samples", "3", "--requests", "2",  # type: ignore[attr-defined]
            "--db", str(db), "--timeout", "30"]
    procs = [_watch([*base, "--model", model]) for model in ("sim-7b", "sim-30b")]
    wrong = _watch([*base, "--model", "sim-7b", "--api-key", "sk-wrong-KEY-zyxwvu987654", "--samples", "1"])
    for proc in [*procs, wrong]:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert SECRET not in out + err and "sk-wrong-KEY-zyxwvu987654" not in out + err
    with closing(SqliteHistory(db)) as store:
        frame = store.query()
        channels = dict(store.channels())
    assert len(frame) == 2 * 3 * 2 + 1 and frame["request_id"].is_unique
    port = slow_sim.base_url.split(":")[2].split("/")[0]  # type: ignore[attr-defined]
    assert channels[f"anthropic 127.0.0.1:{port} sim-7b"] == 7 and channels[f"anthropic 127.0.0.1:{port} sim-30b"] == 6
    assert frame[frame["status"] != "ok"]["error_kind"].tolist() == ["auth"]
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("h.db*"))
    assert SECRET.encode() not in raw and b"zyxwvu987654" not in raw and b"sk-wrong" not in raw


def test_a_scenario_file_sets_the_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "probe.toml"
    scenario.write_text('[prompt]\ntokens = 16\n[output]\nmax_tokens = 4\n[load]\nkind = "constant"\n')
    db = tmp_path / "h.db"
    with serve_in_thread("fast") as sim:
        assert main(["watch", "--base-url", sim.base_url, "--model", "sim-7b", "--scenario", str(scenario),
                     "--requests", "2", "--every", "0.05s", "--samples", "2", "--db", str(db)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    with closing(open_store(db)) as store:
        frame = store.query()
    assert len(frame) == 4 and set(frame["max_tokens"]) == {4} and set(frame["output_tokens"]) == {4}
    assert set(frame["prompt_tokens_target"]) == {16} and set(frame["status"]) == {"ok"}
    assert frame["request_id"].str.endswith(("-0", "-1")).all() and frame["sample_id"].nunique() == 2


def test_server_metrics_are_kept_beside_each_sample_and_history_shows_them(
        fake_server: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A scripted server whose n-th /metrics answer says n running and 2n waiting: the first answer is the
    check before watching, sample k's scrape is answer k + 1, so what is stored is known exactly."""
    from fakeserver import FakeServer, Received, Script, body_script, stream_script

    server: FakeServer = fake_server  # type: ignore[assignment]
    hits = {"metrics": 0}

    def answer(received: Received) -> Script:
        if received.path == "/metrics":
            hits["metrics"] += 1
            n = hits["metrics"]
            return body_script(200, (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {n}\n"
                                     f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {2 * n}\n"
                                     ).encode(), "text/plain; version=0.0.4")
        return stream_script("anthropic", ["a ", "b ", "c"], 0.0, 0.005)

    server.route(answer)
    db = tmp_path / "h.db"
    assert main(["watch", "--base-url", server.url, "--model", "m", "--protocol", "anthropic", "--api-key", SECRET,
                 "--requests", "2", "--every", "0.05s", "--samples", "3", "--db", str(db),
                 "--server-metrics", server.url + "/metrics"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("server ")[1].split("  ")[0] for line in lines] == [
        f"{k + 1} running {2 * (k + 1)} waiting" for k in (1, 2, 3)]
    with closing(open_store(db)) as store:
        frame = store.query()
    by_sample = frame.drop_duplicates("sample_id").sort_values("started_at")
    assert len(frame) == 6 and by_sample["server_running"].tolist() == [2.0, 3.0, 4.0]
    assert by_sample["server_waiting"].tolist() == [4.0, 6.0, 8.0]
    assert main(["history", "--db", str(db), "--out", str(tmp_path / "h"), "--csv"]) == 0
    said = capsys.readouterr().out
    assert "server (its /metrics, as each sample began): all samples: 3 running, 6 waiting on average (3 samples)" \
        in said
    hours = (tmp_path / "h" / "hours.csv").read_text().splitlines()
    assert hours[0].endswith("server running,server waiting,server KV cache")


def test_a_server_metrics_url_that_is_no_metrics_stops_watch_before_any_sample(
        fake_server: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fakeserver import FakeServer, body_script

    server: FakeServer = fake_server  # type: ignore[assignment]
    server.route(lambda r: body_script(404, b"not found", "text/plain"))
    assert main(["watch", "--base-url", server.url, "--model", "m", "--samples", "1", "--db", str(tmp_path / "h.db"),
                 "--server-metrics", server.url + "/metrics"]) == 2
    assert capsys.readouterr().err.startswith(f"tokenload: error: server metrics: {server.url}/metrics answered HTTP 404")
    assert [r.path for r in server.requests] == ["/metrics"]


def test_a_bare_every_says_the_unit_it_was_read_in(tmp_path: Path) -> None:
    """`--every 15` is 15 seconds: the start line says so (it printed "every 15")."""
    done = subprocess.run([sys.executable, "-m", "tokenload", "watch", "--every", "15", "--samples", "1",
                           "--base-url", "http://127.0.0.1:9", "--db", str(tmp_path / "h.db")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert " every 15 s (--every 15: a number without a unit is seconds) into " in done.stderr
    spelled = subprocess.run([sys.executable, "-m", "tokenload", "watch", "--every", "90s", "--samples", "1",
                              "--base-url", "http://127.0.0.1:9", "--db", str(tmp_path / "h2.db")],
                             capture_output=True, text=True, timeout=60, check=False)
    assert " every 1.5 min into " in spelled.stderr
