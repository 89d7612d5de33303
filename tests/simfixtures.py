"""Helpers for the simulator tests: a raw HTTP/1.1 client that keeps wire detail, and an SSE parser;
the simulator fixtures, among them the three longest runs, done side by side.

The raw client exists because the faults under test (RST vs FIN, missing final
chunk, one byte per chunk, CR-only line ends) are exactly what higher-level
clients hide. The SSE parser follows the SSE framing rules independently of the
simulator's encoder, so a framing bug cannot cancel itself out.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tokenload.channel import Channel
from tokenload.dayclock import DAY_S
from tokenload.history.sampler import Watcher, WatchPlan, probe_scenario
from tokenload.history.store import open_store
from tokenload.sim import serve_in_thread
from tokenload.sim.engine import LATENESS_BUCKET_S, LATENESS_BUCKETS
from tokenload.sim.runner import SimHandle


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    t_sent: float
    t_headers: float
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    ended: str = "complete"  # complete | eof (FIN before the body ended) | reset | timeout

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.chunks)

    def token_times(self, marker: bytes = b"text_delta") -> list[float]:
        """Arrival time of each body chunk holding a token (the simulator writes one token per chunk)."""
        return [t for t, data in self.chunks for _ in range(data.count(marker))]

    def ttft(self, marker: bytes = b"text_delta") -> float:
        return self.token_times(marker)[0] - self.t_sent

    def tpot(self, marker: bytes = b"text_delta") -> float:
        times = self.token_times(marker)
        return (times[-1] - times[0]) / (len(times) - 1)

    def events(self) -> list[tuple[str | None, str]]:
        return parse_sse(self.body)

    def json_events(self) -> list[dict[str, Any]]:
        return [json.loads(data) for _, data in self.events() if data != "[DONE]"]


def raw_request(base_url: str, path: str, body: dict[str, Any] | bytes | None = None, *, method: str = "POST",
                headers: dict[str, str] | None = None, timeout: float = 10.0) -> RawResponse:
    """Send one request on a fresh connection and record every body chunk with its arrival time."""
    url = urlsplit(base_url)
    payload = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    head = [f"{method} {url.path}{path} HTTP/1.1", f"Host: {url.netloc}", f"Content-Length: {len(payload)}",
            "Content-Type: application/json"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock = socket.create_connection((url.hostname, url.port), timeout=timeout)
    reader = _Reader(sock)
    try:
        t_sent = time.monotonic()
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        status_line = reader.line()
        t_headers = time.monotonic()
        hdrs: dict[str, str] = {}
        while (line := reader.line()) != b"":
            name, _, value = line.decode("latin-1").partition(":")
            hdrs[name.strip().lower()] = value.strip()
        response = RawResponse(int(status_line.split()[1]), hdrs, t_sent, t_headers)
        try:
            if hdrs.get("transfer-encoding") == "chunked":
                while True:
                    size = int(reader.line().split(b";")[0], 16)
                    if size == 0:
                        reader.line()
                        break
                    data = reader.exact(size)
                    response.chunks.append((time.monotonic(), data))
                    reader.exact(2)
            else:
                response.chunks.append((time.monotonic(), reader.exact(int(hdrs.get("content-length", "0")))))
        except EOFError:
            response.ended = "eof"
        except ConnectionResetError:
            response.ended = "reset"
        except TimeoutError:
            response.ended = "timeout"
        return response
    finally:
        sock.close()


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError
        self.buf += data

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data


def parse_sse(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) per dispatched event: any line ends, BOM, comments, joined data lines."""
    text = raw.decode("utf-8")
    if text.startswith("\ufeff"):
        text = text[1:]
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line == "":
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
    return events


def worst_lateness_s(sim: SimHandle) -> float:
    """How late the simulator wrote its latest token so far (the top of its own lateness histogram, 0.1 ms
    buckets, the last one 0.1 s and more): what a busy machine added to the times it was asked to keep. A test
    that times the simulator widens its margin by this much, no more."""
    counts = sim.server.stats.lateness
    top = max((i for i, n in enumerate(counts) if n), default=0)
    return min(top + 1, LATENESS_BUCKETS) * LATENESS_BUCKET_S


def truth_tpot(rec: dict[str, Any]) -> float:
    """A truth line's TPOT: the gaps between the tokens the simulator wrote."""
    return float((rec["last_token"] - rec["first_token"]) / (rec["output_tokens"] - 1))


def read_truth(path: Path) -> dict[str, dict[str, Any]]:
    """Truth lines by request id."""
    lines = path.read_text().splitlines()
    return {rec["request_id"]: rec for rec in map(json.loads, lines)}


def chat_body(prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-7b", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": prompt}], **extra}


