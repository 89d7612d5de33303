"""Repeatability of the breakpoint search: the same search again and again against channels of known truth.

Each channel is searched `--runs` times (default 10) with the same scenario (users 1..32; `[load] kind =
"search"`, `max_probe_s = 60`, `probe_warmup_s = 1`; 64-token prompts; an SLO of TTFT alone, target 0.9),
each run against a fresh channel, and the script reports how often the capacity differs from the truth and
from run to run, how often a confident verdict is wrong (a confident pass of a level whose truth is below
the target, a decided fail of one whose truth is at or above it), and how often the verdict names the
borderline level (at the edge, or its trials disagreed):

- `known`: the simulator profile of `search_vs_ramp.py` with 8 slots (5 ms prefill, 10 ms a token, outputs
  uniform 32-256 tokens, no noise), SLO TTFT <= 0.1 s: up to 8 users never wait, a ninth makes every request
  wait for a slot (a sixth of a second on average), so the capacity is 8 by construction.
- `edge-below` and `edge-above`: the same channel with the SLO's TTFT at 0.37 s and 0.43 s, where 9 users
  meet it about 88% and 93% of the time (8 always, 10 about 60%): a borderline level on each side of 0.9.
- `identical`: the scripted slot server of the tests (`tests/slotserver.py`): 4 slots, identical 32-token
  answers (50 ms, then 20 ms a token: 0.69 s a slot), SLO TTFT <= 0.5 s. Closed-loop users keep the phase
  they fell into: started together, 4 are served and the fifth waits a whole answer every round (5 users
  meet the SLO 80% of the time); started one after another, each waits a quarter of an answer (100%). Its
  truth is the worst phase: every level's users started at once.
- `identical-24`: the same server with 24 slots and 0.2 s before the first token (0.84 s in a slot: the setup of
  issue 33's side-by-side with AIPerf and GuideLLM), SLO TTFT <= 0.5 s: started together, the users past 24 wait
  a whole answer every round (25 users 96%, 26 92%, 27 89%, 28 86%), started apart a fraction of one.

The truth of every level near the boundary is measured here too (`--truth-s`, default 90 s a level): a
constant run of that many users, all started at once, against a fresh channel; the attainment of its
measured requests after its first 5 s, with a 95% Wilson interval. Tokens are what the records of every
request hold (input + output; warm-up, cut and cancelled requests included).

    python benchmarks/search_repeat.py                        # about 45 minutes on 2 cores
    python benchmarks/search_repeat.py --runs 3 --channels identical --keep /tmp/rep
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from search_vs_ramp import profile

from tokenload.search.evidence import wilson_interval
from tokenload.sim.runner import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from slotserver import SlotServer  # noqa: E402  (the tests' scripted server)

TARGET = 0.9
SEARCH = """name = "repeat"
[prompt]
tokens = 64
[output]
max_tokens = {output}
[load]
kind = "search"
min = 1
max = 32
max_probe_s = 60
probe_warmup_s = 1
[slo]
ttft_s = {ttft}
target = {target}
"""
CONSTANT = """name = "truth"
[prompt]
tokens = 64
[output]
max_tokens = {output}
[load]
kind = "constant"
users = {users}
step_s = {seconds}
spawn_rate = 1000
[slo]
ttft_s = {ttft}
target = {target}
"""
VARIED = '{ dist = "uniform", min = 32, max = 256 }'


@dataclass(frozen=True)
class Channel:
    name: str
    ttft_s: float
    output: str
    levels: tuple[int, ...]  # the levels whose truth is measured (the boundary's neighbours)
    borderline: tuple[int, ...] = ()  # levels at the edge by construction (near the target, or passing by phase)
    slots: int | None = None  # a scripted slot server with this many slots; else the simulator's 8-slot profile
    prefill_s: float = 0.05  # the scripted server's wait before the first token (its `ttft_base_s`)


CHANNELS = {
    "known": Channel("known", 0.1, VARIED, (8, 9)),
    "edge-below": Channel("edge-below", 0.37, VARIED, (8, 9, 10), (9,)),
    "edge-above": Channel("edge-above", 0.43, VARIED, (8, 9, 10), (9,)),
    "identical": Channel("identical", 0.5, "32", (4, 5, 6), (5,), slots=4),
    "identical-24": Channel("identical-24", 0.5, "32", (24, 25, 26, 27, 28), (26, 27), slots=24, prefill_s=0.2),
}


def true_capacity(truths: dict[int, float]) -> int:
    """The highest level below which every measured one meets the target (those below the lowest: by
    construction)."""
    capacity = min(truths) - 1
    for users in sorted(truths):
        if truths[users] < TARGET:
            break
        capacity = users
    return capacity


@contextmanager
def serving(channel: Channel, work: Path) -> Iterator[tuple[str, list[str]]]:
    """A fresh channel: (base URL, extra `tokenload run` arguments)."""
    if channel.slots is not None:
        server = SlotServer(slots=channel.slots, ttft_base_s=channel.prefill_s, ttft_per_token_s=0.0, tpot_s=0.02)
        try:
            yield server.url + "/v1", ["--protocol", "openai-chat", "--model", "gpt-test"]
        finally:
            server.close()
        return
    profile_file = work / "cap8.toml"
    profile_file.write_text(profile(8), encoding="utf-8")
    with launch(["--profile", str(profile_file)]) as sim:
        yield sim.base_url, ["--model", "sim-7b"]


def run(channel: Channel, scenario: str, work: Path, out: Path) -> tuple[pd.DataFrame, float]:
    """One `tokenload run` (and `tokenload analyze`) against a fresh channel: its records and wall seconds."""
    scenario_file = work / f"{out.name}.toml"
    scenario_file.write_text(scenario, encoding="utf-8")
    env = {**os.environ, "TERM": "dumb"}
    with serving(channel, work) as (base_url, extra):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "tokenload", "run", str(scenario_file), "--base-url", base_url,
                               *extra, "--out", str(out)], capture_output=True, text=True, env=env)
        wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"tokenload run {out} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    analysed = subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(out)], capture_output=True,
                              text=True, env=env)
    if analysed.returncode not in (0, 1):
        raise SystemExit(f"tokenload analyze {out} failed:\n{analysed.stderr[-3000:]}")
    return pd.read_parquet(out / "requests.parquet"), wall


def truth(channel: Channel, users: int, seconds: float, work: Path) -> tuple[float, tuple[float, float], int]:
    """A level's attainment (its 95% interval, n): `users` started at once, held `seconds`, the first 5 s left out."""
    body = CONSTANT.format(output=channel.output, users=users, seconds=seconds, ttft=channel.ttft_s, target=TARGET)
    df, _ = run(channel, body, work, work / f"truth-{channel.name}-{users}")
    rows = df[(df["phase"] == "measure") & (df["status"] == "ok") & ~df["in_flight"]]
    rows = rows[rows["started_at"] >= df["started_at"].min() + 5]
    met, n = int((rows["ttft_s"] <= channel.ttft_s).sum()), len(rows)
    ci = wilson_interval(met, n)
    assert ci is not None
    return met / n, ci, n


