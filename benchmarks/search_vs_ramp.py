"""Breakpoint search vs the step ramp: the capacity each finds, its error, probes, wall time and tokens.

For each capacity (default 4, 24 and 96 users) a simulator profile is written
whose capacity is known by construction: `slots` = the capacity, a 5 ms prefill
whatever the prompt, TPOT rising with the batch, no noise, no prompt cache. Up to
`slots` closed-loop users never queue (TTFT = the prefill, a few ms); one more
user and every request waits for the next sequence to finish, about
e2e / slots (0.15 s or more at these settings), so the SLO `TTFT <= 0.1 s` for 90%
of requests holds at `slots` users and fails above: the truth capacity is the
profile's `slots`. Each scenario runs against a fresh simulator whose truth file
counts the tokens the channel really served (input + output, warm-up, drained
and cancelled requests included): that is the cost reported.

Both scenarios send the same requests (the packaged ramp's prompts and outputs)
and judge the same SLO; their `[load]` and `[stop]` are the packaged ones:

- search: the packaged `search` scenario (its token budget lifted, so the
  budget does not decide the comparison);
- ramp: the packaged `ramp` (1, 2, 4, ... users, 30 s or 30 requests per step),
  auto-stopping at the first step whose TTFT p95 is over the SLO's (the
  cheapest honest ramp), its capacity the highest step `tokenload analyze`
  finds meeting the SLO.

With `--scripted`, the search alone against the scripted server of the tests
(`tests/slotserver.py`) instead: `slots` = the capacity, identical 32-token
answers (0.2 s + 0.5 ms a prompt token, then 20 ms a token: 0.85 s in a slot),
64-token prompts, users 1..128, SLO TTFT <= 0.5 s for 90% (the setup of issue 33's
side-by-side with AIPerf and GuideLLM). Started together, the users past the
slots wait a whole answer each round, so 26 users on 24 slots meet the SLO 92%
of the time and 27 88%; started apart they wait a fraction of one. Tokens are
what the run's records hold (input + output of every request).

    python benchmarks/search_vs_ramp.py                  # about 20 minutes on 2 cores
    python benchmarks/search_vs_ramp.py --capacities 4   # one row
    python benchmarks/search_vs_ramp.py --search-only    # the search's columns only (ramp: docs/benchmarks.md)
    python benchmarks/search_vs_ramp.py --scripted --capacities 24,96
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenload.compat import tomllib
from tokenload.sim.runner import launch
from tokenload.workload.scenario import packaged

SLO_TTFT_S = 0.1
TARGET = 0.9
MEAN_OUTPUT = 144  # the ramp's outputs: uniform 32..256 tokens
DECODE_BASE_S = 0.01
WAIT_PER_USER_S = 0.15  # e2e at `slots` users / slots: the wait one user past the capacity adds


def profile(slots: int) -> str:
    """A simulator profile whose capacity under the SLO is `slots` users (see the module docstring)."""
    # e2e at `slots` users = MEAN_OUTPUT x (base + per_seq x (slots - 1)); make e2e / slots >= WAIT_PER_USER_S.
    per_seq = max(0.0, (WAIT_PER_USER_S * slots / MEAN_OUTPUT - DECODE_BASE_S) / max(1, slots - 1))
    return "\n".join([f"slots = {slots}", "prefill_base_s = 0.005", "prefill_per_token_s = 0.0",
                      "prefill_interference = 0.0", f"decode_base_s = {DECODE_BASE_S}",
                      f"decode_per_seq_s = {per_seq:.6f}", "noise = 0.0", "prefix_cache_tokens = 0",
                      "eos_probability = 0.0", ""])


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def scenario(name: str, workload: dict[str, Any], **changes: dict[str, Any]) -> str:
    """The packaged scenario `name` with the common workload and SLO, and `changes` merged into its tables."""
    data = tomllib.loads(packaged(name).read_text(encoding="utf-8"))
    data.update(workload)
    data["slo"] = {"ttft_s": SLO_TTFT_S, "target": TARGET}
    for table, values in changes.items():
        data.setdefault(table, {}).update(values)
    lines = [f"name = {json.dumps('bench-' + name)}"]
    for table, values in data.items():
        if isinstance(values, dict):
            lines.append(f"[{table}]")
            lines.extend(f"{k} = {toml_value(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


@dataclass
class Outcome:
    capacity: float | None
    probes: int
    wall_s: float
    tokens: int
    note: str


def run(scenario_file: Path, profile_file: Path, out: Path) -> tuple[dict[str, Any], float, int]:
    """One scenario against a fresh simulator: (summary.json, wall seconds of the run, tokens the channel served)."""
    truth = out.with_suffix(".truth.jsonl")
    env = {**os.environ, "TERM": "dumb"}
    with launch(["--profile", str(profile_file), "--truth", str(truth)]) as sim:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "tokenload", "run", str(scenario_file), "--base-url",
                               sim.base_url, "--model", "sim-7b", "--out", str(out)],
                              capture_output=True, text=True, env=env)
        wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"tokenload run {scenario_file.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    analysed = subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(out)], capture_output=True,
                              text=True, env=env)
    if analysed.returncode != 0:
        raise SystemExit(f"tokenload analyze {out} failed:\n{analysed.stderr[-3000:]}")
    rows = [json.loads(line) for line in truth.read_text(encoding="utf-8").splitlines() if line.strip()]
    tokens = sum((r.get("input_tokens") or 0) + (r.get("output_tokens") or 0) for r in rows)
    return json.loads((out / "summary.json").read_text(encoding="utf-8")), wall, tokens


SCRIPTED = """name = "bench-scripted"
prompt = { tokens = 64 }
output = { max_tokens = 32 }
load = { kind = "search", min = 1, max = 128, max_probe_s = 120, probe_warmup_s = 1 }
slo = { ttft_s = 0.5, target = 0.9 }
"""


def run_scripted(slots: int, out: Path) -> tuple[dict[str, Any], float, int]:
    """The `--scripted` search against a fresh scripted server of `slots` slots: as `run`, tokens from the records."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import pandas as pd

    from slotserver import SlotServer

    scenario_file = out.with_suffix(".toml")
    scenario_file.write_text(SCRIPTED, encoding="utf-8")
    env = {**os.environ, "TERM": "dumb"}
    server = SlotServer(slots=slots, ttft_base_s=0.2, ttft_per_token_s=0.0005, tpot_s=0.02)
    try:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "tokenload", "run", str(scenario_file), "--base-url",
                               server.url + "/v1", "--protocol", "openai-chat", "--model", "gpt-test", "--out",
                               str(out)], capture_output=True, text=True, env=env)
        wall = time.monotonic() - start
    finally:
        server.close()
    if proc.returncode != 0:
        raise SystemExit(f"tokenload run {scenario_file.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    subprocess.run([sys.executable, "-m", "tokenload", "analyze", str(out)], capture_output=True, text=True, env=env)
    df = pd.read_parquet(out / "requests.parquet")
    tokens = int(df[["input_tokens", "output_tokens"]].fillna(0).to_numpy().sum())
    return json.loads((out / "summary.json").read_text(encoding="utf-8")), wall, tokens


def searched(summary: dict[str, Any], wall: float, tokens: int) -> Outcome:
    s = summary["search"]
    verdicts = "".join(p["verdict"][0] for p in s["probes"])
    levels = ",".join(f"{p['level']:g}{p['verdict'][0]}" for p in s["probes"])
    return Outcome(s["capacity"], len(s["probes"]), wall, tokens, f"{levels} ({verdicts.count('u')} undecided)")


def ramped(summary: dict[str, Any], wall: float, tokens: int) -> Outcome:
    bp = summary.get("breakpoint") or {}
    steps = summary.get("steps") or []
    return Outcome(bp.get("last_good_load_level"), len(steps), wall, tokens,
                   f"breaks at {bp.get('load_level')} ({bp.get('reason')})")


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def cell(o: Outcome, truth: int) -> str:
    """One method's columns: capacity (error against the truth), probes, wall time, tokens."""
    err = "-" if o.capacity is None else f"{o.capacity - truth:+g}"
    return f"{fmt(o.capacity)} ({err}) | {o.probes} | {o.wall_s:.0f} s | {o.tokens / 1000:.0f}k"

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacities", default="4,24,96", help="simulator capacities in users (default 4,24,96)")
    parser.add_argument("--search-only", action="store_true",
                        help="run only the search (to measure a change to it; the ramp's tokens do not move)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories here (default: a temporary one)")
    parser.add_argument("--scripted", action="store_true",
                        help="search the tests' scripted slot server instead (identical answers; no ramp)")
    args = parser.parse_args()
    capacities = [int(c) for c in args.capacities.split(",")]
    if args.scripted:
        return scripted(capacities, args.keep)
    ramp = tomllib.loads(packaged("ramp").read_text(encoding="utf-8"))
    workload = {"prompt": ramp["prompt"], "output": ramp["output"]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        search_file, ramp_file = root / "search.toml", root / "ramp.toml"
        search_file.write_text(scenario("search", workload, stop={"max_tokens": 20_000_000}), encoding="utf-8")
        ramp_file.write_text(scenario("ramp", workload, stop={"breakpoint_ttft_p95_s": SLO_TTFT_S}),
                             encoding="utf-8")
        rows: list[tuple[int, Outcome, Outcome | None]] = []
        for cap in capacities:
            profile_file = root / f"cap{cap}.toml"
            profile_file.write_text(profile(cap), encoding="utf-8")
            s = searched(*run(search_file, profile_file, root / f"search-{cap}"))
            r = None if args.search_only else ramped(*run(ramp_file, profile_file, root / f"ramp-{cap}"))
            rows.append((cap, s, r))
            print(f"capacity {cap}: search {fmt(s.capacity)} [{s.note}]"
                  + ("" if r is None else f", ramp {fmt(r.capacity)} [{r.note}]"), file=sys.stderr, flush=True)
    print(f"SLO TTFT <= {SLO_TTFT_S} s for {TARGET:.0%}; tokens = what the simulator served (its truth file)")
    print("| truth | search: capacity (error) | probes | wall | tokens | ramp: capacity (error) | steps | wall "
          "| tokens | search/ramp tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for cap, s, r in rows:
        if r is None:
            print(f"| {cap} | {cell(s, cap)} | - | - | - | - | - |")
        else:
            print(f"| {cap} | {cell(s, cap)} | {cell(r, cap)} | {s.tokens / max(1, r.tokens):.2f} |")
    for cap, s, _ in rows:
        print(f"search probes at {cap}: {s.note}")
    return 0


def scripted(slots: list[int], keep: str | None) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(keep) if keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        rows = []
        for n in slots:
            summary, wall, tokens = run_scripted(n, root / f"scripted-{n}")
            rows.append((n, searched(summary, wall, tokens), summary["search"]["verdict"]))
            print(f"{n} slots: {rows[-1][2]}", file=sys.stderr, flush=True)
    print("scripted server: identical 32-token answers, 64-token prompts, SLO TTFT <= 0.5 s for 90%, users 1-128; "
          "tokens = the records' input + output")
    print("| slots | capacity | probes | wall | tokens | verdict |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, o, verdict in rows:
        print(f"| {n} | {fmt(o.capacity)} | {o.probes} | {o.wall_s:.0f} s | {o.tokens / 1000:.0f}k | {verdict} |")
    for n, o, _ in rows:
        print(f"search probes at {n} slots: {o.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
