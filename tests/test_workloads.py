"""Workloads that look like real traffic: multi-turn sessions, prompt caching, datasets, traces, arrivals, warm-up.

Every test drives the real simulator over loopback (through `tokenload run` and
real Locust where load is involved) and checks the records against the
simulator's truth file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from loadkit import sim_run, write_scenario

from tokenload.protocolspec import PROTOCOLS

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
    """Run a scenario against a fresh simulator with `profile`; (records, truth, run dir)."""
    run = sim_run(tmp_path, body, *extra, sim_args=["--profile", profile, *sim_args])
    return run.records, run.truth, run.run_dir


def _complete_sessions(df: pd.DataFrame, turns: int) -> pd.DataFrame:
    """Rows of sessions that ran all their turns, sorted by session and turn."""
    counts = df.groupby("session_id")["turn"].transform("count")
    return df[counts == turns].sort_values(["session_id", "turn"])


@pytest.mark.parametrize("protocol", PROTOCOLS)
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


CACHE_SCENARIO = """
[session]
turns = 3
user_tokens = 100
system_tokens = 1500
cache_control = true
[output]
max_tokens = 8
ignore_eos = true
[load]
kind = "constant"
users = 2
step_s = 3
[stop]
drain_s = 5
"""


def _caching(run_dir: Path) -> dict[str, Any]:
    from tokenload.analysis import analyze_run

    return analyze_run(run_dir, write=False)["caching"]


Run = tuple[pd.DataFrame, pd.DataFrame, Path]  # records, truth, run directory


@pytest.fixture(scope="module")
def cache_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """CACHE_SCENARIO against the caching `default` profile, run once per protocol in this module: the tests
    below only read its records, truth and run directory (the anthropic run serves two of them)."""
    done: dict[str, Run] = {}

    def run(protocol: str) -> Run:
        if protocol not in done:
            done[protocol] = _run(tmp_path_factory.mktemp(f"cache-{protocol}"), CACHE_SCENARIO, "--protocol",
                                  protocol, profile="default")
        return done[protocol]

    return run


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cache_hit_ratio_matches_truth_and_cached_requests_start_sooner(
        cache_run: Callable[[str], Run], protocol: str) -> None:
    """The shared system prompt and each session's history are read from the simulator's prefix cache."""
    df, truth, run_dir = cache_run(protocol)
    assert (df.status == "ok").all()
    joined = df.merge(truth, left_on="server_request_id", right_on="request_id", suffixes=("", "_truth"))
    assert len(joined) == len(df)
    assert (joined.cache_read_input_tokens == joined.cached_tokens).all()
    if protocol == "anthropic":
        assert (joined.cache_creation_input_tokens == joined.cache_creation_tokens).all()
    caching = _caching(run_dir)
    truth_ratio = joined.cached_tokens.sum() / joined.input_tokens_truth.sum()
    assert truth_ratio > 0.5
    assert caching["hit_ratio"] == pytest.approx(truth_ratio, rel=1e-3)
    assert caching["honoured"] is True and caching["verdict"].startswith("honoured")
    later = df[df.turn > 1]
    assert len(later) >= 4 and (later.cache_read_input_tokens >= later.context_tokens - 100 - 8 - 16).all()
    assert caching["ttft_p50_cached_s"] < 0.5 * caching["ttft_p50_uncached_s"]


def test_caching_stripped_channel_is_not_honoured_and_pays_full_prefill(
        tmp_path: Path, cache_run: Callable[[str], Run]) -> None:
    stripped, truth, run_dir = _run(tmp_path / "stripped", CACHE_SCENARIO, profile="nocache")
    assert (stripped.status == "ok").all() and (stripped.cache_read_input_tokens == 0).all()
    assert (truth.cached_tokens == 0).all()
    caching = _caching(run_dir)
    assert caching["honoured"] is False and caching["hit_ratio"] == 0
    assert caching["verdict"].startswith("NOT honoured")
    cached, _, _ = cache_run("anthropic")  # the same scenario against the caching channel
    later_ttft = {name: df[df.turn > 1].ttft_s.median() for name, df in (("stripped", stripped), ("cached", cached))}
    assert later_ttft["cached"] < 0.5 * later_ttft["stripped"]


@pytest.mark.parametrize(("profile", "status"), [("default", "ok"), ("nocache", "fail")])
def test_doctor_caching_check(tmp_path: Path, profile: str, status: str) -> None:
    from tokenload.doctor import Limits, diagnose_channel
    from tokenload.sim import serve_in_thread

    home = tmp_path / "home"
    home.mkdir()
    with serve_in_thread(profile) as sim:
        flags = {"protocol": "anthropic", "base_url": sim.base_url, "api_key": None, "auth_token": None,
                 "model": "sim-7b", "settings": None}
        results, _ = diagnose_channel(flags=flags, env={}, cwd=tmp_path, home=home, limits=Limits(timeout_s=10))
    caching = {r.name: r for r in results}["caching"]
    assert caching.status == status, caching.saw
    if status == "ok":
        assert caching.details["cache_read_second"] > 0
        assert caching.details["ttft_second_s"] < caching.details["ttft_first_s"]
    else:
        assert caching.details["cache_read_second"] == 0 and "read 0 tokens from the cache" in caching.saw
        assert "cache_control" in (caching.fix or "")


def test_coding_session_is_packaged_and_documented() -> None:
    from tokenload.workload.scenario import load_scenario

    scenario = load_scenario("coding-session")
    assert scenario.session is not None and scenario.session.cache_control and scenario.session.system_tokens >= 2048
    scenarios_doc = (Path(__file__).parents[1] / "docs" / "scenarios.md").read_text()
    assert "`coding-session`" in scenarios_doc and "tokenload run coding-session" in scenarios_doc


# ------------------------------------------------------------------------------------------- datasets

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "first question"},
                                  {"from": "gpt", "value": "an answer of six words here"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q one"},
                                  {"from": "gpt", "value": "a one"}, {"from": "human", "value": "q two"}]},
]
DATASET_LINES = {
    "plain.jsonl": ['{"prompt": "plain prompt text", "max_tokens": 7}', '{"text": "other text"}'],
    "openai.jsonl": ['{"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}, '
                     '{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"}], '
                     '"output_tokens": 5}'],
    "anthropic.jsonl": ['{"system": [{"type": "text", "text": "sys"}], "messages": [{"role": "user", "content": '
                        '[{"type": "text", "text": "block text"}]}]}'],
}


def test_each_dataset_format_loads(tmp_path: Path) -> None:
    from tokenload.workload.datasets import load_dataset

    for name, lines in DATASET_LINES.items():
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    (tmp_path / "sharegpt.json").write_text(json.dumps(SHAREGPT, indent=1))
    plain = load_dataset(str(tmp_path / "plain.jsonl"))
    assert [(r.conversation.messages, r.max_tokens) for r in plain] == [
        ((("user", "plain prompt text"),), 7), ((("user", "other text"),), None)]
    (chat,) = load_dataset(str(tmp_path / "openai.jsonl"))
    assert chat.conversation.system == "sys" and chat.max_tokens == 5
    assert chat.conversation.messages == (("user", "hi"), ("assistant", "hello there"), ("user", "more"))
    (anthropic,) = load_dataset(str(tmp_path / "anthropic.jsonl"))
    assert anthropic.conversation.system == "sys" and anthropic.conversation.messages == (("user", "block text"),)
    first, second = load_dataset(str(tmp_path / "sharegpt.json"))
    assert first.conversation.messages == (("user", "first question"),) and first.max_tokens == 6  # the reply's length
    assert second.conversation.system == "be brief" and second.max_tokens is None
    assert second.conversation.messages == (("user", "q one"), ("assistant", "a one"), ("user", "q two"))


@pytest.mark.parametrize(("name", "text", "where", "problem"), [
    ("bad.jsonl", '{"prompt": "ok"}\n{"prompt": "fine"}\n{"messages": [{"role": "robot", "content": "x"}]}\n',
     "line 3", "message 1: expected an object with 'role' one of"),
    ("bad.jsonl", '{"prompt": "ok"}\n{"prompt": \n', "line 2", "not valid JSON"),
    ("bad.jsonl", '{"prompt": "ok", "max_tokens": 0}\n', "line 1", "max_tokens / output_tokens must be an integer >= 1"),
    ("bad.json", '[{"conversations": [{"from": "gpt", "value": "only the bot"}]}]', "item 1",
     "no non-empty user message"),
])
def test_malformed_dataset_is_one_line_naming_file_and_line_exit_2(tmp_path: Path, name: str, text: str, where: str,
                                                                    problem: str) -> None:
    (tmp_path / name).write_text(text)
    scenario = write_scenario(tmp_path, f'[prompt]\ndataset = "{name}"\n[load]\nkind = "constant"\n')
    result = subprocess.run([sys.executable, "-m", "tokenload", "run", str(scenario), "--base-url",
                             "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"dataset {tmp_path / name} {where}: {problem}" in line and "Traceback" not in result.stderr


def test_dataset_order_shuffle_is_seeded(tmp_path: Path) -> None:
    from tokenload.workload.prompts import PromptSource
    from tokenload.workload.scenario import load_scenario

    (tmp_path / "d.jsonl").write_text("".join(f'{{"prompt": "row {i}"}}\n' for i in range(20)))

    def order(extra: str, seed: int = 1) -> list[str]:
        path = write_scenario(tmp_path, f'seed = {seed}\n[prompt]\ndataset = "d.jsonl"\n{extra}\n[load]\n'
                                        'kind = "constant"\n')
        source = PromptSource(load_scenario(path), ("sim-7b",), salt=3)
        return [source.next().prompt.split("] ", 1)[1] for _ in range(20)]

    assert order("") == [f"row {i}" for i in range(20)]
    shuffled = order('order = "shuffle"')
    assert sorted(shuffled) == sorted(order("")) and shuffled != order("")
    assert order('order = "shuffle"') == shuffled and order('order = "shuffle"', seed=2) != shuffled


def test_dataset_rows_replay_with_history_and_their_output_length(tmp_path: Path) -> None:
    """The packaged coding dataset through `tokenload run`: the server sees each row's whole history."""
    from tokenload.workload.datasets import load_dataset
    from tokenload.workload.scenario import packaged_file

    df, truth, _ = _run(tmp_path, """
[prompt]
dataset = "coding-dataset.jsonl"
[output]
ignore_eos = true
[load]
kind = "constant"
users = 2
step_s = 2
[stop]
max_requests = 12
drain_s = 5
""")
    assert 4 <= len(df) <= 12 and (df.status == "ok").all()
    rows = load_dataset(str(packaged_file("coding-dataset.jsonl")))
    assert set(df.max_tokens) <= {r.max_tokens for r in rows}
    assert (df.output_tokens == df.max_tokens).all()
    joined = df.merge(truth, left_on="server_request_id", right_on="request_id", suffixes=("", "_truth"))
    assert (joined.input_tokens_truth == joined.context_tokens).all()
    assert joined.context_tokens.max() > 1000  # system prompt and history included


