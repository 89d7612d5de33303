"""Records over Locust's channel: a master and a worker with nothing on disk in common.

Real Locust processes on loopback against the simulator with its truth file:
the worker's `--out` is only its spool; every record reaches the master's run
directory once, also when an acknowledgement is lost and the worker sends a
batch again. Streams last about 2 s, so at the end of the plan the worker
drains its users for longer than Locust's master listens after its quit: the
last batches come in while the master waits for them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from loadkit import free_port, run_command, truth_frame, write_scenario

from tokenload.sim import launch

pytestmark = pytest.mark.slow

SCENARIO = """
[channel]
model = "sim-7b"
[prompt]
tokens = 16
[output]
max_tokens = 80
ignore_eos = true
[load]
kind = "constant"
users = 3
step_s = 6
[stop]
drain_s = 5
"""


def _master_and_worker(tmp_path: Path, master_command: Callable[[Path, str, str], list[str]],
                       scenario_text: str = SCENARIO, master_env: dict[str, str] | None = None) -> pd.DataFrame:
    """Run a master (`master_command(scenario, base_url, port)`, run directory A, `master_env` added to its
    environment) and `tokenload run --worker --out B` against the simulator; A's records, checked against its truth
    file."""
    scenario = write_scenario(tmp_path, scenario_text)
    port = str(free_port())
    truth_path = tmp_path / "truth.jsonl"
    with launch(["--truth", str(truth_path)]) as sim:
        master = subprocess.Popen(master_command(scenario, sim.base_url, port), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                                  env={**{k: v for k, v in os.environ.items() if not k.startswith("TOKENLOAD_")},
                                       **(master_env or {})})
        worker = subprocess.run(run_command(scenario, sim.base_url, tmp_path / "B", "--worker", "--master-port", port),
                                capture_output=True, text=True, timeout=60)
        m_out, _ = master.communicate(timeout=60)
    assert worker.returncode == 0, worker.stderr
    assert master.returncode == 0, m_out
    return _records_match_truth(tmp_path / "A", truth_path)


def _records_match_truth(run_dir: Path, truth_path: Path) -> pd.DataFrame:
    df = pd.read_parquet(run_dir / "requests.parquet")
    truth = truth_frame(truth_path)
    assert len(truth) > 5
    assert df.request_id.is_unique and df.server_request_id.is_unique
    assert sorted(df.server_request_id) == sorted(truth.request_id)
    assert (df.status == "ok").all() and df.run_id.nunique() == 1
    return df


def _no_finished_run(out: Path) -> None:
    names = {p.name for p in out.rglob("*")}
    assert not names & {"requests.parquet", "manifest.json", "summary.json", "segments.sealed"}
    assert not (out / "segments").exists()


def test_master_and_worker_share_no_directory(tmp_path: Path) -> None:
    """Master --out A, worker --out B: A holds exactly the server's requests once each; B no run."""
    a, b = tmp_path / "A", tmp_path / "B"
    df = _master_and_worker(tmp_path, lambda scenario, base_url, port: run_command(
        scenario, base_url, a, "--master", "--master-port", port))
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["run_id"] == df.run_id.iloc[0] and manifest["workers_lost"] == []
    assert not [w for w in manifest["warnings"] if "worker" in w and "bottleneck" not in w]
    (name, courier), = manifest["records"]["courier"].items()
    assert manifest["records"]["per_worker"] == {name: len(df)}
    assert courier["batches"] > 2 and courier["duplicate_records"] == 0
    _no_finished_run(b)
    # The spool (courier.SPOOL_DIR; importing Locust here would monkey-patch pytest): every batch acknowledged.
    assert list((b / "spool").rglob("*.arrow")) == []


def _lossy_master(a: Path) -> Callable[[Path, str, str], list[str]]:
    """The command of a Locust master that loses acknowledgements (tests/lossy_master.py), run directory `a`."""
    return lambda scenario, base_url, port: [
        sys.executable, "-m", "locust", "-f", str(Path(__file__).with_name("lossy_master.py")), "--headless",
        "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", port, "--expect-workers", "1",
        "--scenario", str(scenario), "--run-dir", str(a), "--host", base_url]