@dataclass
class Search:
    capacity: int | None
    probes: list[dict[str, Any]]
    edges: list[int]
    disagreements: list[int]
    tokens: int
    wall: float
    verdict: str
    wrong: list[str] = field(default_factory=list)


def search(channel: Channel, work: Path, i: int) -> Search:
    df, wall = run(channel, SEARCH.format(output=channel.output, ttft=channel.ttft_s, target=TARGET), work,
                   work / f"search-{channel.name}-{i}")
    s = json.loads((work / f"search-{channel.name}-{i}" / "summary.json").read_text(encoding="utf-8"))["search"]
    tokens = int(df[["input_tokens", "output_tokens"]].fillna(0).to_numpy().sum())
    return Search(s["capacity"], s["probes"], [e["level"] for e in s.get("edge") or []], s["disagreements"],
                  tokens, wall, s["verdict"])


def judge(found: Search, truths: dict[int, float], capacity: int) -> None:
    """Mark the confident verdicts on the wrong side of the truth (levels without a measured truth: below the
    truth's capacity pass, above its first failing level fail)."""
    for p in found.probes:
        level = p["level"]
        att = truths.get(level, 1.0 if level <= capacity else 0.0)
        if p["verdict"] == "pass" and p["confident"] and att < TARGET:
            found.wrong.append(f"{level} passed ({att:.2f})")
        if p["verdict"] == "fail" and att >= TARGET:
            found.wrong.append(f"{level} failed ({att:.2f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="searches per channel (default 10)")
    parser.add_argument("--channels", default=",".join(CHANNELS), help=f"of {', '.join(CHANNELS)} (default: all)")
    parser.add_argument("--truth-s", type=float, default=90.0, help="seconds each truth level is held (default 90)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories here (default: a temporary one)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.channels.split(","):
            channel = CHANNELS[name]
            measured = {u: truth(channel, u, args.truth_s, work) for u in channel.levels}
            truths = {u: att for u, (att, _, _) in measured.items()}
            for u, (att, (lo, hi), n) in measured.items():
                print(f"truth {name} {u} users: {att:.3f} [{lo:.3f}, {hi:.3f}] (n={n})", file=sys.stderr, flush=True)
            capacity = true_capacity(truths)
            found = []
            for i in range(args.runs):
                f = search(channel, work, i)
                judge(f, truths, capacity)
                found.append(f)
                print(f"{name} {i}: {f.verdict}" + (f" WRONG: {', '.join(f.wrong)}" if f.wrong else ""),
                      file=sys.stderr, flush=True)
            rows.append((channel, measured, capacity, found))
    print(f"SLO TTFT alone, target {TARGET}; truth: each level's users started at once, held {args.truth_s:g} s")
    print("| channel | truth near the boundary | capacity found (runs) | differs from the truth | differs from the "
          "most common | confident on the wrong side | borderline named | probes | tokens | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for channel, measured, capacity, found in rows:
        caps = Counter(f.capacity for f in found)
        mode = caps.most_common(1)[0][0]
        named = (sum(any(u in f.edges or u in f.disagreements for u in channel.borderline) for f in found)
                 if channel.borderline else None)
        truth_text = ", ".join(f"{u}: {a:.2f} [{lo:.2f}, {hi:.2f}]" for u, (a, (lo, hi), _) in measured.items())
        probes = sorted(len(f.probes) for f in found)
        tokens = sorted(f.tokens for f in found)
        walls = sorted(f.wall for f in found)
        print(f"| {channel.name} | {truth_text} (capacity {capacity}) | "
              f"{', '.join(f'{c}: {k}' for c, k in sorted(caps.items(), key=lambda kv: -kv[1]))} | "
              f"{sum(f.capacity != capacity for f in found)} of {len(found)} | "
              f"{sum(f.capacity != mode for f in found)} of {len(found)} | "
              f"{sum(bool(f.wrong) for f in found)} of {len(found)} | "
              f"{'-' if named is None else f'{named} of {len(found)}'} | {probes[0]}-{probes[-1]} | "
              f"{tokens[0] / 1000:.0f}k-{tokens[-1] / 1000:.0f}k | {walls[0]:.0f}-{walls[-1]:.0f} s |")
    for channel, _, _, found in rows:
        for i, f in enumerate(found):
            print(f"{channel.name} {i}: {f.verdict}" + (f" WRONG: {', '.join(f.wrong)}" if f.wrong else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
