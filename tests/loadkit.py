"""Helpers shared by the load tests: scenario files, the CLI command, the truth file, the body readers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tokenload.transport.reader import compiled

# The load transport's two body readers: the compiled core (where `pip install` built it) and the
# pure-Python fallback; a child process picks one with `reader_env`.
READERS = ["pure", pytest.param("compiled", marks=pytest.mark.skipif(not compiled(), reason="core not built here"))]


def reader_env(reader: str) -> dict[str, str]:
    """The environment of a child process that reads bodies with `reader`."""
    return {**os.environ, "TOKENLOAD_PURE_PYTHON": "1" if reader == "pure" else "0"}


def write_scenario(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "scenario.toml"
    path.write_text(body)
    return path


def run_command(scenario: Path, base_url: str, out: Path, *extra: str, model: str = "sim-7b") -> list[str]:
    return [sys.executable, "-m", "tokenload", "run", str(scenario), "--base-url", base_url, "--model", model,
            "--out", str(out), *extra]


def run_cli(scenario: Path, base_url: str, out: Path, *extra: str, model: str = "sim-7b",
            timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`tokenload run` to completion, with a dumb terminal so no live line decorates stderr."""
    return subprocess.run(run_command(scenario, base_url, out, *extra, model=model), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TERM": "dumb"})


def truth_frame(path: Path) -> pd.DataFrame:
    """The simulator's truth file as a frame, one row per request it saw."""
    return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_master_and_worker(scenario: Path, base_url: str, master_out: Path, worker_out: Path,
                          timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """`tokenload run --master` and one `--worker` as on two machines (two processes on loopback), to completion."""
    port = str(free_port())
    master = subprocess.Popen(run_command(scenario, base_url, master_out, "--master", "--master-port", port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker = subprocess.run(run_command(scenario, base_url, worker_out, "--worker", "--master-port", port),
                                capture_output=True, text=True, timeout=timeout)
        out, err = master.communicate(timeout=timeout)
    finally:
        master.kill()
    return subprocess.CompletedProcess(master.args, master.returncode, out, err), worker