def test_coding_dataset_is_generated_by_its_script() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "scenarios"))
    try:
        import make_coding_dataset
    finally:
        sys.path.pop(0)
    assert make_coding_dataset.OUT.read_text(encoding="utf-8") == make_coding_dataset.render()


# ---------------------------------------------------------------------------------------------- traces

BURSTGPT_CSV = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5.0,ChatGPT,40,6,46,Conversation log
5.3,ChatGPT,120,4,124,Conversation log
5.9,GPT-4,64,8,72,Conversation log
6.0,ChatGPT,30,3,33,Conversation log
7.2,ChatGPT,200,5,205,Conversation log
8.0,GPT-4,16,2,18,Conversation log
"""


def test_trace_replay_at_speed_2_sends_each_request_at_half_its_offset(tmp_path: Path) -> None:
    (tmp_path / "burst.csv").write_text(BURSTGPT_CSV)
    df, truth, run_dir = _run(tmp_path, """
[output]
ignore_eos = true
[load]
kind = "trace"
trace = "burst.csv"
speed = 2
max_users = 8
[stop]
drain_s = 5
""")
    assert len(df) == 6 and (df.status == "ok").all()
    df = df.sort_values("scheduled_at")
    offsets = (df.scheduled_at - df.scheduled_at.iloc[0]).to_numpy()
    assert offsets == pytest.approx([0.0, 0.15, 0.45, 0.5, 1.1, 1.5], abs=1e-3)
    assert df.input_tokens.tolist() == [40, 120, 64, 30, 200, 16]  # the simulator counts what we send exactly
    assert df.max_tokens.tolist() == df.output_tokens.tolist() == [6, 4, 8, 3, 5, 2]
    lateness = json.loads((run_dir / "manifest.json").read_text())["open_loop_lateness"]
    assert lateness["p99_s"] < 0.25 and (df.late_s < 0.25).all()  # generous: the machine is shared


def test_trace_formats_gaps_and_units(tmp_path: Path) -> None:
    from tokenload.workload.traces import TraceRow, load_trace

    (tmp_path / "gaps.jsonl").write_text('{"interval_s": 0, "input_tokens": 5, "output_tokens": 1}\n'
                                         '{"interval_s": 0.25, "input_tokens": 6, "output_tokens": 2}\n')
    (tmp_path / "mooncake.jsonl").write_text('{"timestamp": 1500, "input_length": 9, "output_length": 3}\n'
                                             '{"timestamp": 0, "input_length": 7, "output_length": 4}\n')
    assert load_trace(str(tmp_path / "gaps.jsonl")) == (TraceRow(0.0, 5, 1), TraceRow(0.25, 6, 2))
    with pytest.raises(Exception, match="lies before the first row"):
        load_trace(str(tmp_path / "mooncake.jsonl"), "ms")
    (tmp_path / "mooncake.jsonl").write_text('{"timestamp": 0, "input_length": 7, "output_length": 4}\n'
                                             '{"timestamp": 1500, "input_length": 9, "output_length": 3}\n')
    assert load_trace(str(tmp_path / "mooncake.jsonl"), "ms") == (TraceRow(0.0, 7, 4), TraceRow(1.5, 9, 3))


def test_malformed_trace_row_names_file_and_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("timestamp,input_tokens,output_tokens\n0,10,2\n1,ten,2\n")
    scenario = write_scenario(tmp_path, '[load]\nkind = "trace"\ntrace = "t.csv"\n')
    result = subprocess.run([sys.executable, "-m", "tokenload", "run", str(scenario), "--base-url",
                             "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f'tokenload: error: trace {tmp_path / "t.csv"} line 3: input: expected a number, got "ten"']


# -------------------------------------------------------------------------------------- arrival shapes

OPEN_LOOP = """
seed = 7
[prompt]
tokens = 8
[output]
max_tokens = 1
[load]
kind = "poisson"
rate = {rate}
step_s = {step_s}
max_users = 64
{extra}
[stop]
drain_s = 3
"""


@pytest.mark.parametrize("burstiness", [0.5, 2.0])
def test_gamma_arrivals_have_the_burstiness_coefficient_of_variation(tmp_path: Path, burstiness: float) -> None:
    """vLLM's --burstiness: gamma gaps with shape b and mean 1/rate have CV sqrt(1/b) (1 = Poisson)."""
    df, _, _ = _run(tmp_path, OPEN_LOOP.format(rate=150, step_s=6,
                                               extra=f'arrival = "gamma"\nburstiness = {burstiness}'))
    assert (df.status == "ok").all() and len(df) > 600
    gaps = df.scheduled_at.sort_values().diff().dropna()
    assert gaps.mean() == pytest.approx(1 / 150, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx((1 / burstiness) ** 0.5, rel=0.10)


@pytest.mark.parametrize(("ramp", "ratio"), [("none", 1.0), ("linear", 2.38), ("exponential", 3.16)])
def test_rate_ramps_within_a_step(tmp_path: Path, ramp: str, ratio: float) -> None:
    """Ramping from a tenth of the rate to the rate over the step: sends in its 2nd half / its 1st half."""
    df, _, _ = _run(tmp_path, OPEN_LOOP.format(rate=100, step_s=4, extra=f'ramp = "{ramp}"'))
    t = df.scheduled_at - df.scheduled_at.min()
    first, second = int((t < 2).sum()), int(((t >= 2) & (t < 4)).sum())
    assert second / first == pytest.approx(ratio, rel=0.25)


# ------------------------------------------------------------------------------------------------ warm-up

def test_warmup_requests_are_marked_and_left_out_of_the_analysis(tmp_path: Path) -> None:
    from tokenload.analysis import analyze_run

    df, _, run_dir = _run(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 20
ignore_eos = true
[load]
kind = "constant"
users = 1
step_s = 2.5
warmup_requests = 5
[stop]
drain_s = 3
""")
    df = df.sort_values("started_at")
    warm = df.phase.eq("warmup")
    assert warm.tolist() == [True] * 5 + [False] * (len(df) - 5) and len(df) > 5
    summary = analyze_run(run_dir, write=False)
    assert summary["run"]["requests"] == int((~warm).sum())
    assert sum(step["requests"] for step in summary["steps"]) == int((~warm).sum())


@pytest.mark.parametrize("processes", [0, 2])
def test_warmup_seconds_mark_the_runs_first_seconds_in_every_process(tmp_path: Path, processes: int) -> None:
    """`[load] warmup_s = 1.5`: every request sent in the run's first 1.5 s is warm-up, in each process, and
    the analysis leaves exactly those out; the per-step exclusion is `step_warmup_s` and applies apart."""
    from tokenload.analysis import analyze_run

    extra = ("--processes", str(processes)) if processes else ()
    df, _, run_dir = _run(tmp_path, """
[prompt]
tokens = 16
[output]
max_tokens = 20
ignore_eos = true
[load]
kind = "constant"
users = 2
step_s = 4
warmup_s = 1.5
step_warmup_s = 0.5
[stop]
drain_s = 3
""", *extra)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    start = manifest["steps"][0]["started_at"]
    warm = df.phase.eq("warmup")
    offset = df.started_at - start
    assert warm.any() and (~warm).any()
    assert (offset[warm] < 1.5 + 0.1).all() and (offset[~warm] > 1.5 - 0.1).all()
    if processes:
        assert df[warm].worker.nunique() == 2  # each process marks its own first seconds
    summary = analyze_run(run_dir, write=False)
    assert summary["run"]["requests"] == int((~warm).sum())
    assert summary["analysis_options"]["warmup_s"] == 0.5  # the per-step exclusion, from step_warmup_s
