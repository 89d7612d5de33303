"""How many concurrent streams and tokens/s the simulator sustains on one core, on schedule.

The simulator runs as `tokenload sim` in its own process pinned to CPU 0; load
comes from separate client processes (pinned to the other CPUs when there are
any) that open streaming chat requests over loopback and count token events.
The simulator's own `sim_token_write_lateness_seconds` histogram (how late each
token write was against the simulated schedule) and its CPU time are read
before and after a measurement window, so ramp-up is excluded.

    python benchmarks/sim_throughput.py                      # 1000 streams x 100 tokens/s
    python benchmarks/sim_throughput.py --streams 2000 --tps 50 --workers 2

Target (issue 3): >= 1000 streams and >= 100k tokens/s with p99 lateness <= 5 ms.
Bounded: every client stops after --seconds plus ramp, and the whole run after 2 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MARKER = b'"content":"'
HARD_LIMIT_S = 120


class _Stream(asyncio.Protocol):
    def __init__(self, request: bytes, counter: list[int]) -> None:
        self.request = request
        self.counter = counter
        self.tail = b""
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        buf = self.tail + data
        self.counter[0] += buf.count(MARKER)
        self.tail = buf[-(len(MARKER) - 1):]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def _client_main(host: str, port: int, path: str, streams: int, tokens: int, ramp_s: float,
                       counter: list[int]) -> None:
    body = (b'{"model":"sim-7b","stream":true,"ignore_eos":true,"max_tokens":%d,'
            b'"messages":[{"role":"user","content":"benchmark"}]}' % tokens)
    request = (f"POST {path}/v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    start = loop.time()
    protocols = []
    for i in range(streams):
        # Paced by the clock, not by sleep lengths, so a busy client still finishes its ramp on time.
        delay = start + ramp_s * i / streams - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        _, proto = await loop.create_connection(lambda: _Stream(request, counter), host, port)
        protocols.append(proto)
    await asyncio.gather(*(p.closed for p in protocols))


def _client(host: str, port: int, path: str, streams: int, tokens: int, ramp_s: float, cpus: set[int],
            shared: mp.sharedctypes.Synchronized) -> None:  # type: ignore[name-defined]
    if cpus:
        os.sched_setaffinity(0, cpus)
    counter = [0]

    async def run() -> None:
        task = asyncio.create_task(_client_main(host, port, path, streams, tokens, ramp_s, counter))
        while not task.done():
            await asyncio.sleep(0.25)
            shared.value = counter[0]
        await task
        shared.value = counter[0]

    asyncio.run(run())


def _scrape(base_url: str) -> tuple[dict[float, int], int, int]:
    """Lateness buckets, tokens written and streams decoding, from the simulator's /metrics."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    buckets = {float(le): int(v) for le, v in re.findall(r'sim_token_write_lateness_seconds_bucket\{le="([^"+]+)"\} (\d+)', text)}
    tokens = int(re.search(r"^sim_tokens_total (\d+)", text, re.M).group(1))  # type: ignore[union-attr]
    running = sum(int(n) for n in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\d+)", text, re.M))
    return buckets, tokens, running


def _quantile(before: dict[float, int], after: dict[float, int], q: float) -> float:
    """Quantile of the lateness observed between two scrapes of the cumulative buckets."""
    bounds = sorted(set(before) | set(after))

    def cumulative(snapshot: dict[float, int], bound: float) -> int:
        below = [b for b in snapshot if b <= bound]
        return snapshot[max(below)] if below else 0

    total = cumulative(after, bounds[-1]) - cumulative(before, bounds[-1])
    for bound in bounds:
        if cumulative(after, bound) - cumulative(before, bound) >= q * total:
            return bound
    return bounds[-1]


def _cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tps", type=float, default=100.0, help="tokens/s per stream (decode step = 1/tps)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measurement window")
    parser.add_argument("--ramp", type=float, default=5.0, help="seconds to open all streams")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--workers", type=int, default=1, help="simulator processes (SO_REUSEPORT)")
    parser.add_argument("--replicas", type=int, default=8, help="engine replicas (staggered step phases)")
    args = parser.parse_args()

    ncpu = os.cpu_count() or 1
    server_cpus = set(range(min(args.workers, ncpu)))
    client_cpus = set(range(len(server_cpus), ncpu)) or set(range(ncpu))
    tokens_per_stream = int(args.tps * (args.ramp + args.seconds + 3))
    slots = -(-args.streams // args.replicas)
    profile = Path(tempfile.mkdtemp()) / "bench.toml"
    profile.write_text(f"extends = \"fast\"\nslots = {slots}\nreplicas = {args.replicas}\n"
                       f"decode_base_s = {1 / args.tps}\ndecode_per_seq_s = 0.0\nprefill_base_s = 0.001\n")
    server = subprocess.Popen([sys.executable, "-m", "tokenload", "sim", "--port", "0", "--profile", str(profile),
                               "--workers", str(args.workers)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.sched_setaffinity(0, server_cpus))
    try:
        assert server.stdout is not None
        base_url = server.stdout.readline().strip()
        match = re.match(r"http://([^:/]+):(\d+)(.*)", base_url)
        assert match, base_url
        host, port, path = match.group(1), int(match.group(2)), match.group(3)
        time.sleep(0.5)
        server_pids = [server.pid] + _children(server.pid)
        shared = [mp.Value("q", 0) for _ in range(args.clients)]
        per_client = [args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients)]
        clients = [mp.Process(target=_client, args=(host, port, path, n, tokens_per_stream, args.ramp, client_cpus, s))
                   for n, s in zip(per_client, shared)]
        for c in clients:
            c.start()
        time.sleep(args.ramp + 1.0)
        lat0, tok0, running0 = _scrape(base_url)
        cpu0, recv0, t0 = _cpu_seconds(server_pids), sum(s.value for s in shared), time.monotonic()
        time.sleep(args.seconds)
        lat1, tok1, running1 = _scrape(base_url)
        cpu1, recv1, t1 = _cpu_seconds(server_pids), sum(s.value for s in shared), time.monotonic()
        for c in clients:
            c.join(timeout=max(1.0, HARD_LIMIT_S - (time.monotonic() - t0)))
            if c.is_alive():
                c.terminate()
    finally:
        server.terminate()
        server.wait(timeout=10)
    elapsed = t1 - t0
    rows = [
        ("concurrent streams", f"{args.streams} (decoding at start/end of window: {running0}/{running1})"),
        ("simulator processes / CPUs", f"{args.workers} / {sorted(server_cpus)}"),
        ("offered tokens/s", f"{args.streams * args.tps:,.0f}"),
        ("tokens/s written (server)", f"{(tok1 - tok0) / elapsed:,.0f}" + ("  (the worker that answered /metrics)" if args.workers > 1 else "")),
        ("tokens/s received (clients)", f"{(recv1 - recv0) / elapsed:,.0f}"),
        ("simulator CPU (cores)", f"{(cpu1 - cpu0) / elapsed:.2f}"),
        ("write lateness p50", f"{_quantile(lat0, lat1, 0.50) * 1000:.1f} ms"),
        ("write lateness p99", f"{_quantile(lat0, lat1, 0.99) * 1000:.1f} ms"),
        ("write lateness p99.9", f"{_quantile(lat0, lat1, 0.999) * 1000:.1f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"tokenload sim throughput ({elapsed:.1f} s window, {ncpu} CPUs, python {sys.version.split()[0]})")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
