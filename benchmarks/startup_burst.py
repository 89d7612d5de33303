"""Start-up burst: 200 users spawned at once; is each user's first TTFT as true as the later ones?

`tokenload run` (one Locust process, pinned to CPU 0 with `--pin`) spawns `--users` users in one go
(spawn_rate = users) against the simulator (pinned to the last CPU, its own profile: `--tps` tokens/s
per stream, no noise, slots for every user) and runs `--seconds`. Each record joins the simulator's
truth file by `server_request_id`; the truth's server-side TTFT is `first_token - arrival` (both
stamped by the simulator). TTFT error = the record's `ttft_s` minus that truth, for each user's first
request (its connection is new, all of them at once) and for the later ones, three ways:

- `after`: `ttft_s` as recorded, from the moment the request's last byte was handed to the kernel;
- `main`: the previous stamp, taken once the connection was ready and before the request was
  written: `ttft_s + send_lag_s - connect_s`;
- `intended`: from the moment the user handed the request to the transport, connection set-up
  included: `ttft_s + send_lag_s`.

Also printed: `send_lag_s` and `connect_s` percentiles per group, how many records joined the truth
(every ok record must), the scheduler-lag stalls the manifest names, and the share of the error the
client cannot see: the time between the request leaving the client (`started_at`, wall clock) and the
simulator reading it (`arrival`), i.e. the server's own accept and read queue, which its truth leaves out:
in the runs of docs/benchmarks.md it matched the first requests' remaining TTFT error within 0.2 ms.

`--server stamp` runs the same burst against `tests/stampserver.py` instead (pinned the same way):
an independent server whose truth starts at the kernel's arrival of each request's last byte, so its
own read queue is out of the error, and which keeps when it wrote each token. A record whose first
token's stamp is later than the server's write of its second token read its first token late, in one
read with later ones: the kernel gives a read of several writes the newest one's arrival (and merges
small writes still unread into one buffer stamped with the newest, so no read or peek can recover the
first's). Printed for these: the TTFT error by how many later tokens shared the first one's read,
whether a stall of the client's loop (from the manifest) was under way when the first token was written,
and whether the records' own flag (`first_read_tokens` > 1: `ttft_s` an upper bound) names the same ones.
`--keep DIR` keeps the run directory and the server's truth for a closer look.

    python benchmarks/startup_burst.py              # about 30 s on 2 cores
    python benchmarks/startup_burst.py --server stamp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

PROFILE = """slots = {slots}
prefill_base_s = 0.005
prefill_per_token_s = 0.00001
prefill_exponent = 0.85
prefill_interference = 0.0
decode_base_s = {decode}
decode_per_seq_s = 0.0
noise = 0.0
"""

SCENARIO = """[channel]
protocol = "{protocol}"
[prompt]
tokens = 64
calibrate = false
[output]
max_tokens = {max_tokens}
ignore_eos = true
[load]
kind = "constant"
users = {users}
spawn_rate = {users}
step_s = {seconds}
[stop]
drain_s = 10
"""


MATCH_S = 0.001  # a first-token stamp this close to a later token's write carries that write's arrival
PROBE_S = 0.05  # tokenload.load.lag.INTERVAL_S: a stall began up to one probe interval before it was due


def _pin(cpu: int, pin: bool) -> list[str]:
    return ["taskset", "-c", str(cpu)] if pin else []


def _start_sim(tmp: Path, args: argparse.Namespace, pin: bool) -> tuple[subprocess.Popen[str], str, Path]:
    profile = tmp / "burst.toml"
    profile.write_text(PROFILE.format(slots=max(256, args.users), decode=1.0 / args.tps))
    truth = tmp / "truth.jsonl"
    cmd = [*_pin((os.cpu_count() or 1) - 1, pin), sys.executable, "-m", "tokenload", "sim", "--port", "0",
           "--profile", str(profile), "--truth", str(truth)]
    sim = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert sim.stdout is not None
    return sim, sim.stdout.readline().strip(), truth


def _start_stamp(tmp: Path, args: argparse.Namespace, pin: bool) -> tuple[subprocess.Popen[str], str, Path]:
    truth = tmp / "truth.jsonl"
    cmd = [*_pin((os.cpu_count() or 1) - 1, pin), sys.executable, str(Path(__file__).parents[1] / "tests" /
           "stampserver.py"), "--truth", str(truth), "--ttft-s", str(args.ttft_s), "--tpot-s", str(1.0 / args.tps),
           "--tokens", str(args.max_tokens)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert server.stdout is not None
    return server, server.stdout.readline().strip(), truth


def _run(tmp: Path, base_url: str, args: argparse.Namespace, pin: bool) -> Path:
    scenario = tmp / "burst-scenario.toml"
    scenario.write_text(SCENARIO.format(protocol=args.protocol, users=args.users, seconds=args.seconds,
                                        max_tokens=args.max_tokens))
    out = tmp / "run"
    url = base_url + "/v1" if args.protocol.startswith("openai") else base_url
    cmd = [*_pin(0, pin), sys.executable, "-m", "tokenload", "run", str(scenario), "--base-url", url,
           "--model", "sim-7b", "--out", str(out), "--processes", "1"]
    subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.seconds + 120,
                   env={**os.environ, "TERM": "dumb"})
    return out


def _ms(values: pd.Series, q: float) -> str:
    return f"{np.percentile(values, q) * 1000:.1f}" if len(values) else "-"


def _table(joined: pd.DataFrame) -> list[str]:
    rows = ["| requests | n | stamp | TTFT error p50 / p99 / max (ms) | send_lag_s p50 / p99 | connect_s p50 / p99 |",
            "| --- | --- | --- | --- | --- | --- |"]
    for label, group in (("first per user", joined[joined.first]), ("later", joined[~joined.first])):
        lag, conn = group.send_lag_s, group.connect_s
        for stamp, err in (("after", group.err_after), ("main", group.err_main), ("intended", group.err_intended)):
            rows.append(f"| {label} | {len(group)} | {stamp} | {_ms(err, 50)} / {_ms(err, 99)} / {_ms(err, 100)} "
                        f"| {_ms(lag, 50)} / {_ms(lag, 99)} | {_ms(conn, 50)} / {_ms(conn, 99)} |")
    return rows


def _late_reads(joined: pd.DataFrame, lag: dict[str, Any]) -> list[str]:
    """The TTFT error split by the later token write (if any) whose time the first token's stamp carries.

    A first token stamped at the arrival of the server's k-th later write has an error of that write's
    time after the first (within `MATCH_S`); `stall` marks first tokens written while the client's loop
    stood still (a stall the manifest kept, from its due time minus one probe interval to its end).
    """
    later = []
    offsets = joined.token_offsets_s if "token_offsets_s" in joined else joined.token_writes
    for writes, err in zip(offsets, joined.err_after):
        gaps = np.asarray(writes) - writes[0]
        k = int(np.argmin(np.abs(gaps - err)))
        later.append(k if k and abs(gaps[k] - err) < MATCH_S else 0)
    joined = joined.assign(later=later)
    stalls = [(st["at"] - PROBE_S, st["at"] + st["lag_s"]) for w in lag.get("workers", {}).values()
              for st in w.get("longest_stalls", ())]
    joined["stall"] = [any(a <= t <= b for a, b in stalls) for t in joined.first_token]
    rows = ["| first token stamped at | n | TTFT error p50 / p99 / max (ms) |", "| --- | --- | --- |"]
    for label, group in (("its own arrival (no later write matches)", joined[joined.later == 0]),
                         ("the next token's arrival", joined[joined.later == 1]),
                         ("a later token's arrival (2nd or further)", joined[joined.later >= 2]),
                         ("any, first token written during a kept stall", joined[joined.stall]),
                         ("all", joined)):
        err = group.err_after
        rows.append(f"| {label} | {len(group)} | {_ms(err, 50)} / {_ms(err, 99)} / {_ms(err, 100)} |")
    if "first_read_tokens" in joined:  # what the record itself says: its first token was read with later ones
        flagged = joined.first_read_tokens.fillna(1).gt(1)
        rows.append(f"records whose first_read_tokens > 1 (ttft_s an upper bound): {int(flagged.sum())}, of them "
                    f"stamped at a later write's arrival {int((flagged & joined.later.gt(0)).sum())}; stamped at a "
                    f"later write's arrival but not flagged: {int((~flagged & joined.later.gt(0)).sum())}; "
                    f"TTFT error p99 of the others {_ms(joined.err_after[~flagged], 99)} ms")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--tps", type=float, default=50.0, help="tokens/s per stream (simulator decode step)")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--protocol", default="anthropic")
    parser.add_argument("--server", choices=("sim", "stamp"), default="sim",
                        help="the simulator, or tests/stampserver.py (kernel-stamped truth, each token's write kept)")
    parser.add_argument("--ttft-s", type=float, default=0.05, help="the stamp server's TTFT (--server stamp)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin client and simulator to separate CPUs")
    parser.add_argument("--keep", type=Path, help="copy the run directory and the server's truth file here")
    args = parser.parse_args()
    pin = not args.no_pin and (os.cpu_count() or 1) > 1
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        start = _start_stamp if args.server == "stamp" else _start_sim
        sim, base_url, truth_path = start(tmp, args, pin)
        try:
            out = _run(tmp, base_url, args, pin)
        finally:
            sim.terminate()
            sim.wait(timeout=10)
        if args.keep is not None:
            shutil.copytree(out, args.keep / "run")
            shutil.copy(truth_path, args.keep / "truth.jsonl")
        records = pd.read_parquet(out / "requests.parquet")
        manifest = json.loads((out / "manifest.json").read_text())
        truth = pd.DataFrame([json.loads(line) for line in truth_path.read_text().splitlines() if line.strip()])
    ok = records[records.status == "ok"].copy()
    if "send_lag_s" not in ok:  # a version before send_lag_s: its t0 was the connection-ready stamp
        ok["send_lag_s"] = ok["connect_s"]
    joined = ok.merge(truth, left_on="server_request_id", right_on="request_id", suffixes=("", "_truth"))
    # The stamp server's own TTFT is on the clients' clock (the wall clock here may be stepped).
    joined["truth_ttft"] = joined.ttft_s_truth if "ttft_s_truth" in joined else joined.first_token - joined.arrival
    joined["first"] = joined.started_at == joined.groupby("user_id").started_at.transform("min")
    joined["err_after"] = joined.ttft_s - joined.truth_ttft
    joined["err_intended"] = joined.err_after + joined.send_lag_s
    joined["err_main"] = joined.err_intended - joined.connect_s
    joined["unseen"] = joined.arrival - joined.started_at  # left the client -> read by the simulator
    print(f"{args.users} users spawned at once, {args.seconds:g} s, {args.tps:g} tokens/s per stream, "
          f"{args.protocol}; client CPU 0, simulator CPU {(os.cpu_count() or 1) - 1}" if pin else "unpinned")
    print(f"records {len(records)}, ok {len(ok)}, joined to the truth by server_request_id {len(joined)} "
          f"({'all' if len(joined) == len(ok) else 'NOT ALL'})")
    print("\n".join(_table(joined)))
    for label, group in (("first per user", joined[joined.first]), ("later", joined[~joined.first])):
        print(f"{label}: left the client -> read by the simulator p50 {_ms(group.unseen, 50)} ms, "
              f"p99 {_ms(group.unseen, 99)} ms")
    lag = manifest.get("scheduler_lag", {})
    if "token_writes" in joined:
        print("\n".join(_late_reads(joined, lag)))
    print("scheduler lag:", json.dumps({k: v for k, v in lag.items() if k != "workers"}))
    for worker, stats in lag.get("workers", {}).items():
        print(f"  {worker}: {json.dumps(stats)}")
    return 0 if len(joined) == len(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