def anthropic_body(prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-7b", "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": prompt}], **extra}


def responses_body(prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-7b", "max_output_tokens": max_tokens, "stream": True, "input": prompt, **extra}


@pytest.fixture(scope="module")
def fast_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One fast-profile simulator with a truth file, shared by a test module."""
    truth = tmp_path_factory.mktemp("sim") / "truth.jsonl"
    with serve_in_thread("fast", truth_path=truth) as handle:
        yield handle


# ------------------------------------------------------------------ the three longest runs, side by side
#
# `tokenload demo` (two short ramps, about 30 s), `tokenload demo --history` (a simulated day in 48 s) and
# a Watcher over the diurnal simulator (a day in 48 s) spend most of their time waiting on the clock: each
# keeps a fifth to a third of one core busy. Started together they take as long as the longest one, not
# the sum (about 50 s instead of 120 s); each against a simulator of its own, whose truth its test reads.
# Only the runs that a selected test asks for are started, and all of them have ended before the first of
# those tests goes on: nothing runs beside any other test.


@dataclass(frozen=True)
class DemoRun:
    """A finished `tokenload demo` command: its --out directory and what it returned and printed."""

    out: Path
    proc: subprocess.CompletedProcess[str]


@dataclass(frozen=True)
class DiurnalWatch:
    """A Watcher's history (`db`) of one diurnal day compressed into `period_s`, with the simulator's truth."""

    db: Path
    truth: Path
    period_s: float
    key: str


DIURNAL_KEY = "sk-history-SECRET-0123456789ab"


def watch_a_diurnal_day(root: Path, period: float = 48.0) -> DiurnalWatch:
    """Watch the diurnal simulator (keyed) through one compressed day into root/h.db: 2 s per hour at 48 s."""
    db, truth = root / "h.db", root / "truth.jsonl"
    probe = probe_scenario(32, 4)
    with serve_in_thread("diurnal", time_scale=DAY_S / period, decode_base_s=0.01, api_key=DIURNAL_KEY,
                         truth_path=truth) as sim, closing(open_store(db)) as store:
        stop = threading.Event()
        watcher = Watcher(store, Channel(base_url=sim.base_url, model="sim-7b", api_key=DIURNAL_KEY),
                          WatchPlan(every_s=0.15, requests=2, period_s=period), probe, stop=stop)
        timer = threading.Timer(period + 1, stop.set)
        timer.start()
        watcher.run()
        timer.cancel()
    return DiurnalWatch(db, truth, period, DIURNAL_KEY)


# fixture name -> the `tokenload demo` options besides --out, its timeout in seconds, and its niceness. The
# history demo's day lasts 48 s: at 36 s a peak hour (1.5 s, each sample's two requests 0.3 s apiece) held 4-5
# requests, and an hour needs 5 for its ratio (13-16 h was found as 13 h alone in 3 of 6 runs side by side). The
# demo's searches yield the CPU to the compressed days, whose hours they slowed unevenly (they end mid-day).
DEMOS: dict[str, tuple[tuple[str, ...], float, int]] = {
    "demo_run": (("--duration", "10"), 240, 19),
    "history_demo_run": (("--history", "--duration", "48"), 180, 0),
}
WATCH = "diurnal_watch"


@pytest.fixture(scope="session")
def _side_by_side(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Fixture name -> its finished run (or what it raised), for each of them that a selected test uses."""
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    started = time.monotonic()
    demos: dict[str, tuple[Path, subprocess.Popen[str], float]] = {}
    for name, (options, timeout, niceness) in DEMOS.items():
        if name in wanted:
            # The console script, run where a folder named `tokenload` would shadow the package in a child that
            # imported from the working directory (the parent of a clone).
            cwd = tmp_path_factory.mktemp(name)
            (cwd / "tokenload").mkdir()
            out = cwd / "demo"
            command = ["nice", "-n", str(niceness), str(Path(sysconfig.get_path("scripts")) / "tokenload"), "demo",
                       *options, "--out", str(out)]
            demos[name] = out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True, cwd=cwd), timeout
    done: dict[str, Any] = {}
    try:
        if WATCH in wanted:
            try:
                done[WATCH] = watch_a_diurnal_day(tmp_path_factory.mktemp("diurnal"))
            except Exception as exc:  # raised again in the test that reads it
                done[WATCH] = exc
        for name, (out, proc, timeout) in demos.items():
            try:
                stdout, stderr = proc.communicate(timeout=max(0.0, started + timeout - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                done[name] = exc
            else:
                done[name] = DemoRun(out, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for _, proc, _ in demos.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def _finished(runs: dict[str, Any], name: str) -> Any:
    if isinstance(runs[name], BaseException):
        raise runs[name]
    return runs[name]


@pytest.fixture
def demo_run(_side_by_side: dict[str, Any]) -> DemoRun:
    """`tokenload demo --duration 10`: off-peak and peak runs, reports and their comparison."""
    return _finished(_side_by_side, "demo_run")


@pytest.fixture
def history_demo_run(_side_by_side: dict[str, Any]) -> DemoRun:
    """`tokenload demo --history --duration 48`: a compressed simulated day watched and reported."""
    return _finished(_side_by_side, "history_demo_run")


@pytest.fixture
def diurnal_watch(_side_by_side: dict[str, Any]) -> DiurnalWatch:
    """`watch_a_diurnal_day` over 48 s."""
    return _finished(_side_by_side, WATCH)
