"""Exact TTFT at thousands of streams on one core: tokenload and vLLM's request function against a kernel-stamped server.

Per level (`--levels`, streams held by one client process pinned to CPU 0) and per client, a fresh
`tests/stampserver.py` (pinned to the last CPU; OpenAI Chat Completions, `--tokens` tokens, the first
`--ttft-s` after the request's arrival, then one every `--tpot-s`) serves for `--seconds`:

- `tokenload`: `tokenload run` of a constant load of that many users (spawned at 500/s), `--processes 1`;
  its records carry `ttft_exact` (flagged: False) and its manifest the longest stall of its event loop and
  the time spent in garbage collection. `tokenload-nofreeze` is the same with `TOKENLOAD_GC_FREEZE=0`
  (no `gc.freeze()` after set-up and spawning: every full collection walks every user).
- `vllm`: vLLM's own request function, `async_request_openai_chat_completions` of its
  `vllm/benchmarks/lib/endpoint_request_func.py`, run unchanged from the file `--vllm-func` names (not
  part of this repository: take it from vLLM's sources) by `--vllm-python` (an interpreter with aiohttp,
  regex and tqdm): that many asyncio tasks, each sending its next request when the last one ended, on
  one shared `aiohttp.ClientSession` as vLLM's benchmark does; a probe task measures its loop's stalls.
  It flags nothing.

The truth is the server's: each request's kernel-stamped arrival to its first token's write on the
clients' clock (`ttft_s` of the truth); `--server loop` serves from `tests/loopserver.py` instead, an
independent asyncio server that stamps each arrival when its loop reads it, as most servers' logs do
(its own lateness then counts as the client's error); records join it by the server's id (tokenload) or by the
`x-request-id` the request function sends (vLLM). Load held: the streams the server had open (from
arrival to last write, its own log) every 0.1 s from 2 s after every user had sent to 2 s before the
clients stopped sending, mean and minimum, as a share of the level. TTFT error: the client's TTFT minus the truth,
over every joined record that is not flagged; its percentiles are of the absolute error.

    python benchmarks/ttft_at_scale.py --vllm-func PATH/endpoint_request_func.py --vllm-python VENV/bin/python
    python benchmarks/ttft_at_scale.py --clients tokenload --levels 2000   # one cell

Prints one Markdown row per cell and `uptime` before each (the machine's load is part of the result).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
MODEL = "stamp-test"

SCENARIO = """[channel]
protocol = "openai-chat"
[prompt]
tokens = 32
calibrate = false
[output]
max_tokens = {tokens}
[load]
kind = "constant"
users = {users}
spawn_rate = 500
step_s = {seconds}
[stop]
drain_s = 30
"""

# The peer: vLLM's request function, loaded from its own file, driven as its benchmark drives it.
PEER = r"""
import asyncio, importlib.util, json, sys, time
import aiohttp
spec = importlib.util.spec_from_file_location("endpoint_request_func", sys.argv[1])
vllm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm)
url, streams, seconds, tokens = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
prompt = " ".join(["word"] * 32)
stalls = []

async def probe(until):
    while time.perf_counter() < until:
        due = time.perf_counter() + 0.05
        await asyncio.sleep(0.05)
        stalls.append(time.perf_counter() - due)

async def user(n, session, until, out):
    await asyncio.sleep(n / 500)  # spawned at 500/s, as tokenload's users are
    k = 0
    while time.perf_counter() < until:
        k += 1
        rid = f"vllm-{n}-{k}"
        result = await vllm.async_request_openai_chat_completions(vllm.RequestFuncInput(
            prompt=prompt, api_url=url, prompt_len=32, output_len=tokens, model="stamp-test", request_id=rid),
            session)
        out.append({"request_id": rid, "ok": result.success, "ttft_s": result.ttft, "error": result.error[-200:]})

async def main():
    until = time.perf_counter() + seconds
    out = []
    connector = aiohttp.TCPConnector(limit=0)  # vLLM's benchmark: no limit of its own
    async with aiohttp.ClientSession(connector=connector, timeout=vllm.AIOHTTP_TIMEOUT) as session:
        await asyncio.gather(probe(until), *(user(n, session, until, out) for n in range(streams)))
    print(json.dumps({"records": out, "longest_stall_s": max(stalls, default=0.0)}))

