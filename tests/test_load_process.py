"""The load path's processes under faults: signals, kills, lost workers, validation before start.

Real `tokenload run`, real Locust, the real simulator on loopback. Processes are
followed by their process group (never by name: other Locust runs may share
the machine).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from loadkit import free_port, run_command, truth_frame, write_scenario

from tokenload.load import records, websession
from tokenload.load.rundirs import finalise
from tokenload.sim import launch

LONG = """
[prompt]
tokens = 32
[output]
max_tokens = 60
ignore_eos = true
[load]
kind = "constant"
users = 4
step_s = 60
[stop]
drain_s = 5
"""


def _group_alive(pgid: int) -> bool:
    """Any live (not zombie) process in group `pgid`."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _wait_until(predicate, timeout_s: float) -> float | None:  # type: ignore[no-untyped-def]
    """Seconds until `predicate()` held, or None after `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def _states(out: Path) -> list[dict]:
    found = []
    for path in glob.glob(str(out / "segments" / "*.state.json")):
        try:
            found.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError):
            pass
    return found


def _start(scenario: Path, base_url: str, out: Path, *extra: str, records: int = 3,
           preexec_fn: Callable[[], object] | None = None) -> tuple[subprocess.Popen[str], int]:
    """`tokenload run` in the background, once every process has flushed `records`; returns it and Locust's group."""
    proc = subprocess.Popen(run_command(scenario, base_url, out, *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TERM": "dumb"},
                            preexec_fn=preexec_fn)
    writers = 2 if "--processes" in extra else 1
    assert _wait_until(lambda: len(_states(out)) == writers and all(s["records"] >= records for s in _states(out)), 30)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1, children
    return proc, int(children[0])


def _recorded_everything_the_server_saw(df: pd.DataFrame, truth: pd.DataFrame) -> None:
    """Every request the server saw has a record; one cut before its headers has no server id, so those are
    matched by count against the records of cut streams."""
    unmatched = set(truth.request_id) - set(df.server_request_id.dropna())
    assert len(unmatched) <= (df.status == "cancelled").sum(), (len(unmatched), df.status.value_counts())
    assert df.request_id.is_unique


# ---------------------------------------------------------------- signals (issue 14.9)


def test_sigterm_stops_a_run_like_ctrl_c(tmp_path: Path) -> None:
    """SIGTERM: records merged, the manifest says interrupted, exit 0; cut streams are `cancelled`, not `ok`."""
    scenario = write_scenario(tmp_path, LONG.replace("drain_s = 5", "drain_s = 0").replace("= 60\n", "= 200\n"))
    truth_path = tmp_path / "truth.jsonl"
    out = tmp_path / "run"
    with launch(["--truth", str(truth_path)]) as sim:
        proc, _ = _start(scenario, sim.base_url, out)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert stdout.strip().splitlines()[-1] == str(out)
    df = pd.read_parquet(out / "requests.parquet")
    _recorded_everything_the_server_saw(df, truth_frame(truth_path))
    assert json.loads((out / "manifest.json").read_text())["stop_reason"] == "interrupted"
    assert df.in_flight.sum() >= 1
    assert set(df.status[df.in_flight]) == {"cancelled"} and set(df.status[~df.in_flight]) == {"ok"}
    # The analysis loads a `cancelled` record and does not count it as an error.
    analysed = subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(out), "--quiet"],
                              check=False, capture_output=True, text=True, timeout=120)
    assert analysed.returncode == 0, analysed.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert sum(step["errors"] for step in summary["steps"]) == 0


SUPERVISE_INTERRUPTED_IN_TICK = """
import json, os, signal, subprocess, sys
from pathlib import Path
from tokenload.load import runner
run_dir = Path(sys.argv[1])
(run_dir / "segments").mkdir(parents=True)
(run_dir / "segments" / "control.json").write_text(json.dumps({"live": {"users": 1, "requests": 0}}))
# not Python (a SIGINT during its start-up exits 1); its output not ours (the test's pipe would wait for it)
child = subprocess.Popen(["sleep", "60"], start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
def tick(_live):  # Ctrl-C while the live line is being drawn
    os.kill(os.getpid(), signal.SIGINT)
print(runner._supervise(child, run_dir, tick))
"""


