"""Which HTTP client should drive the load: client CPU per token and TTFT error, side by side.

Each candidate client streams Anthropic Messages requests from the simulator with
the full tokenload hot path (protocol adapter, SSE decoder, `StreamSession`,
`measure()` record, record dict kept in a list, four Locust stats entries per
request), in a fresh gevent-patched interpreter per (level, client) cell, the
way a Locust process runs it:

- `requests`: Locust's default `HttpUser` path: one `locust.clients.HttpSession`
  (a requests.Session) per user, `stream=True`, `iter_lines()`.
- `geventhttpclient`: tokenload's `Transport` (one shared pool per process; each
  body read inside the event loop by its socket's watcher, one kernel-stamped
  `recvmsg` per wake-up, the user's greenlet woken once per request; chunked
  bodies by the compiled core, `tokenload.transport._chunked`, where it was built).
- `geventhttpclient-pure`: the same with the pure-Python body reader (`TOKENLOAD_PURE_PYTHON=1`).
- `httpx`: one shared `httpx.Client` (unlimited pool), `iter_raw()`, like probe/doctor.
- `aiohttp-vllm` (a peer, not a tokenload candidate; `pip install -e '.[bench]'`): vLLM bench's
  streaming loop (`async_request_openai_chat_completions`) reproduced in a few lines on asyncio, no
  gevent: one shared `aiohttp.ClientSession`, `async for line in response.content`, `json.loads` of
  every `data:` line, a `perf_counter()` per chunk, TTFT at the first chunk with choices. It only
  speaks OpenAI chat, so run it with `--protocol openai-chat` (every cell then uses that protocol).
  It keeps its own light record (TTFT, ITLs, text), not tokenload's full record and Locust stats.

Per cell, every stream first sends one warm-up request (connection set up, not
measured), then `--rounds` measured requests back to back. Client CPU is
`time.process_time()` of the client process over the measured window only (the
simulator runs in its own process). TTFT error is the client's TTFT minus the
simulator's truth (`first_token - arrival`, truth file) per request: what the
client adds (loopback, scheduling, parsing). The simulator runs one decode step
per token per stream at `--tps` tokens/s with no batching slowdown, so every
token is its own SSE event and its own socket read (the worst case for a
client), and 500 x 50 tok/s = 25k tokens/s is well inside what one simulator
process sustains (benchmarks/sim_throughput.py: 0.14 core at that rate).

A last cell measures user spawn cost: CPU per `LLMUser` spawned by Locust's
local runner (shared transport), next to a per-user requests session (what
`HttpUser` creates) and a per-user `httpx.Client` (what a naive user creates).

    python benchmarks/client_overhead.py            # about 2 minutes on 2 cores

Targets (issue 15): >= 150k tokens per client CPU-second and >= 2x aiohttp-vllm at 500
streams; TTFT error p50 <= 2 ms and p99 <= 20 ms at 500 streams, p99 <= 5 ms at 100, the
client on one core (`--pin`, the default on 2+ CPUs: simulator on the last CPU, each cell
on CPU 0); spawn <= 1 ms CPU per user. `--tps 200` offers 100k tokens/s at 500 streams,
more than one core of any of these clients reads: the saturated case.
Bounded: each cell is killed after --cell-timeout seconds, and cells that would start
after --budget seconds (default 240) are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLIENTS = ("requests", "geventhttpclient", "httpx")
# tokenload's Transport with the pure-Python body reader (what runs where the compiled core was not built).
PURE = "geventhttpclient-pure"
PEERS = ("aiohttp-vllm",)
LEVELS = (10, 100, 500)
MODEL = "sim-7b"
TARGET_TOK_PER_CPU_S = 150_000
TARGET_PEER_RATIO = 2.0
TARGET_MEDIAN_MS, TARGET_P99_MS = 2.0, 20.0


# ----------------------------------------------------------------------------------- client side


def _channel(protocol: str, base_url: str):  # type: ignore[no-untyped-def]
    from tokenload.channel import resolve

    url = base_url + "/v1" if protocol.startswith("openai") else base_url
    return resolve(protocol=protocol, base_url=url, model=MODEL, env={}, home=Path(tempfile.mkdtemp())).channel


def _vllm_cell(protocol: str, base_url: str, streams: int, rounds: int, max_tokens: int, jitter: float,
               out: str) -> None:
    """vLLM bench's aiohttp streaming loop, as in its `backend_request_func.py`, timed like the other cells."""
    import asyncio
    import resource

    import aiohttp

    from tokenload.protocols import adapter_for
    from tokenload.tokens import synth_prompt

    if protocol != "openai-chat":
        raise SystemExit("aiohttp-vllm speaks OpenAI chat only: run with --protocol openai-chat")
    adapter = adapter_for(_channel(protocol, base_url))
    measured: list[dict] = []

    async def one(http: aiohttp.ClientSession, n: int, keep: bool) -> None:
        request = adapter.prepare(synth_prompt(32, seed=n), max_tokens, {"ignore_eos": True})
        ttft, itl, text, tokens, rid = 0.0, [], "", 0, None
        st = most_recent = time.perf_counter()
        async with http.post(request.url, data=request.body, headers=dict(request.headers)) as response:
            rid = response.headers.get("request-id")
            async for chunk_bytes in response.content:
                chunk_bytes = chunk_bytes.strip()
                if not chunk_bytes:
                    continue
                chunk = chunk_bytes.decode("utf-8").removeprefix("data: ")
                if chunk != "[DONE]":
                    data = json.loads(chunk)
                    timestamp = time.perf_counter()
                    if choices := data.get("choices"):
                        content = choices[0]["delta"].get("content")
                        if ttft == 0.0:
                            ttft = timestamp - st
                        else:
                            itl.append(timestamp - most_recent)
                        text += content or ""
                    elif usage := data.get("usage"):
                        tokens = usage.get("completion_tokens") or 0
                    most_recent = timestamp
        if keep:
            measured.append({"ok": ttft > 0, "ttft": ttft, "tokens": tokens, "rid": rid})

    async def main() -> dict:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as http:
            await asyncio.gather(*(one(http, i * 1000, False) for i in range(streams)))

            async def user(i: int) -> None:
                await asyncio.sleep(jitter * i / streams)
                for r in range(rounds):
                    await one(http, i * 1000 + r + 1, True)

            lag: list[float] = []
            done = asyncio.Event()

            async def probe() -> None:
                while not done.is_set():
                    due = time.perf_counter() + 0.05
                    await asyncio.sleep(0.05)
                    lag.append(time.perf_counter() - due)

            probing = asyncio.create_task(probe())
            ru0, cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
            results = await asyncio.gather(*(user(i) for i in range(streams)), return_exceptions=True)
            ru1, cpu, wall = (resource.getrusage(resource.RUSAGE_SELF), time.process_time() - cpu0,
                              time.perf_counter() - wall0)
            done.set()
            await probing
        ok = [m for m in measured if m["ok"]]
        lag.sort()
        return {"kind": "aiohttp-vllm", "streams": streams, "cpu_s": cpu, "sys_s": ru1.ru_stime - ru0.ru_stime,
                "wall_s": wall, "tokens": sum(m["tokens"] for m in ok), "requests": len(measured), "ok": len(ok),
                "errors": sorted({repr(e) for e in results if isinstance(e, BaseException)}),
                "ttft": [[m["rid"], m["ttft"]] for m in ok],
                "lag_p99_ms": lag[int(0.99 * (len(lag) - 1))] * 1000 if lag else None}

    Path(out).write_text(json.dumps(asyncio.run(main())))