asyncio.run(main())
"""


def _pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if (os.cpu_count() or 1) > 1 else []


def _server(tmp: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str, Path]:
    truth = tmp / "truth.jsonl"
    cmd = [*_pin((os.cpu_count() or 1) - 1), sys.executable, str(ROOT / "tests" / f"{args.server}server.py"), "--truth",
           str(truth), "--ttft-s", str(args.ttft_s), "--tpot-s", str(args.tpot_s), "--tokens", str(args.tokens),
           "--protocol", "openai-chat"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert server.stdout is not None
    return server, server.stdout.readline().strip(), truth


def _tokenload(tmp: Path, url: str, level: int, args: argparse.Namespace,
               freeze: bool = True) -> tuple[pd.DataFrame, dict[str, Any]]:
    scenario = tmp / "scenario.toml"
    scenario.write_text(SCENARIO.format(users=level, seconds=args.seconds, tokens=args.tokens))
    out = tmp / "run"
    subprocess.run([*_pin(0), sys.executable, "-m", "tokenload", "run", str(scenario), "--base-url", url + "/v1",
                    "--model", MODEL, "--out", str(out), "--processes", "1"], check=False, capture_output=True,
                   text=True, timeout=args.seconds + 180,
                   env={**os.environ, "TERM": "dumb", "TOKENLOAD_GC_FREEZE": "1" if freeze else "0"})
    records = pd.read_parquet(out / "requests.parquet")
    records = records[records.status.eq("ok") & ~records.in_flight]
    lag = json.loads((out / "manifest.json").read_text()).get("scheduler_lag", {})
    stalls = [st["lag_s"] for w in lag.get("workers", {}).values() for st in w.get("longest_stalls", ())]
    frame = pd.DataFrame({"request_id": records.server_request_id, "ttft_s": records.ttft_s,
                          "flagged": records.ttft_exact.eq(False) if "ttft_exact" in records else False})
    return frame, {"longest_stall_s": max(stalls, default=0.0),
                   "gc_s": sum(w.get("gc_s", 0.0) for w in lag.get("workers", {}).values())}


def _vllm(url: str, level: int, args: argparse.Namespace) -> tuple[pd.DataFrame, dict[str, Any]]:
    out = subprocess.run([*_pin(0), args.vllm_python, "-c", PEER, str(args.vllm_func), url + "/v1/chat/completions",
                          str(level), str(args.seconds), str(args.tokens)], check=False, capture_output=True,
                         text=True, timeout=args.seconds + 180)
    if out.returncode:
        raise SystemExit(f"the vLLM peer failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    records = pd.DataFrame(result["records"])
    records = records[records.ok]
    return (pd.DataFrame({"request_id": records.request_id, "ttft_s": records.ttft_s, "flagged": False}),
            {"longest_stall_s": result["longest_stall_s"], "gc_s": None})


def _held(truth: pd.DataFrame, level: int, seconds: float) -> tuple[float, float]:
    """Mean and least share of `level` the server had open, every 0.1 s from 2 s after the level-th arrival (every
    user has sent; a run's own probe may come well before) to 2 s before the clients stopped sending."""
    arrivals = np.sort(truth.arrival.to_numpy())
    if len(arrivals) < level:
        return float("nan"), float("nan")
    full = arrivals[level - 1]
    opened = truth.arrival.to_numpy() - full
    closed = opened + truth.token_offsets_s.map(max).to_numpy()
    grid = np.arange(2.0, seconds - level / 500 - 2.0, 0.1)
    if not grid.size:
        return float("nan"), float("nan")
    counts = (opened[None, :] <= grid[:, None]).sum(1) - (closed[None, :] <= grid[:, None]).sum(1)
    return float(counts.mean() / level), float(counts.min() / level)


def cell(client: str, level: int, args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        server, url, truth_path = _server(tmp, args)
        try:
            if client == "vllm":
                records, extra = _vllm(url, level, args)
            else:
                records, extra = _tokenload(tmp, url, level, args, freeze=client == "tokenload")
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
        truth = pd.DataFrame([json.loads(line) for line in truth_path.read_text().splitlines() if line.strip()])
        if args.keep is not None:
            kept = args.keep / f"{args.server}-{client}-{level}"
            shutil.copytree(tmp, kept, dirs_exist_ok=True)
            records.to_parquet(kept / "joined-records.parquet")
    joined = records.merge(truth, on="request_id", suffixes=("", "_truth"))
    err = (joined.ttft_s - joined.ttft_s_truth)[~joined.flagged.astype(bool)].abs() * 1000
    mean, least = _held(truth, level, args.seconds)
    gc = "" if extra["gc_s"] is None else f", GC {extra['gc_s']:.2f} s"
    return (f"| {level} | {client} | {mean:.1%} (min {least:.1%}) | {len(records)} / {len(joined)} | "
            f"{err.quantile(0.5):.2f} / {err.quantile(0.99):.2f} / {err.max():.2f} | "
            f"{extra['longest_stall_s'] * 1000:.0f} ms{gc} | {int(joined.flagged.sum())} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="500,1000,2000,4000")
    parser.add_argument("--server", choices=("stamp", "loop"), default="stamp",
                        help="tests/stampserver.py (kernel-stamped arrivals) or tests/loopserver.py (asyncio, "
                             "arrivals stamped when read)")
    parser.add_argument("--clients", default="tokenload,vllm")
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--ttft-s", type=float, default=0.5)
    parser.add_argument("--tpot-s", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--vllm-func", type=Path, help="vLLM's vllm/benchmarks/lib/endpoint_request_func.py")
    parser.add_argument("--keep", type=Path, help="copy each cell's files (truth, run directory, records) here")
    parser.add_argument("--vllm-python", default=sys.executable, help="an interpreter with aiohttp, regex, tqdm")
    args = parser.parse_args()
    clients = args.clients.split(",")
    if "vllm" in clients and (args.vllm_func is None or not args.vllm_func.is_file()):
        parser.error("--vllm-func must name vLLM's endpoint_request_func.py (or leave vllm out of --clients)")
    print("| streams | client | load held in the server: mean (min) | records / joined | TTFT error p50 / p99 / max "
          "(ms, unflagged) | longest stall | flagged |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for level in (int(x) for x in args.levels.split(",")):
        for client in clients:
            uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            print(f"<!-- {args.server} server; {time.strftime('%H:%M:%S')} {uptime} -->", flush=True)
            print(cell(client, level, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
