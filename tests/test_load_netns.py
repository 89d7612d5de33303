"""Master and two workers on three network hosts: Linux network namespaces joined by a private bridge.

Each test builds its own namespaces (`tl<pid>-m`, `-w1`, `-w2`, and `-sw` holding
the bridge), links each host to the bridge with a veth pair created inside the
namespaces (nothing is added to the machine's own network), gives them
addresses in 10.201.0.0/24 and deletes everything afterwards. The simulator and
the Locust master run on the master host; each worker is `tokenload run
--worker` on its own host, all sharing one run directory on the filesystem.
The last test gives every host its own directory (records go over Locust's
channel: `tokenload/load/courier.py`) and each worker its own simulator, so
cutting a worker's link cuts only its channel to the master. Needs root and
iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from loadkit import truth_frame, write_scenario

SUBNET = "10.201.0"
MASTER_IP = f"{SUBNET}.1"
SIM_PORT = 18080
MASTER_PORT = 15557


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _cannot_use_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"tl{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"`ip netns add` / bridges do not work here: {getattr(exc, 'stderr', exc)}".strip()
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=10)
    return None


pytestmark = pytest.mark.skipif(bool(_cannot_use_namespaces()), reason=str(_cannot_use_namespaces()))


@contextlib.contextmanager
def hosts() -> Iterator[dict[str, str]]:
    """Three hosts on one private bridge: {"m": ns, "w1": ns, "w2": ns}; the address of host i is SUBNET.i."""
    prefix = f"tl{os.getpid()}"
    names = {role: f"{prefix}-{role}" for role in ("sw", "m", "w1", "w2")}
    try:
        for ns in names.values():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        sw = names["sw"]
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for number, role in enumerate(("m", "w1", "w2"), 1):
            ns = names[role]
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p-{role}", "netns", sw)
            _ip("-n", sw, "link", "set", f"p-{role}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{number}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        yield {role: names[role] for role in ("m", "w1", "w2")}
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=10)


def _in(ns: str, *command: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(["ip", "netns", "exec", ns, *command], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TERM": "dumb"})


def _wait_for_sim(ns: str, timeout_s: float = 20, host: str = MASTER_IP) -> None:
    probe = f"import socket; socket.create_connection(('{host}', {SIM_PORT}), 1)"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        command = ["ip", "netns", "exec", ns, sys.executable, "-c", probe]
        if subprocess.run(command, check=False, capture_output=True, timeout=10).returncode == 0:
            return
        time.sleep(0.3)
    raise AssertionError("the simulator did not come up in the master's namespace")


def _stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


SCENARIO = """
[prompt]
tokens = 32
[output]
max_tokens = 30
ignore_eos = true
[load]
kind = "constant"
users = 4
step_s = {step_s}
[stop]
drain_s = 3
"""


@contextlib.contextmanager
def cluster(tmp_path: Path, step_s: float) -> Iterator[tuple[dict[str, str], dict[str, subprocess.Popen[bytes]]]]:
    """Simulator + master on the master host, one `tokenload run --worker` on each worker host."""
    scenario = write_scenario(tmp_path, SCENARIO.format(step_s=step_s))
    out = tmp_path / "run"
    channel = ["--base-url", f"http://{MASTER_IP}:{SIM_PORT}/api", "--model", "sim-7b"]
    run = [sys.executable, "-m", "tokenload", "run", str(scenario), "--out", str(out), *channel,
           "--master-port", str(MASTER_PORT)]
    with hosts() as ns:
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            procs["sim"] = _in(ns["m"], sys.executable, "-m", "tokenload", "sim", "--profile", "fast", "--host",
                               MASTER_IP, "--port", str(SIM_PORT), "--truth", str(tmp_path / "truth.jsonl"),
                               log=tmp_path / "sim.log")
            _wait_for_sim(ns["m"])
            procs["master"] = _in(ns["m"], *run, "--master", "--master-bind-host", MASTER_IP, "--expect-workers", "2",
                                  log=tmp_path / "master.log")
            for role in ("w1", "w2"):
                procs[role] = _in(ns[role], *run, "--worker", "--master-host", MASTER_IP, log=tmp_path / f"{role}.log")
            yield ns, procs
        finally:
            _stop_all(procs)


def test_master_and_two_workers_on_three_hosts(tmp_path: Path) -> None:
    """One run id, both workers' records merged, as many records as the server saw requests."""
    with cluster(tmp_path, step_s=6) as (_, procs):
        for role in ("master", "w1", "w2"):
            assert procs[role].wait(timeout=90) == 0, (tmp_path / f"{role}.log").read_text()[-3000:]
    out = tmp_path / "run"
    df = pd.read_parquet(out / "requests.parquet")
    truth = truth_frame(tmp_path / "truth.jsonl")
    assert df.run_id.nunique() == 1 and df.worker.nunique() == 2
    assert len(df) == len(truth) > 20 and df.request_id.is_unique
    assert set(df.server_request_id) == set(truth.request_id)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["run_id"] == df.run_id.iloc[0] and manifest["workers_lost"] == []
    assert not (out / "segments").exists()