def _cell(kind: str, protocol: str, base_url: str, streams: int, rounds: int, max_tokens: int, jitter: float,
          out: str) -> None:
    """One client process: `streams` greenlets, a warm-up request each, then `rounds` measured ones."""
    from gevent import monkey

    monkey.patch_all()
    import gevent
    from gevent.event import Event
    from locust.stats import RequestStats

    from tokenload.protocols import adapter_for
    from tokenload.stream import StreamSession
    from tokenload.tokens import estimate_tokens, synth_prompt

    channel = _channel(protocol, base_url)
    adapter = adapter_for(channel)
    perf = time.perf_counter
    stats = RequestStats()

    if kind in ("geventhttpclient", PURE):
        os.environ["TOKENLOAD_PURE_PYTHON"] = "1" if kind == PURE else "0"
        from tokenload.transport.gevent_client import Transport

        transport = Transport(channel)

        def new_driver():
            return transport.stream
    elif kind == "httpx":
        import httpx

        shared = httpx.Client(timeout=httpx.Timeout(60.0), limits=httpx.Limits(max_connections=None,
                                                                              max_keepalive_connections=None))

        def new_driver():
            def drive(request, session):
                with shared.stream("POST", request.url, headers=request.headers, content=request.body) as r:
                    session.on_headers(perf(), r.status_code, r.headers)
                    for chunk in r.iter_raw():
                        session.on_data(perf(), chunk)
                    session.on_end(perf())
            return drive
    else:
        from locust.clients import HttpSession
        from locust.env import Environment

        env = Environment()

        def new_driver():
            http = HttpSession(base_url="", request_event=env.events.request, user=None)

            def drive(request, session):
                with http.post(request.url, data=request.body, headers=dict(request.headers), stream=True,
                               catch_response=True) as r:
                    session.on_headers(perf(), r.status_code, {k.lower(): v for k, v in r.headers.items()})
                    for line in r.iter_lines():
                        session.on_data(perf(), line + b"\n")
                    session.on_end(perf())
                    r.success()
            return drive

    records: list[dict] = []
    measured: list[dict] = []
    go = Event()
    ready = [0]

    def one(drive, n: int, keep: bool) -> None:
        prompt = synth_prompt(32, seed=n)
        request = adapter.prepare(prompt, max_tokens, {"ignore_eos": True})
        session = StreamSession(adapter, perf(), estimated_input_tokens=estimate_tokens(prompt))
        session.timeline.t0 = perf()
        session.timeline.started_at = time.time()
        drive(request, session)
        record = session.record()
        record.update(request_id=f"r{n}", user_id="u", step=1, active_users=streams, scheduled_at=time.time(),
                      model=MODEL, max_tokens=max_tokens, in_flight=False)
        records.append(record)
        ms = (record["duration_s"] or 0.0) * 1000
        stats.log_request("POST", MODEL, ms, (record["output_tokens"] or 0) + (record["input_tokens"] or 0))
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            if record[name] is not None:
                stats.log_request(name, MODEL, record[name] * 1000, 0)
        if keep:
            measured.append(record)

    def user(i: int) -> None:
        drive = new_driver()
        one(drive, i * 1000, keep=False)
        ready[0] += 1
        if ready[0] == streams:
            go.set()
        go.wait()
        # Spread the streams over one request's length, as in a steady closed-loop run: a burst
        # of simultaneous requests would measure the simulator's accept queue, not the client.
        gevent.sleep(jitter * i / streams)
        for r in range(rounds):
            one(drive, i * 1000 + r + 1, keep=True)

    lag: list[float] = []

    def probe() -> None:
        while True:
            due = perf() + 0.05
            gevent.sleep(0.05)
            if go.is_set():
                lag.append(perf() - due)

    gevent.spawn(probe)
    greenlets = [gevent.spawn(user, i) for i in range(streams)]
    go.wait()
    import resource

    ru0, cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), perf()
    gevent.joinall(greenlets)
    ru1, cpu, wall = resource.getrusage(resource.RUSAGE_SELF), time.process_time() - cpu0, perf() - wall0
    sys_s = ru1.ru_stime - ru0.ru_stime
    errors = [g.exception for g in greenlets if g.exception is not None]
    ok = [r for r in measured if r["status"] == "ok"]
    lag.sort()
    Path(out).write_text(json.dumps({
        "kind": kind, "streams": streams, "cpu_s": cpu, "sys_s": sys_s, "wall_s": wall,
        "tokens": sum(r["output_tokens"] or 0 for r in ok), "requests": len(measured), "ok": len(ok),
        "errors": sorted({r["error_kind"] for r in measured if r["status"] != "ok"} | {repr(e) for e in errors}),
        "ttft": [[r["server_request_id"], r["ttft_s"]] for r in ok],
        "lag_p99_ms": lag[int(0.99 * (len(lag) - 1))] * 1000 if lag else None,
    }))