def test_ctrl_c_during_the_live_tick_stops_locust_gracefully_instead_of_leaving_it(tmp_path: Path) -> None:
    # A CI run's Ctrl-C test (SIGINT 9 s into a run on a busy machine) ended with "tokenload: interrupted", exit
    # 130 and no finalised run: the interrupt had landed while the live line was drawn, inside the wait's
    # timeout handler, where the sibling `except KeyboardInterrupt` never sees it; Locust then stopped only
    # because its parent had died. Now it is forwarded to Locust's group like any other Ctrl-C.
    done = subprocess.run([sys.executable, "-c", SUPERVISE_INTERRUPTED_IN_TICK, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == str(-signal.SIGINT)  # the child was sent SIGINT, and the wait went on to its end


def test_sigkill_of_run_stops_locust_and_analyze_recovers_the_segments(tmp_path: Path) -> None:
    """`kill -9` of `tokenload run`: Locust stops within seconds (no more load), and `analyze` finalises the
    segments it flushed instead of answering "requests.parquet is missing"."""
    scenario = write_scenario(tmp_path, LONG)
    truth_path = tmp_path / "truth.jsonl"
    out = tmp_path / "run"
    with launch(["--truth", str(truth_path)]) as sim:
        proc, pgid = _start(scenario, sim.base_url, out, "--processes", "2")
        proc.kill()
        proc.communicate(timeout=10)
        gone_after = _wait_until(lambda: not _group_alive(pgid), 15)
        seen = len(truth_frame(truth_path))
        time.sleep(2)
        seen_later = len(truth_frame(truth_path))
    assert gone_after is not None and gone_after < 10, gone_after  # before: Locust loaded on for 15 s
    assert seen_later == seen  # no load after the processes were gone
    assert not (out / "requests.parquet").exists() and list((out / "segments").glob("*.arrow"))
    result = subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(out), "--quiet"],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    df = pd.read_parquet(out / "requests.parquet")
    assert f"recovered {len(df)} records from the segments" in result.stdout + result.stderr
    _recorded_everything_the_server_saw(df, truth_frame(truth_path))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stop_reason"] == "interrupted" and manifest["records"]["total"] == len(df)
    assert not (out / "segments").exists() and (out / "report.html").exists()


def test_sigkill_of_the_master_stops_its_workers_and_the_run_waits_for_them(tmp_path: Path) -> None:
    """`kill -9` of the Locust master under `--processes 2`: the forked workers stop within seconds, `tokenload
    run` finalises after their last flush, and nothing lands in the run directory afterwards."""
    scenario = write_scenario(tmp_path, LONG)
    truth_path = tmp_path / "truth.jsonl"
    out = tmp_path / "run"
    with launch(["--truth", str(truth_path)]) as sim:
        proc, pgid = _start(scenario, sim.base_url, out, "--processes", "2")
        os.kill(pgid, signal.SIGKILL)
        killed = time.monotonic()
        gone_after = _wait_until(lambda: not _group_alive(pgid), 15)
        _, stderr = proc.communicate(timeout=30)
        finished_after = time.monotonic() - killed
        seen = len(truth_frame(truth_path))
        time.sleep(2)
        seen_later = len(truth_frame(truth_path))
    assert gone_after is not None and gone_after < 10, gone_after  # Locust's own master timeout: 60 s
    assert finished_after < 25, finished_after
    assert proc.returncode == 1 and "Locust exited with code -9" in stderr, stderr
    assert seen_later == seen
    df = pd.read_parquet(out / "requests.parquet")
    _recorded_everything_the_server_saw(df, truth_frame(truth_path))
    assert df.worker.nunique() == 2
    manifest = json.loads((out / "manifest.json").read_text())
    # Both flushed their last records before the merge (none "did not finish"); both stopped early.
    assert not any("did not finish" in w for w in manifest["warnings"]), manifest["warnings"]
    assert manifest["workers_lost"] == sorted(df.worker.unique())
    assert any("workers stopped early" in w and "is gone" in w for w in manifest["warnings"])
    # the simulator serves /metrics, so the run keeps the server's samples beside its records
    assert sorted(p.name for p in out.iterdir()) == ["locust.log", "manifest.json", "requests.parquet",
                                                     "server_metrics.parquet"]


# ---------------------------------------------------------------- processes left behind (issue 22.7)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigkill_of_a_headless_run_cuts_its_open_streams(tmp_path: Path, processes: int) -> None:
    """`kill -9` of `tokenload run`: Locust stops at once and cuts its open streams (kept as `cancelled`
    records) instead of draining them: before, 4 streams ran on for up to 12.5 s with nobody recording
    (with `--processes 2` the master told its workers to quit, and they drained)."""
    scenario = write_scenario(tmp_path, LONG.replace("max_tokens = 60", "max_tokens = 400"))
    truth_path = tmp_path / "truth.jsonl"
    out = tmp_path / "run"
    extra = ("--processes", "2") if processes == 2 else ()
    with launch(["--truth", str(truth_path)]) as sim:
        # the first 4 (8 s) streams are done
        proc, pgid = _start(scenario, sim.base_url, out, *extra, records=4 // processes)
        time.sleep(1.0)  # the next 4 are a second into their 8 s
        killed_at = time.time()
        proc.kill()
        proc.communicate(timeout=10)
        gone_after = _wait_until(lambda: not _group_alive(pgid), 15)
        time.sleep(1.0)
        truth = truth_frame(truth_path)
    assert gone_after is not None and gone_after < 5, gone_after
    streamed_after_kill = truth.last_token.max() - killed_at
    assert streamed_after_kill < 3.0, (streamed_after_kill, truth.outcome.value_counts())
    assert (truth.outcome == "client_closed").sum() == 4, truth.outcome.value_counts()
    finalise(out)
    df = pd.read_parquet(out / "requests.parquet")
    _recorded_everything_the_server_saw(df, truth)
    assert df.in_flight.sum() == 4 and set(df.status[df.in_flight]) == {"cancelled"}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_web_run_leaves_no_locust_behind(tmp_path: Path, how: str) -> None:
    """`tokenload run --web` killed during its plan: its Locust (web UI included) is gone within 5 s (SIGTERM:
    after the scenario's 5 s drain) and the port is free. Before, Locust's UI caught the interrupt, stopped the
    test and stayed up "indefinitely"."""
    scenario = write_scenario(tmp_path, LONG)
    out = tmp_path / "run"
    port = free_port()
    with launch() as sim:
        proc, pgid = _start(scenario, sim.base_url, out, "--web", "--web-port", str(port))
        proc.send_signal(getattr(signal, how))
        try:
            gone_after = _wait_until(lambda: not _group_alive(pgid), 15)
            _, stderr = proc.communicate(timeout=30)
        finally:
            if _group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
    assert gone_after is not None and gone_after < (5 if how == "SIGKILL" else 5 + 5), gone_after
    websession.check_port("127.0.0.1", port)  # free for the next run (a TIME_WAIT left by the UI is no listener)
    if how == "SIGTERM":  # stopped like Ctrl-C: exit 0, the run finalised and marked interrupted
        assert proc.returncode == 0, stderr
        assert json.loads((out / "manifest.json").read_text())["stop_reason"] == "interrupted"


@pytest.mark.slow
def test_ctrl_c_stops_a_run_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A run started with `&` from a script inherits SIGINT ignored; Ctrl-C must still stop it (before, it ran
    its whole 60 s plan through Ctrl-C)."""
    scenario = write_scenario(tmp_path, LONG)
    out = tmp_path / "run"
    with launch() as sim:
        proc, pgid = _start(scenario, sim.base_url, out,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
            if _group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
    assert proc.returncode == 0, stderr
    assert json.loads((out / "manifest.json").read_text())["stop_reason"] == "interrupted"


def test_web_run_on_a_busy_port_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    """The port is checked first: exit 2, one line naming the port and `--web-port`, no run directory, no request.
    Before, the run started, an orphaned UI's page was announced as its own, and the plan ran headless."""
    scenario = write_scenario(tmp_path, LONG)
    out = tmp_path / "run"
    with socket.socket() as busy, socket.socket() as channel:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        channel.bind(("127.0.0.1", 0))
        channel.listen()
        channel.setblocking(False)
        port = busy.getsockname()[1]
        result = subprocess.run(run_command(scenario, f"http://127.0.0.1:{channel.getsockname()[1]}", out, "--web",
                                            "--web-port", str(port)),
                                check=False, capture_output=True, text=True, timeout=60)
        with pytest.raises(BlockingIOError):
            channel.accept()  # nothing connected to the channel
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "--web-port" in lines[0], lines
    assert not out.exists()


# ---------------------------------------------------------------- late writers (issue 14.10)


def test_a_writer_that_flushes_after_finalise_changes_nothing(tmp_path: Path) -> None:
    """The rule: finalising seals the run; a process flushing later drops its rows and learns it must stop."""
    late = records.SegmentWriter(tmp_path, "late")
    early = records.SegmentWriter(tmp_path, "early")
    early.append({"request_id": "a", "started_at": 1.0, "in_flight": False})
    early.flush({}, done=True)
    late.append({"request_id": "b", "started_at": 2.0, "in_flight": False})
    late.flush({})
    finalise(tmp_path)
    before = (tmp_path / "requests.parquet").read_bytes()
    late.append({"request_id": "c", "started_at": 3.0, "in_flight": False})
    late.flush({}, done=True)
    assert late.sealed and not early.sealed
    assert (tmp_path / "requests.parquet").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "requests.parquet"]
    assert list(pd.read_parquet(tmp_path / "requests.parquet").request_id) == ["a", "b"]
    assert json.loads((tmp_path / "manifest.json").read_text())["workers_lost"] == ["late"]


def test_analyze_does_not_finalise_a_run_that_is_still_writing(tmp_path: Path) -> None:
    writer = records.SegmentWriter(tmp_path, "w1")
    writer.append({"request_id": "a", "started_at": 1.0, "in_flight": False})
    writer.flush({})  # not done, flushed just now: a live process
    result = subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(tmp_path)], check=False, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "still being written" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "requests.parquet").exists() and (tmp_path / "segments").is_dir()