def test_a_worker_cut_off_mid_run_stops_and_writes_nothing_into_the_finished_run(tmp_path: Path) -> None:
    """Cut one worker's link mid-run: it stops within seconds on its own, the master finishes with the other
    worker, the manifest names the lost one, and the finished run directory never changes afterwards."""
    out = tmp_path / "run"
    with cluster(tmp_path, step_s=14) as (ns, procs):
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and len(list(out.glob("segments/*.arrow"))) < 4:
            time.sleep(0.2)  # both workers have flushed records
        time.sleep(2)
        _ip("-n", ns["w1"], "link", "set", "eth0", "down")
        cut = time.monotonic()
        assert procs["w1"].wait(timeout=30) is not None
        w1_stopped_after = time.monotonic() - cut
        assert procs["master"].wait(timeout=60) == 1, (tmp_path / "master.log").read_text()[-3000:]
        master_done_after = time.monotonic() - cut
        assert procs["w2"].wait(timeout=30) == 0
        finished = hashlib.sha256((out / "requests.parquet").read_bytes()).hexdigest()
        listing = sorted(p.name for p in out.iterdir())
        time.sleep(3)
        assert hashlib.sha256((out / "requests.parquet").read_bytes()).hexdigest() == finished
        assert sorted(p.name for p in out.iterdir()) == listing
    assert w1_stopped_after < 15, w1_stopped_after  # Locust's own limit is 60 s without the master
    assert master_done_after < 40, master_done_after
    assert "segments" not in listing and "segments.sealed" not in listing
    df = pd.read_parquet(out / "requests.parquet")
    assert df.run_id.nunique() == 1 and df.request_id.is_unique
    manifest = json.loads((out / "manifest.json").read_text())
    (lost,) = manifest["workers_lost"]
    assert df.worker.nunique() == 2 and lost in set(df.worker)
    assert any("no heartbeat from the Locust master" in w for w in manifest["warnings"]), manifest["warnings"]
    survivor = df[df.worker != lost]
    # After the master noticed (about 3 s), the survivor's records carry the 2 users still running.
    assert survivor.active_users.iloc[-5:].eq(2).all(), survivor.active_users.value_counts()


def test_a_worker_cut_off_for_10_s_delivers_every_record_over_the_channel(tmp_path: Path) -> None:
    """No shared directory; one worker's link to the master down for 10 s, then up again: the master's run holds
    every request each worker's own simulator saw, once; the cut worker stopped early but its spool emptied."""
    scenario = write_scenario(tmp_path, SCENARIO.format(step_s=40))
    local_sim = ["--base-url", f"http://127.0.0.1:{SIM_PORT}/api", "--model", "sim-7b"]
    run = [sys.executable, "-m", "tokenload", "run", str(scenario), *local_sim, "--master-port", str(MASTER_PORT)]
    a = tmp_path / "A"
    with hosts() as ns:
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for role in ("w1", "w2"):
                procs[f"sim-{role}"] = _in(ns[role], sys.executable, "-m", "tokenload", "sim", "--profile", "fast",
                                           "--host", "127.0.0.1", "--port", str(SIM_PORT), "--truth",
                                           str(tmp_path / f"truth-{role}.jsonl"), log=tmp_path / f"sim-{role}.log")
                _wait_for_sim(ns[role], host="127.0.0.1")
            procs["master"] = _in(ns["m"], *run, "--out", str(a), "--master", "--master-bind-host", MASTER_IP,
                                  "--expect-workers", "2", log=tmp_path / "master.log")
            for role in ("w1", "w2"):
                procs[role] = _in(ns[role], *run, "--out", str(tmp_path / role), "--worker", "--master-host",
                                  MASTER_IP, log=tmp_path / f"{role}.log")
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and len(list(a.glob("segments/*.arrow"))) < 6:
                time.sleep(0.2)  # both workers' batches are arriving
            _ip("-n", ns["w1"], "link", "set", "eth0", "down")
            time.sleep(10)
            _ip("-n", ns["w1"], "link", "set", "eth0", "up")
            for role in ("w1", "w2", "master"):
                assert procs[role].wait(timeout=120) is not None
        finally:
            _stop_all(procs)
    master_log = (tmp_path / "master.log").read_text()[-3000:]
    assert procs["master"].returncode == 1, master_log  # a worker stopped early: the run says so
    manifest = json.loads((a / "manifest.json").read_text())
    (lost,) = manifest["workers_lost"]
    df = pd.read_parquet(a / "requests.parquet")
    truth = pd.concat([truth_frame(tmp_path / f"truth-{role}.jsonl") for role in ("w1", "w2")])
    assert df.request_id.is_unique and df.run_id.nunique() == 1 and df.worker.nunique() == 2
    assert len(df) == len(truth) > 100
    named = set(df.server_request_id.dropna())
    assert named <= set(truth.request_id) and len(named) == df.server_request_id.notna().sum()
    # The cut worker stopped its users at once: a stream cut before its headers arrived has a record with no
    # server id, and the server saw the client close it. Nothing else is unmatched.
    unnamed, unseen = df[df.server_request_id.isna()], truth[~truth.request_id.isin(named)]
    assert len(unnamed) == len(unseen) and (unseen.outcome == "client_closed").all()
    assert (unnamed.status == "cancelled").all() and unnamed.in_flight.all()
    assert manifest["records"]["per_worker"] == manifest["records"]["written_per_worker"]
    assert not any("did not arrive" in w for w in manifest["warnings"]), manifest["warnings"]
    for role in ("w1", "w2"):
        assert list((tmp_path / role).rglob("*.arrow")) == []  # every batch acknowledged
        assert not list((tmp_path / role).rglob("requests.parquet"))
    assert lost in set(df.worker) and set(unnamed.worker) <= {lost}
    assert manifest["records"]["courier"][lost]["duplicate_records"] > 0  # sent again during the cut, kept once
