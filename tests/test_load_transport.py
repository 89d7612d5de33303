"""The hot-path transport (geventhttpclient, one read per recv, per-stream deadlines) against the simulator.

The transport needs a gevent-patched interpreter, so each case runs in a child
process (`_CHILD`) that prints one JSON record per request.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from loadkit import READERS, reader_env
from simfixtures import read_truth

from tokenload.sim import launch
from tokenload.sim.runner import SimProcess

_CHILD = r"""
from gevent import monkey; monkey.patch_all()
import dataclasses, json, sys, tempfile, time
from pathlib import Path
import gevent
from tokenload.channel import resolve
from tokenload.transport.gevent_client import Transport
from tokenload.protocols import adapter_for
from tokenload.stream import StreamSession

base_url, model, first, idle, cases = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), json.loads(sys.argv[5])
channel = resolve(protocol="anthropic", base_url=base_url, model=model, env={}, home=Path(tempfile.mkdtemp())).channel
channel = dataclasses.replace(channel, first_token_timeout_s=first, idle_timeout_s=idle)
adapter = adapter_for(channel)
transport = Transport(channel)
for prompt, max_tokens, kill_after in cases:
    session = StreamSession(adapter, time.perf_counter())
    request = adapter.prepare(prompt, max_tokens, {"ignore_eos": True})
    session.timeline.t0 = time.perf_counter()
    g = gevent.spawn(transport.stream, request, session)
    if kill_after is not None:
        gevent.sleep(kill_after)
        g.kill()
    g.join()
    record = session.record()
    record["killed"] = kill_after is not None and isinstance(g.value, gevent.GreenletExit)
    print(json.dumps(record), flush=True)
"""


def _run(base_url: str, cases: list[tuple[str, int, float | None]], *, model: str = "sim-7b", first: float = 2.0,
         idle: float = 0.5, reader: str = "compiled") -> list[dict]:
    out = subprocess.run([sys.executable, "-c", _CHILD, base_url, model, str(first), str(idle), json.dumps(cases)],
                         capture_output=True, text=True, timeout=60, env=reader_env(reader))
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    with launch(["--truth", str(tmp_path_factory.mktemp("sim") / "truth.jsonl")]) as sim:
        yield sim


@pytest.fixture(scope="module")
def sim_url(sim: SimProcess) -> str:
    return sim.base_url


@pytest.mark.parametrize("reader", READERS)
def test_stream_faults_are_recorded_and_the_pool_recovers(sim_url: str, reader: str) -> None:
    ok = ("hello", 12, None)
    records = _run(sim_url, [
        ok,
        ("[[fault:stall after=3 seconds=3]] hi", 12, None),
        ok,
        ("[[fault:silence seconds=10]] hi", 12, None),
        ok,
        ("[[fault:slow_headers seconds=5]] hi", 12, None),
        ok,
        ("[[fault:disconnect after=4]] hi", 12, None),
        ("[[fault:reset after=4]] hi", 12, None),
        ("[[fault:split bytes=1]] hi", 12, None),
        ("hello", 200, 0.8),  # the user is stopped mid-stream: GreenletExit, the socket is dropped
        ok,
    ], first=1.5, idle=0.5, reader=reader)
    kinds = [r["error_kind"] for r in records]
    assert kinds == [None, "timeout_stall", None, "timeout_first_token", None, "timeout_first_token", None,
                     "disconnected", "disconnected", None, None, None]
    ok_records = [records[i] for i in (0, 2, 4, 6, 9, 11)]
    assert all(r["output_tokens"] == 12 and r["status"] == "ok" for r in ok_records)
    stall, silence, slow = records[1], records[3], records[5]
    assert stall["output_tokens"] == 3 or stall["chunks"] == 3  # keeps what it got before the stall
    assert 0.4 < stall["duration_s"] - stall["e2e_s"] < 1.6  # ended by the idle timeout (0.5 s), not the 3 s stall
    assert 1.4 < silence["duration_s"] < 2.8  # the first-token deadline (1.5 s), not the 10 s silence
    assert slow["duration_s"] < 3.5
    assert records[7]["chunks"] == 4 and records[8]["chunks"] == 4
    killed = records[10]
    assert killed["killed"] and 0 < killed["chunks"] < 200, killed["chunks"]
    # Stopped at 0.8 s, a token every 20 ms: the last one kept is recent (the compiled reader puts the tokens it
    # counted on the timeline when the user stops; its deadline's last look, at 0.5 s, is not enough).
    assert killed["e2e_s"] > 0.6, killed["e2e_s"]


@pytest.mark.parametrize("reader", READERS)
def test_each_event_is_stamped_when_it_arrives(sim: SimProcess, reader: str) -> None:
    """One recv per read: a 20 ms-per-token stream shows the gaps the simulator wrote its tokens at (its truth
    file: a busy machine makes them longer), not batches."""
    [record] = _run(sim.base_url, [("hello", 30, None)], reader=reader)
    assert record["status"] == "ok" and record["output_tokens"] == 30
    assert sim.truth_path is not None
    truth = read_truth(sim.truth_path)[record["server_request_id"]]
    written = (truth["last_token"] - truth["first_token"]) / (truth["output_tokens"] - 1)
    assert record["tpot_s"] == pytest.approx(written, abs=0.002), truth
    assert written / 2 < record["itl_p50_s"] < written * 1.5, written  # batched reads: gaps of 0


def test_unknown_model_is_a_recorded_error(sim_url: str) -> None:
    [record] = _run(sim_url, [("hello", 5, None)], model="no-such-model")
    assert record["status"] == "error" and record["error_kind"] == "not_found_model" and record["http_status"] == 404


def test_a_late_request_counts_the_streaming_responses_at_most_every_count_interval() -> None:
    from tokenload.transport.gevent_client import COUNT_EVERY_S, _InFlight

    class Response:  # a deadline's view of its response: streaming or not
        def __init__(self, streaming: bool) -> None:
            self.streams = streaming

        def streaming(self) -> bool:
            return self.streams

    flights = _InFlight()
    flights.deadlines.update({Response(True), Response(True), Response(False)})  # type: ignore[arg-type]
    assert flights.streaming() == 2
    assert flights.streaming() is None  # counted under COUNT_EVERY_S ago: each count syncs every response
    flights.counted_at -= COUNT_EVERY_S
    flights.deadlines.add(Response(True))  # type: ignore[arg-type]
    assert flights.streaming() == 3