def _spawn_cell(base_url: str, users: int, out: str) -> None:
    """CPU per user spawned by Locust's runner (LLMUser, shared transport) and per-user client references."""
    from gevent import monkey

    monkey.patch_all()
    import random
    import uuid

    import gevent
    from locust.env import Environment

    from tokenload.channel import resolve
    from tokenload.load import roles
    from tokenload.load.records import SegmentWriter
    from tokenload.load.state import LoadState
    from tokenload.load.user import PROCESS, LLMUser, ProcessContext
    from tokenload.protocols import adapter_for
    from tokenload.transport.gevent_client import Transport
    from tokenload.workload.prompts import PromptSource
    from tokenload.workload.scenario import load_scenario

    class Parked:
        """Open-loop arrivals that never come: spawned users park in their first task."""

        def wait(self) -> float:
            gevent.sleep(3600)
            return 0.0

    channel = resolve(protocol="anthropic", base_url=base_url, model=MODEL, env={}, home=Path(tempfile.mkdtemp())).channel
    scenario = load_scenario("smoke")
    env = Environment(user_classes=[LLMUser])
    runner = env.create_local_runner()
    roles.attach(env).put(PROCESS, ProcessContext(
        run_id="bench", worker="local", tag=uuid.uuid4().hex[:8], protocol="anthropic",
        adapters={MODEL: adapter_for(channel)}, transport=Transport(channel),
        prompts=PromptSource(scenario, (MODEL,), random.getrandbits(31)),
        writer=SegmentWriter(Path(tempfile.mkdtemp()), "local"), state=LoadState(), arrivals=Parked(),  # type: ignore[arg-type]
        extra_body={}, think_time_s=0.0))
    cpu0 = time.process_time()
    runner.spawn_users({"LLMUser": users}, wait=False)
    gevent.sleep(0.5)  # every user's greenlet runs on_start and parks
    llm_user_ms = (time.process_time() - cpu0) / users * 1000
    assert runner.user_count == users, runner.user_count

    import httpx
    from locust.clients import HttpSession

    n = 50
    cpu0 = time.process_time()
    sessions = [HttpSession(base_url=base_url, request_event=env.events.request, user=None) for _ in range(n)]
    session_ms = (time.process_time() - cpu0) / n * 1000
    n = 20
    cpu0 = time.process_time()
    clients = [httpx.Client() for _ in range(n)]
    httpx_ms = (time.process_time() - cpu0) / n * 1000
    del sessions, clients
    runner.quit()
    Path(out).write_text(json.dumps({"users": users, "llm_user_ms": llm_user_ms, "http_session_ms": session_ms,
                                     "httpx_client_ms": httpx_ms}))