# ---------------------------------------------------------------- a lost worker's users (issue 14.11)


def test_records_after_a_lost_worker_carry_the_users_really_running(tmp_path: Path) -> None:
    """Locust does not replace a lost worker's users: 4 planned users become 2, and the records say so."""
    scenario = write_scenario(tmp_path, LONG.replace("step_s = 60", "step_s = 14"))
    out = tmp_path / "run"
    with launch() as sim:
        proc, _ = _start(scenario, sim.base_url, out, "--processes", "2")
        victim = _states(out)[0]
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.time()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr  # a lost worker fails the run
    df = pd.read_parquet(out / "requests.parquet")
    survivor = df[df.worker != victim["worker"]]
    before = survivor[survivor.started_at < killed_at]
    after = survivor[survivor.started_at > killed_at + 6]  # missing after 3 s of silence, census within 1 s more
    assert len(before) and set(before.active_users) == {4}
    assert len(after) > 5 and set(after.active_users) == {2}, after.active_users.value_counts()


# ---------------------------------------------------------------- validation before start (issue 14.12)


@pytest.mark.parametrize("case, expect", [
    ("dataset", "bad.jsonl line 2: not valid JSON"),
    ("users", "--users must be at least 1"),
    ("duration", "--duration must be greater than 0"),
    ("processes", "--processes must be at least 1"),
    ("processes-word", "--processes must be a number of processes or auto, got 'many'"),
    ("out-file", "is a file, not a directory"),
    ("out-used", "already holds a run"),
])
def test_bad_input_is_one_line_before_any_process(tmp_path: Path, case: str, expect: str) -> None:
    """One line, exit 2, no banner, no Locust, and no run directory left behind to block `--out`."""
    body = "[load]\nkind = 'constant'\nusers = 1\nstep_s = 1\n"
    if case == "dataset":
        (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\nnot json\n')
        body += "[prompt]\ndataset = 'bad.jsonl'\n"
    scenario = write_scenario(tmp_path, body)
    out = tmp_path / "run"
    extra = {"users": ["--users", "0"], "duration": ["--duration", "0"], "processes": ["--processes", "0"],
             "processes-word": ["--processes", "many"]}.get(case, [])
    if case == "out-file":
        out.write_text("not a directory")
    if case == "out-used":
        (out / "segments").mkdir(parents=True)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = subprocess.run([*run_command(scenario, "http://127.0.0.1:9", out), *extra], check=False, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and expect in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


# ---------------------------------------------------------------- channel precedence (issue 14.8 / 16.3)


def test_scenario_channel_values_are_defaults_the_environment_beats(tmp_path: Path) -> None:
    """A scenario's `[channel] model` loses to ANTHROPIC_MODEL, and the channel line names the variable."""
    scenario = write_scenario(tmp_path, """
[channel]
model = "model-from-scenario"
[prompt]
tokens = 16
[output]
max_tokens = 4
[load]
kind = "constant"
users = 1
step_s = 2
[stop]
drain_s = 2
""")
    with launch() as sim:
        command = [sys.executable, "-m", "tokenload", "run", str(scenario), "--base-url", sim.base_url,
                   "--out", str(tmp_path / "run")]
        result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60,
                                env={**os.environ, "TERM": "dumb", "ANTHROPIC_MODEL": "sim-7b"})
    assert result.returncode == 0, result.stderr
    assert "model from environment ANTHROPIC_MODEL" in result.stderr.replace("\n", " ")
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert set(df.model) == {"sim-7b"} and df.status.eq("ok").all()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["scenario"]["channel"]["models"] == ["sim-7b"]
