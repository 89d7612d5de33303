"""Helpers shared by the load tests: scenario files, the CLI command, a whole run against the simulator and what
it left (records, manifest, summary, the simulator's truth), the body readers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from tokenload.analysis import analyze_run
from tokenload.sim import launch
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


@dataclass
class SimRun:
    """One `tokenload run` against a fresh simulator, and what it left; the files are read when first asked for."""

    result: subprocess.CompletedProcess[str]
    run_dir: Path
    truth_path: Path
    wall_s: float

    @cached_property
    def records(self) -> pd.DataFrame:
        return pd.read_parquet(self.run_dir / "requests.parquet")

    @cached_property
    def truth(self) -> pd.DataFrame:
        """The simulator's truth file (empty when it saw no request)."""
        present = self.truth_path.exists() and self.truth_path.stat().st_size > 0
        return truth_frame(self.truth_path) if present else pd.DataFrame()

    @cached_property
    def manifest(self) -> dict[str, Any]:
        return dict(json.loads((self.run_dir / "manifest.json").read_text()))

    @cached_property
    def summary(self) -> dict[str, Any]:
        """The analysis of the run directory (`tokenload analyze`'s summary.json), computed in this process."""
        return dict(analyze_run(self.run_dir))


def sim_run(tmp_path: Path, scenario: str | Path, *extra: str, sim_args: Sequence[str] = (), ok: bool = True,
            base_url: str | None = None, timeout: float = 120, **kw: str) -> SimRun:
    """`tokenload run` of `scenario` (a path, or a TOML body written to a file) against a fresh `tokenload sim
    --truth`, with `sim_args` for the simulator and `extra` for the run; `ok` asserts the run exited 0.

    `base_url` points the run elsewhere (a relay in front of the simulator, say); the simulator still starts."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = scenario if isinstance(scenario, Path) else write_scenario(tmp_path, scenario)
    truth = tmp_path / "truth.jsonl"
    started = time.monotonic()
    with launch([*sim_args, "--truth", str(truth)]) as sim:
        result = run_cli(path, base_url or sim.base_url, tmp_path / "run", *extra, timeout=timeout, **kw)
    wall = time.monotonic() - started
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return SimRun(result, tmp_path / "run", truth, wall)


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


def truth_tokens_in(truth: pd.DataFrame, start: float, end: float) -> float:
    """Output tokens the simulator wrote inside [start, end), each stream spread evenly over its span."""
    rows = truth.dropna(subset=["first_token", "last_token"])
    total = 0.0
    for first, last, n in zip(rows.first_token, rows.last_token, rows.output_tokens):
        if last > first:
            total += n * max(0.0, min(last, end) - max(first, start)) / (last - first)
        elif start <= first < end:
            total += n
    return total


def assert_throughput_matches_truth(summary: dict, truth: pd.DataFrame) -> None:
    """Each step's window throughput and completions are what the simulator wrote in that window."""
    for step in summary["steps"]:
        width = step["end"] - step["start"]
        expected = truth_tokens_in(truth, step["start"], step["end"]) / width
        assert step["output_tok_s"] == pytest.approx(expected, rel=0.05), step
        # Completions count where they ended (the server's last token; the client sees it ms later); a stream
        # the client cut (outcome client_closed) never completed.
        done = truth[truth["outcome"].eq("ok")] if "outcome" in truth else truth
        ended = done.last_token.between(step["start"], step["end"], inclusive="left").sum()
        assert abs(step["rps"] * width - ended) <= 2, (step["rps"] * width, ended)
        assert step["goodput_rps"] <= step["rps"] + 1e-9
