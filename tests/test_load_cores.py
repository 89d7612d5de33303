"""`--processes auto` and the client-bottleneck warning, over real Locust against the simulator (issue 15).

A client is made the bottleneck by pinning `tokenload run` (and so every Locust
process it starts) to one core with `taskset` and giving it hundreds of
streams; the advice must match the cores the run could use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from loadkit import run_command, write_scenario
from tokenload.sim import launch

SHORT = """
[prompt]
tokens = 16
[output]
max_tokens = 20
[load]
kind = "constant"
users = 2
step_s = 60
[stop]
drain_s = 2
"""

SATURATED = """
[prompt]
tokens = 16
[output]
max_tokens = 400
ignore_eos = true
[load]
kind = "constant"
users = {users}
step_s = 60
[stop]
drain_s = 2
"""

needs_taskset = pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")


def _run(tmp_path: Path, body: str, base_url: str, *extra: str, cores: str | None = None,
         timeout: float = 90) -> subprocess.CompletedProcess[str]:
    command = run_command(write_scenario(tmp_path, body), base_url, tmp_path / "run", *extra)
    if cores is not None:
        command = ["taskset", "-c", cores, *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, "TERM": "dumb"})


@needs_taskset
@pytest.mark.parametrize("cores", [None, "0"])
def test_processes_auto_uses_the_cores_there_are(tmp_path: Path, cores: str | None) -> None:
    """auto = one worker per usable core; on one core it is a single process (no master beside one worker)."""
    usable = 1 if cores else len(os.sched_getaffinity(0))
    with launch(["--profile", "fast"]) as sim:
        result = _run(tmp_path, SHORT, sim.base_url, "--processes", "auto", "--duration", "4", cores=cores)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    workers = sorted(manifest["records"]["written_per_worker"])
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert (df.status == "ok").sum() >= 2
    if usable == 1:
        assert workers == ["local"], workers
    else:
        assert len(workers) == usable and "local" not in workers, workers
        assert set(df.worker) <= set(workers)


@needs_taskset
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to tell the two pieces of advice apart")
@pytest.mark.parametrize("cores", [None, "0"])
def test_a_saturated_client_warns_live_with_advice_that_can_help(tmp_path: Path, cores: str | None) -> None:
    """600 streams in one process: the live line warns (healthy responses), and its advice fits the cores.

    One process on several cores: `--processes auto` helps. One process on its only core: more processes
    cannot help, so the advice is more cores or fewer users, never `--processes`.
    """
    with launch(["--profile", "fast"]) as sim:
        result = _run(tmp_path, SATURATED.format(users=600), sim.base_url, "--duration", "10", cores=cores)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    lag = manifest["scheduler_lag"]
    assert lag["client_bound"] and lag["ok_share"] >= 0.5 and lag["worst_p99_s"] > lag["warn_p99_s"], lag
    text = " ".join(result.stderr.split())
    assert "WARNING (live): the load generator was the bottleneck" in text, result.stderr[-2000:]
    warning = next(w for w in manifest["warnings"] if "bottleneck" in w)
    if cores is None:
        assert "Use --processes auto" in warning and "fewer users per process" in warning, warning
    else:
        assert "more --processes cannot help" in warning and "at least 1 more core" in warning, warning