# ----------------------------------------------------------------------------------- driver

# The simulator in its own process, started through `serve_in_thread`: asyncio then creates the
# listening socket itself and sets TCP_NODELAY on every connection. (`tokenload sim` builds its
# listener by hand with proto 0, so asyncio skips TCP_NODELAY and Nagle holds the first token
# behind the response headers until the client's delayed ACK: about 40 ms on every reused
# connection, outside the truth file's timestamps. Reported to the simulator's owner.)
_SIM = f"""
import sys
from tokenload.sim import serve_in_thread
with serve_in_thread(sys.argv[1], truth_path=sys.argv[2], models=[{MODEL!r}]) as sim:
    print(sim.base_url, flush=True)
    sys.stdin.read()
"""


def _on_cpu(cpu: int | None):  # type: ignore[no-untyped-def]
    """A `preexec_fn` that pins the child to `cpu` (None: no pinning)."""
    return None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))


def _child(args: list[str], timeout: float, cpu: int | None) -> dict | None:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    try:
        proc = subprocess.run([sys.executable, __file__, *args, "--out", str(out)], timeout=timeout,
                              capture_output=True, text=True, preexec_fn=_on_cpu(cpu))
        if proc.returncode != 0:
            print(f"  cell {' '.join(args[:4])} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(out.read_text())
    except subprocess.TimeoutExpired:
        print(f"  cell {' '.join(args[:4])} timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    finally:
        out.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrent streams per cell")
    parser.add_argument("--clients", default=",".join(CLIENTS),
                        help=f"clients to compare: {', '.join(CLIENTS + (PURE,) + PEERS)}")
    parser.add_argument("--protocol", default="anthropic", choices=("anthropic", "openai-chat"),
                        help="wire protocol of every cell (aiohttp-vllm needs openai-chat)")
    parser.add_argument("--tps", type=float, default=50.0, help="tokens/s per stream from the simulator")
    parser.add_argument("--max-tokens", type=int, default=200, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=1, help="measured requests per stream")
    parser.add_argument("--spawn-users", type=int, default=1000, help="users spawned in the spawn-cost cell (0: no such cell)")
    parser.add_argument("--cell-timeout", type=float, default=60.0, help="seconds before a cell is killed")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run; later cells are skipped")
    parser.add_argument("--repeat", type=int, default=1, help="cells per (client, level), in alternating order")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                        help="simulator on the last CPU, each client cell on CPU 0 (default with 2+ CPUs)")
    args = parser.parse_args()
    if args.cell == "spawn":
        _spawn_cell(args.base_url, args.spawn_users, args.out)
        return 0
    if args.cell in PEERS:
        _vllm_cell(args.protocol, args.base_url, args.streams, args.rounds, args.max_tokens,
                   args.max_tokens / args.tps, args.out)
        return 0
    if args.cell:
        _cell(args.cell, args.protocol, args.base_url, args.streams, args.rounds, args.max_tokens, args.max_tokens / args.tps, args.out)
        return 0

    from tokenload.measure import quantile

    levels = [int(x) for x in args.levels.split(",")]
    clients = args.clients.split(",")
    tmp = Path(tempfile.mkdtemp())
    truth = tmp / "truth.jsonl"
    profile = tmp / "bench.toml"
    replicas = 8
    profile.write_text(f'extends = "fast"\nslots = {-(-max(levels) // replicas) + 1}\nreplicas = {replicas}\n'
                       f"decode_base_s = {1 / args.tps}\ndecode_per_seq_s = 0.0\nprefill_base_s = 0.002\n"
                       "prefill_per_token_s = 0.00001\nprefill_interference = 0.0\n")
    client_cpu = 0 if args.pin else None
    sim = subprocess.Popen([sys.executable, "-c", _SIM, str(profile), str(truth)], stdout=subprocess.PIPE,
                           stdin=subprocess.PIPE, text=True,
                           preexec_fn=_on_cpu((os.cpu_count() or 1) - 1 if args.pin else None))
    started = time.monotonic()
    try:
        assert sim.stdout is not None
        base_url = sim.stdout.readline().strip()
        results = []
        for level in levels:
            # The clients of one level run back to back (same machine load), in alternating order per repeat.
            order = [c for r in range(args.repeat) for c in (clients if r % 2 == 0 else clients[::-1])]
            for kind in order:
                common = ["--base-url", base_url, "--protocol", args.protocol, "--streams", str(level), "--rounds", str(args.rounds),
                          "--max-tokens", str(args.max_tokens), "--tps", str(args.tps)]
                left = args.budget - (time.monotonic() - started)
                if left < 5:
                    print(f"  {kind:>27} x {level:<4} skipped: --budget spent", file=sys.stderr)
                    continue
                res = _child(["--cell", kind, *common], min(args.cell_timeout, left), client_cpu)
                if res is not None:
                    results.append(res)
                    print(f"  {kind:>27} x {level:<4} done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
        spawn = _child(["--cell", "spawn", "--base-url", base_url, "--spawn-users", str(args.spawn_users)],
                       max(5.0, min(args.cell_timeout, args.budget - (time.monotonic() - started))),
                       client_cpu) if args.spawn_users > 0 else None
    finally:
        sim.communicate(timeout=10)
    server = {}
    for line in truth.read_text().splitlines():
        t = json.loads(line)
        if t.get("first_token") is not None:
            server[t["request_id"]] = t["first_token"] - t["arrival"]

    print(f"tokenload client overhead: simulator at {args.tps:g} tokens/s per stream, {args.max_tokens} tokens per "
          f"request, {args.rounds} measured requests per stream, {args.protocol}; {os.cpu_count()} CPUs, python "
          f"{sys.version.split()[0]}")
    header = ("client", "streams", "tokens", "client CPU s", "(kernel)", "kernel us/tok", "tok/CPU-s", "x peer",
              "TTFT err p50", "TTFT err p99", "loop lag p99", "errors")
    rows = []

    def rate(res: dict) -> float:
        return res["tokens"] / res["cpu_s"] if res["cpu_s"] else float("nan")

    peer_rate = {}  # level -> the peer's mean tok/CPU-s over its cells
    for level in levels:
        cells = [rate(r) for r in results if r["kind"] in PEERS and r["streams"] == level]
        if cells:
            peer_rate[level] = statistics.mean(cells)
    for res in results:
        errs = [1000 * (ttft - server[rid]) for rid, ttft in res["ttft"] if rid in server]
        tok_cpu = rate(res)
        peer = peer_rate.get(res["streams"])
        rows.append((res["kind"], str(res["streams"]), f"{res['tokens']:,}", f"{res['cpu_s']:.2f}",
                     f"{res['sys_s'] / res['cpu_s']:.0%}" if res["cpu_s"] else "-",
                     f"{1e6 * res['sys_s'] / res['tokens']:.1f}" if res["tokens"] else "-", f"{tok_cpu:,.0f}",
                     f"{tok_cpu / peer:.2f}x" if peer else "-",
                     f"{statistics.median(errs):.2f} ms" if errs else "-",
                     f"{quantile(sorted(errs), 0.99):.2f} ms" if errs else "-",
                     f"{res['lag_p99_ms']:.1f} ms" if res["lag_p99_ms"] is not None else "-",
                     f"{res['requests'] - res['ok']}" + (f" {res['errors']}" if res["errors"] else "")))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(f"targets: >= {TARGET_TOK_PER_CPU_S:,} tok/CPU-s ({1e6 / TARGET_TOK_PER_CPU_S:.1f} us of client CPU per "
          f"token, the kernel's part included) and >= {TARGET_PEER_RATIO:g}x the peer; TTFT error p50 <= "
          f"{TARGET_MEDIAN_MS:g} ms, p99 <= {TARGET_P99_MS:g} ms at 500 streams (p99 <= 5 ms at 100); client "
          + ("pinned to CPU 0" if args.pin else "not pinned"))
    if spawn:
        print(f"user spawn CPU: LLMUser via Locust's runner {spawn['llm_user_ms']:.3f} ms/user ({spawn['users']} users, "
              f"shared transport); reference per-user clients: HttpSession {spawn['http_session_ms']:.3f} ms, "
              f"httpx.Client {spawn['httpx_client_ms']:.2f} ms (target <= 1 ms)")
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
