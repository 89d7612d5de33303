"""Workloads that look like real traffic: multi-turn sessions, prompt caching, datasets, traces, arrivals, warm-up.

Every test drives the real simulator over loopback (through `tokenload run` and
real Locust where load is involved) and checks the records against the
simulator's truth file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from loadkit import run_cli, truth_frame, write_scenario

from tokenload.sim import launch

SESSION_SCENARIO = """
[session]
turns = 3
user_tokens = 50
system_tokens = 300
cache_control = {cache}
[output]
max_tokens = 20
ignore_eos = true
[load]
kind = "constant"
users = 2
step_s = {step_s}
[stop]
drain_s = 5
"""


def _run(tmp_path: Path, body: str, *extra: str, profile: str = "fast", sim_args: tuple[str, ...] = ()
         ) -> tuple[pd.DataFrame, pd.DataFrame, Path]:
    """Run a scenario against a fresh simulator; (records, truth, run dir)."""
    scenario = write_scenario(tmp_path, body)
    truth_path = tmp_path / "truth.jsonl"
    with launch(["--profile", profile, "--truth", str(truth_path), *sim_args]) as sim:
        result = run_cli(scenario, sim.base_url, tmp_path / "run", *extra)
    assert result.returncode == 0, result.stderr
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    return pd.read_parquet(run_dir / "requests.parquet"), truth_frame(truth_path), run_dir


def _complete_sessions(df: pd.DataFrame, turns: int) -> pd.DataFrame:
    """Rows of sessions that ran all their turns, sorted by session and turn."""
    counts = df.groupby("session_id")["turn"].transform("count")
    return df[counts == turns].sort_values(["session_id", "turn"])


@pytest.mark.parametrize("protocol", ["anthropic", "openai-chat", "openai-responses"])
def test_session_context_grows_by_each_answer_and_message(tmp_path: Path, protocol: str) -> None:
    """Turn k+1 resends turn k's context plus its answer (20 tokens) and a new 50-token message."""
    df, truth, _ = _run(tmp_path, SESSION_SCENARIO.format(cache="false", step_s=2), "--protocol", protocol)
    assert (df.status == "ok").all(), df.error_message.dropna().unique()
    sessions = _complete_sessions(df, 3)
    assert sessions.session_id.nunique() >= 4
    assert sessions.groupby("session_id").turn.apply(list).map(lambda t: t == [1, 2, 3]).all()
    first = sessions[sessions.turn == 1]
    assert (first.context_tokens == 300 + 50).all()
    growth = sessions.groupby("session_id").context_tokens.diff().dropna()
    assert (growth == 50 + 20).all()
    joined = df.merge(truth, left_on="server_request_id", right_on="request_id", suffixes=("", "_truth"))
    assert len(joined) == len(df)
    assert (joined.input_tokens_truth == joined.context_tokens).all()  # the server saw the whole history
    assert (joined.input_tokens == joined.input_tokens_truth).all()


def test_session_rejects_prompt_tokens(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, "[prompt]\ntokens = 100\n[session]\nturns = 2\n[load]\nkind = \"constant\"\n")
    result = subprocess.run([sys.executable, "-m", "tokenload", "run", str(scenario), "--base-url",
                             "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tokenload: error: scenario.toml: [prompt] tokens: a [session] scenario draws its messages from [session] "
        "user_tokens and system_tokens; remove this key"]
