"""Records over Locust's messages (`tokenload/load/courier.py`): a real Locust master and worker, one process.

The child process (gevent's monkey-patching stays out of pytest's) builds a real `MasterRunner` and a real
`WorkerRunner` talking over ZeroMQ on loopback, the master's `Inbox` on its run directory and a worker whose
writer spools (the run is not on its disk). It sends a batch three times before any acknowledgement could arrive
(what a resend after a lost ack or a reset connection looks like to the master), then, from a second worker,
records the master already has beside a new one;
then finalises the run like `tokenload run` does, then writes after the seal: the results are printed as JSON
for the assertions here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHILD = r"""
import argparse, json, socket, sys, time
from pathlib import Path

from locust import argument_parser
from locust.env import Environment
import gevent
import pyarrow.parquet as pq

from tokenload.load import courier, messages, records, roles
from tokenload.load.rundirs import finalise, write_run_info
from tokenload.workload.scenario import load_scenario

run_dir = Path(sys.argv[1])

def options(**tokenload):
    # Locust's own defaults (its runners read them), plus the options tokenload's plugin adds
    parser = argument_parser.get_empty_argument_parser()
    argument_parser.setup_parser_arguments(parser)
    opts = parser.parse(args=[])
    vars(opts).update(tokenload)
    return opts

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
write_run_info(run_dir, "run-1", load_scenario("smoke"), {})
master_env = Environment()
master = master_env.create_master_runner("127.0.0.1", port)
roles.attach(master_env)
received = []  # the batch numbers as the master's inbox saw them, copies included
courier.receive(master_env, lambda run_id: run_dir if run_id == "run-1" else None)
take = master.custom_messages[messages.BATCH_MESSAGE][0]

def counting(environment, msg, **kw):
    if msg.data["seq"] is not None:
        received.append(msg.data["seq"])
    take(environment=environment, msg=msg, **kw)

master.custom_messages[messages.BATCH_MESSAGE] = (counting, False)
worker_env = Environment()
worker = worker_env.create_worker_runner("127.0.0.1", port)
courier.follow_acks(roles.attach(worker_env))
deadline = time.monotonic() + 20
while not master.clients and time.monotonic() < deadline:
    gevent.sleep(0.1)
spool = run_dir.parent / "worker"
writer = courier.writer_for(worker_env, "run-1", Path("elsewhere"), spool, "w1")  # not on this disk: a spool

def rows(first, n):
    return [{"request_id": f"r{i}", "run_id": "run-1", "worker": "w1", "status": "ok", "started_at": float(i),
             "output_tokens": 1, "in_flight": False} for i in range(first, first + n)]

def flush(writer, done=False):
    writer.flush({"pid": 1}, done=done)
    courier.pump(roles.of(worker_env))

courier.RESEND_S = 0.0  # every pump sends every batch not yet acknowledged
for r in rows(0, 5):
    writer.append(r)
flush(writer)
courier.pump(roles.of(worker_env))  # no ack can have arrived (nothing yielded): batch 0 goes out again
for r in rows(5, 3):
    writer.append(r)
flush(writer)
gevent.sleep(1.5)
spooled_after_acks = sorted(p.name for p in spool.rglob("*.arrow"))
state_before_done = json.loads((run_dir / "segments" / "w1.state.json").read_text())
flush(writer, done=True)
gevent.sleep(1.0)
state = json.loads((run_dir / "segments" / "w1.state.json").read_text())
again = courier.writer_for(worker_env, "run-1", Path("elsewhere"), run_dir.parent / "other", "w2")
for r in rows(0, 3) + rows(8, 1):
    again.append(r)