def test_a_batch_sent_twice_is_kept_once(tmp_path: Path) -> None:
    """The master drops its first acknowledgement: the worker sends that batch again, the run keeps one copy."""
    a, b = tmp_path / "A", tmp_path / "B"
    _master_and_worker(tmp_path, _lossy_master(a))
    (courier,) = json.loads((a / "manifest.json").read_text())["records"]["courier"].values()
    assert courier["duplicate_records"] > 0
    _no_finished_run(b)


def test_resends_back_off_while_the_master_is_unreachable(tmp_path: Path) -> None:
    """The master acknowledges nothing for 12 s from its first batch (to the worker, a master it cannot reach): the
    worker's first batch comes again after 3 s and then 6 s later (3 copies in those 12 s, where a fixed 3 s period
    sends 5), and once acknowledgements flow again every record is in, once, and the spool is empty."""
    a, b = tmp_path / "A", tmp_path / "B"
    df = _master_and_worker(tmp_path, _lossy_master(a), SCENARIO.replace("step_s = 6", "step_s = 16"),
                            {"LOSSY_MASTER_MUTE_S": "12"})
    copies = json.loads((tmp_path / "acks.json").read_text())["0"]  # seconds since the first batch, per copy
    muted = [t for t in copies if t < 12]
    assert 2 <= len(muted) <= 3, copies  # resent, but backing off: 0, ~3, ~9 s (the next at ~21 s, or at an ack)
    (courier,) = json.loads((a / "manifest.json").read_text())["records"]["courier"].values()
    assert courier["duplicate_records"] > 0 and len(df) > 5
    _no_finished_run(b)
    assert list((b / "spool").rglob("*.arrow")) == []


def test_an_acknowledged_state_frees_every_batch_it_counts(tmp_path: Path) -> None:
    """The master drops every acknowledgement of a batch and passes those of the worker's state: the state is
    written only once every batch it counts has arrived, so its acknowledgement frees them all. Before, the worker
    sent those batches to a master that had finalised and gone, for its 30 s settle, and left them in its spool
    (CI: a master that finalised between the end of its mute and the worker's next copy)."""
    a, b = tmp_path / "A", tmp_path / "B"
    _master_and_worker(tmp_path, _lossy_master(a), master_env={"LOSSY_MASTER_STATE_ONLY": "1"})
    assert json.loads((tmp_path / "acks.json").read_text())  # batches came, their acknowledgements were dropped
    _no_finished_run(b)
    assert list((b / "spool").rglob("*.arrow")) == []


def test_a_worker_killed_mid_run_is_named_and_the_run_is_finalised(tmp_path: Path) -> None:
    """SIGKILL the worker's Locust process: the master's finalise waits its bounded time, then keeps what arrived
    and names the worker whose last batches never came, in warnings and workers_lost."""
    scenario = write_scenario(tmp_path, SCENARIO.replace("step_s = 6", "step_s = 20"))
    port = str(free_port())
    truth_path = tmp_path / "truth.jsonl"
    a, b = tmp_path / "A", tmp_path / "B"
    with launch(["--truth", str(truth_path)]) as sim:
        master = subprocess.Popen(run_command(scenario, sim.base_url, a, "--master", "--master-port", port),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        worker = subprocess.Popen(run_command(scenario, sim.base_url, b, "--worker", "--master-port", port),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        state: dict = {}
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and state.get("records", 0) < 3:  # the master has some of its records
            paths = list((a / "segments").glob("*.state.json"))
            state = json.loads(paths[0].read_text()) if paths else {}
            time.sleep(0.2)
        os.kill(state["pid"], signal.SIGKILL)  # the worker's Locust process, on this machine
        _, m_err = master.communicate(timeout=90)
        worker.communicate(timeout=30)
    assert master.returncode == 1, m_err
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["workers_lost"] == [state["worker"]]
    (warning,) = [w for w in manifest["warnings"] if "did not arrive over Locust's channel" in w]
    assert state["worker"] in warning and "spool" in warning
    df = pd.read_parquet(a / "requests.parquet")
    assert df.request_id.is_unique and len(df) >= 3
    assert set(df.server_request_id.dropna()) <= set(truth_frame(truth_path).request_id)
    _no_finished_run(b)
