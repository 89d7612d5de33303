"""Distributed scale: 1, 2 and 4 workers sending their records to one master over Locust's channel.

For each worker count N: a fresh `tokenload sim --workers 2 --truth` (its own profile: `--tps` tokens/s
per stream, no noise, slots for every user), a real `tokenload run --master --expect-workers N --out A`
and N `tokenload run --worker --out B_i` processes, each worker with its own directory, so every record
reaches A over Locust's messages (`tokenload.load.courier`), as on machines with no shared disk. The
load: `--users-per-worker` x N users, all spawned at once, for `--seconds`. Printed, one row per N:

- streams held: open streams in the simulator's truth (arrival to last token), median over the middle
  of the load (20% to 90% of it), against the users planned;
- records: rows of A/requests.parquet against the truth, joined by `server_request_id`: lost (in the
  truth, not in A), extra (in A, not in the truth) and duplicated (twice in A);
- master CPU per 1,000 records: the master's Locust process (it receives, deduplicates and writes the
  batches, besides Locust's own work: heartbeats, the workers' stats), from its first batch to its
  exit, read from /proc (psutil); `finalise` is the CPU of the `tokenload` process that supervises it
  from that exit to its own (the merge into requests.parquet and manifest.json);
- master load: that Locust process's share of one core over its run;
- channel: the batch messages and their Arrow bytes the master counted (`manifest.json`
  `records.courier`), and every byte on the master's ZeroMQ connections (`ss -ti`'s `bytes_received` /
  `bytes_sent`, sampled every 0.2 s: Locust's heartbeats and stats included), per record;
- worker CPU per 1,000 records (each `tokenload run --worker` and its Locust process) and wall time.

Then the master's per-record work in isolation, in this process, on copies of the last cell's records
(`--batches` batches of `--batch-size` records, 20 workers' request ids): the inbox's CPU per record
written and per record of a copy it drops (the last quarter of the batches sent again under new numbers), the
memory its window of recent request ids takes (the last `courier.RECENT_BATCHES` batches', whatever the run's
length), and the finalise merge (`records.merge_segments`) of those batches: CPU and peak memory per 100k records.

    python benchmarks/distributed_scale.py                 # about 2-3 minutes on 2 cores
    python benchmarks/distributed_scale.py --workers 4 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import feather

# startup_burst's steady simulator (slots, a fixed decode step, no noise) and constant load, all spawned at once
from startup_burst import PROFILE, SCENARIO

# What the merge of the isolated part runs in a child process of its own: its peak memory is the merge's.
MERGE = """
import json, resource, sys, time
from pathlib import Path
import psutil
from tokenload.load import records
rss = psutil.Process().memory_info().rss
cpu = time.process_time()
records.merge_segments(Path(sys.argv[2]), Path(sys.argv[1]))
print(json.dumps({"cpu": time.process_time() - cpu, "rss": rss,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

SAMPLE_S = 0.2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cpu(proc: psutil.Process) -> tuple[float, float]:
    """(own CPU seconds, CPU seconds of its children already waited for)."""
    t = proc.cpu_times()
    return t.user + t.system, t.children_user + t.children_system


@dataclass
class Watch:
    """Samples, every `SAMPLE_S`, the master's processes and its ZeroMQ connections until the master exits."""

    pid: int  # the master's `tokenload run`
    port: int
    segments: Path
    done: threading.Event = field(default_factory=threading.Event)  # set once the master was waited for
    conns: dict[str, tuple[int, int]] = field(default_factory=dict)  # peer -> max (bytes received, sent) seen
    locust_at_first_batch: float | None = None
    locust_last: float = 0.0  # the Locust master's CPU at the last sample it was alive
    locust_total: float | None = None  # its CPU, exact, from the supervisor's waited-for children
    supervisor_at_locust_exit: float | None = None
    locust_exit: float | None = None
    load_from: float | None = None

    def run(self) -> None:
        sup = psutil.Process(self.pid)
        locust: psutil.Process | None = None
        while not self.done.is_set():
            try:
                self._sample_sockets()
                if locust is None and self.locust_exit is None:
                    kids = [p for p in sup.children() if "locust" in " ".join(p.cmdline())]
                    locust = kids[0] if kids else None
                if locust is not None:
                    try:
                        own, _ = _cpu(locust)
                        self.locust_last = own
                        if self.locust_at_first_batch is None and any(self.segments.glob("*-*.arrow")):
                            self.locust_at_first_batch, self.load_from = own, time.monotonic()
                    except psutil.NoSuchProcess:
                        locust, self.locust_exit = None, time.monotonic()
                if self.locust_exit is not None and self.locust_total is None:
                    own, children = _cpu(sup)
                    if children > 0:
                        self.locust_total, self.supervisor_at_locust_exit = children, own
            except psutil.NoSuchProcess:
                break
            time.sleep(SAMPLE_S)

    def _sample_sockets(self) -> None:
        out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{self.port} )"],
                             capture_output=True, text=True).stdout
        for block in re.split(r"\n(?=\S)", out.strip()):
            head = block.split()
            if len(head) < 4:
                continue
            received = re.search(r"bytes_received:(\d+)", block)
            sent = re.search(r"bytes_sent:(\d+)", block)
            was = self.conns.get(head[3], (0, 0))
            self.conns[head[3]] = (max(was[0], int(received.group(1)) if received else 0),
                                   max(was[1], int(sent.group(1)) if sent else 0))


def _truth(path: Path) -> pd.DataFrame:
    return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def _held(truth: pd.DataFrame, seconds: float) -> float:
    """Median open streams (arrival to last token) over 20%..90% of the load after the first arrival."""
    ends = truth.last_token.fillna(truth.arrival)
    start = float(truth.arrival.min())
    grid = np.arange(start + 0.2 * seconds, start + 0.9 * seconds, 0.1)
    arrivals, finished = np.sort(truth.arrival.to_numpy()), np.sort(ends.to_numpy())
    open_ = np.searchsorted(arrivals, grid, side="right") - np.searchsorted(finished, grid, side="right")
    return float(np.median(open_))


def cell(tmp: Path, n: int, args: argparse.Namespace) -> tuple[dict[str, Any], pa.Table]:
    """One worker count: simulator, master, workers; what they left, measured, and the master's records."""
    users = n * args.users_per_worker
    (tmp / "profile.toml").write_text(PROFILE.format(slots=max(256, users), decode=1.0 / args.tps))
    scenario = tmp / "scenario.toml"
    scenario.write_text(SCENARIO.format(protocol="anthropic", users=users, seconds=args.seconds,
                                        max_tokens=args.max_tokens))
    truth_path = tmp / "truth.jsonl"
    sim = subprocess.Popen([sys.executable, "-m", "tokenload", "sim", "--port", "0", "--workers", "2", "--profile",
                            str(tmp / "profile.toml"), "--truth", str(truth_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert sim.stdout is not None
    base_url = sim.stdout.readline().strip()
    port = _free_port()
    env = {**os.environ, "TERM": "dumb"}
    common = ["--base-url", base_url, "--model", "sim-7b", "--master-port", str(port)]
    a = tmp / "A"
    try:
        started = time.monotonic()
        master_log = (tmp / "master.log").open("w")
        master = subprocess.Popen([sys.executable, "-m", "tokenload", "run", str(scenario), *common, "--master",
                                   "--expect-workers", str(n), "--out", str(a)],
                                  stdout=master_log, stderr=subprocess.STDOUT, text=True, env=env)
        watch = Watch(master.pid, port, a / "segments")
        watcher = threading.Thread(target=watch.run, daemon=True)
        watcher.start()
        workers = [subprocess.Popen([sys.executable, "-m", "tokenload", "run", str(scenario), *common, "--worker",
                                     "--out", str(tmp / f"B{i}")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env)
                   for i in range(n)]
        worker_cpu = 0.0
        for w in workers:
            _, status, usage = os.wait4(w.pid, 0)
            w.returncode = os.waitstatus_to_exitcode(status)
            worker_cpu += usage.ru_utime + usage.ru_stime
        _, status, usage = os.wait4(master.pid, 0)
        master.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
        master_tree = usage.ru_utime + usage.ru_stime
        watch.done.set()
        watcher.join()
        master_log.close()
    finally:
        sim.terminate()
        sim.wait(timeout=10)
    if master.returncode != 0 or any(w.returncode for w in workers):
        print(f"N={n}: master exit {master.returncode}, workers {[w.returncode for w in workers]}\n"
              f"{(tmp / 'master.log').read_text()[-2000:]}", file=sys.stderr)
    table = pq.read_table(a / "requests.parquet")
    df = table.to_pandas()
    manifest = json.loads((a / "manifest.json").read_text())
    truth = _truth(truth_path)
    ids = df.server_request_id.dropna()
    courier = manifest["records"].get("courier", {})
    locust_total = watch.locust_total if watch.locust_total is not None else watch.locust_last
    live_cpu = locust_total - (watch.locust_at_first_batch or 0.0)
    supervisor_own = master_tree - locust_total
    finalise_cpu = supervisor_own - (watch.supervisor_at_locust_exit or supervisor_own)
    load_s = (watch.locust_exit or time.monotonic()) - (watch.load_from or started)
    received = sum(r for r, _ in watch.conns.values())
    sent = sum(s for _, s in watch.conns.values())
    k = len(df) / 1000
    return {
        "workers": n, "users": users, "held": _held(truth, args.seconds), "records": len(df), "truth": len(truth),
        "lost": len(set(truth.request_id) - set(ids)), "extra": len(set(ids) - set(truth.request_id)),
        "dup": int(ids.duplicated().sum() + df.request_id.duplicated().sum()),
        "master_cpu_per_k": live_cpu / k, "master_core": live_cpu / load_s if load_s > 0 else float("nan"),
        "finalise_cpu": finalise_cpu, "locust_cpu_total": locust_total,
        "messages": sum(c.get("messages", 0) for c in courier.values()),
        "batches": sum(c.get("batches", 0) for c in courier.values()),
        "arrow_bytes": sum(c.get("bytes", 0) for c in courier.values()),
        "wire_in": received, "wire_out": sent, "load_s": load_s,
        "worker_cpu_per_k": worker_cpu / k, "wall": wall, "rc": (master.returncode, [w.returncode for w in workers]),
        "exit_ok": master.returncode == 0 and not any(w.returncode for w in workers),
    }, table


def isolated(template: pa.Table, batches: int, size: int) -> dict[str, float]:
    """The master's work per record without Locust: the inbox's write and drop, its id window, the merge.

    Imported here, after the cells: importing Locust monkey-patches threads, which the cells' `Watch` needs real.
    """
    from tokenload.load import courier, records

    rows = template.cast(records.SCHEMA).take([i % len(template) for i in range(size)])
    column = rows.schema.get_field_index("request_id")

    def batch(k: int) -> bytes:
        ids = pa.array([f"0a1b2c3d-w{k % 20:02d}-{k * size + i:07d}" for i in range(size)])
        sink = pa.BufferOutputStream()
        feather.write_feather(rows.set_column(column, "request_id", ids), sink, compression="uncompressed")
        return bytes(sink.getvalue().to_pybytes())

    data = [batch(k) for k in range(batches)]
    inbox = courier.Inbox.__new__(courier.Inbox)  # its `_write` only: no runner, no messages
    inbox._ids = {}
    n = batches * size
    with tempfile.TemporaryDirectory() as name:
        seg, out = Path(name) / "segments", Path(name) / "run"
        seg.mkdir()
        out.mkdir()
        cpu = time.process_time()
        for k, blob in enumerate(data):
            inbox._write(seg, "run", f"w{k % 20}", k, blob)
        write = time.process_time() - cpu
        held = inbox._ids["run"]._ids
        ids_bytes = sys.getsizeof(held) + sum(map(sys.getsizeof, held))  # the set and its strings, exactly
        cpu = time.process_time()
        for k, blob in enumerate(data[-(batches // 4):]):  # within the window: every record a copy
            inbox._write(seg, "run", f"w{k % 20}", batches + k, blob)
        drop = time.process_time() - cpu
        merge = json.loads(subprocess.run([sys.executable, "-c", MERGE, str(seg), str(out)], check=True,
                                          capture_output=True, text=True).stdout)
        merged = pq.read_metadata(out / "requests.parquet").num_rows
    assert merged == n
    return {"arrow_b": len(batch(0)) / size, "write_us": write / n * 1e6, "drop_us": drop / (n // 4) * 1e6,
            "ids_mb": ids_bytes / 1e6, "merge_cpu_100k": merge["cpu"] / n * 1e5,
            "merge_mb_100k": (merge["peak"] - merge["rss"]) / n * 1e5 / 1e6,
            "n": n}


def _row(r: dict[str, Any]) -> str:
    n = r["records"]
    return (f"| {r['workers']} | {r['held']:.0f} / {r['users']} | {n} / {r['truth']} | {r['lost']} / {r['extra']} / "
            f"{r['dup']} | {r['master_cpu_per_k']:.3f} | {r['master_core']:.2f} | {r['finalise_cpu']:.2f} | "
            f"{r['messages']} ({r['messages'] / r['load_s']:.1f}/s) | {r['arrow_bytes'] / n:.0f} | "
            f"{r['wire_in'] / n:.0f} / {r['wire_out'] / n:.0f} | {r['worker_cpu_per_k']:.2f} | {r['wall']:.0f} s |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--users-per-worker", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=20.0, help="load per cell")
    parser.add_argument("--tps", type=float, default=50.0, help="tokens/s per stream (simulator decode step)")
    parser.add_argument("--max-tokens", type=int, default=50)
    parser.add_argument("--batches", type=int, default=200, help="isolated part: batches of --batch-size records")
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.workers.split(",")):
        with tempfile.TemporaryDirectory() as name:
            print(f"N={n}: load average {os.getloadavg()[0]:.2f} before", file=sys.stderr)
            row, template = cell(Path(name), n, args)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    alone = isolated(template, args.batches, args.batch_size)
    print(f"{args.users_per_worker} users per worker, {args.max_tokens} tokens at {args.tps:g} tokens/s each, "
          f"{args.seconds:g} s of load; simulator --workers 2; {os.cpu_count()} CPUs")
    print("| workers | streams held / users | records / truth | lost / extra / dup | master CPU s per 1k records "
          "| master core | finalise CPU s | batch messages | Arrow B/record | wire B/record in / out "
          "| worker CPU s per 1k records | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(_row(r))
    print(f"\nThe master's work per record alone ({alone['n']:,} records in batches of {args.batch_size}, "
          f"{alone['arrow_b']:.0f} Arrow bytes each):\n"
          "| inbox write, us/record | inbox drop of a copy, us/record | id window, MB "
          "| merge CPU s per 100k records | merge peak MB per 100k records |\n| --- | --- | --- | --- | --- |\n"
          f"| {alone['write_us']:.1f} | {alone['drop_us']:.1f} | {alone['ids_mb']:.1f} | {alone['merge_cpu_100k']:.2f} "
          f"| {alone['merge_mb_100k']:.0f} |")
    good = all(r["lost"] == r["extra"] == r["dup"] == 0 and r["records"] == r["truth"] and r["exit_ok"] for r in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