flush(again, done=True)
gevent.sleep(1.0)
files = sorted(p.name for p in (run_dir / "segments").glob("*.arrow"))
other = json.loads((run_dir / "segments" / "w2.state.json").read_text())
finalise(run_dir)
late = courier.writer_for(worker_env, "run-1", Path("elsewhere"), run_dir.parent / "late", "w1")
late.append(rows(100, 1)[0])
flush(late)
gevent.sleep(1.0)
print(json.dumps({"other": other, "received": received, "spooled_after_acks": spooled_after_acks, "files": files,
                  "state": state, "state_before_done": state_before_done,
                  "ids": pq.read_table(run_dir / "requests.parquet").column("request_id").to_pylist(), "late_sealed": late.sealed,
                  "after_seal": sorted(p.name for p in run_dir.iterdir())}))
sys.stdout.flush()
master.quit()
worker.quit()
"""


def test_a_batch_sent_again_lands_once_done_waits_for_every_batch_and_a_sealed_run_refuses(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    child = subprocess.run([sys.executable, "-c", CHILD, str(run_dir)], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["spooled_after_acks"] == []  # both batches acknowledged, nothing left to resend
    assert out["received"][:4] == [0, 0, 0, 1]  # batch 0 arrived three times (unacknowledged at each pump)...
    assert out["files"] == ["w1-000000.arrow", "w1-000001.arrow", "w2-000000.arrow"]  # ... and was written once
    other = out["other"]["courier"]
    assert other["batches"] == 1 and other["duplicate_records"] == 3  # r0-r2 again: kept by request id once
    assert other["messages"] == 2 and other["bytes"] > 0  # the batch, then the state saying done
    assert out["state_before_done"]["done"] is False and out["state_before_done"]["records"] == 8
    assert out["state"]["done"] is True and out["state"]["records"] == 8
    courier = out["state"]["courier"]
    assert courier["batches"] == 2 and courier["duplicate_records"] == 10  # 2 resends of 5 records
    assert courier["messages"] >= 5  # batch 0 three times, batch 1, and the state saying done
    assert sorted(out["ids"]) == [f"r{i}" for i in range(9)]  # each record once in requests.parquet
    assert out["late_sealed"] is True  # written after the seal: refused, the worker is told
    assert "requests.parquet" in out["after_seal"] and "segments" not in out["after_seal"]


STEP_CHILD = r"""
import json, socket, sys, time

from locust.env import Environment
import gevent

from tokenload.load import roles
from tokenload.load.control import EarlyMessages, install_step_listener
from tokenload.load.messages import STEP_MESSAGE
from tokenload.load.state import LoadState
from tokenload.workload.scenario import load_scenario

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
master = Environment().create_master_runner("127.0.0.1", port)
worker_env = Environment()
worker = worker_env.create_worker_runner("127.0.0.1", port)
role = roles.attach(worker_env)
inbox = EarlyMessages(role)  # at the worker's start, as the plugin's init makes it
deadline = time.monotonic() + 20
while not master.clients and time.monotonic() < deadline:
    gevent.sleep(0.1)
# The master's first step, before the worker has joined the run (its run message not come yet).
master.send_message(STEP_MESSAGE, {"step": 1, "users": 6, "rate": None, "workers": 1, "started_at": time.time(),
                                   "plan_ends_at": time.time() + 20, "spawn_rate": None, "spread_s": 0.0,
                                   "budget": {worker.client_id: [40, None]}})
gevent.sleep(1.0)
state = LoadState.for_scenario(load_scenario("smoke"))
install_step_listener(role, state, inbox)  # the join
print(json.dumps({"step": state.step, "budget": None if state.budget is None else state.budget.max_requests}))
sys.stdout.flush()
master.quit()
worker.quit()
"""


def test_a_step_sent_before_the_worker_joined_reaches_it_with_its_share_of_the_limit() -> None:
    """The master may step before a worker has joined (it starts once every worker is ready, maybe before it
    read one's hello): that step carries the worker's share of `max_requests`, and dropped it let the worker send
    60 requests of a 40 limit."""
    child = subprocess.run([sys.executable, "-c", STEP_CHILD], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out == {"step": 1, "budget": 40}
