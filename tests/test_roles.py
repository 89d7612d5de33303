"""One role per load process (`tokenload/load/roles.py`), every message in one module (`messages.py`).

The contract: only the role module looks at Locust's runner classes; the load package keeps its per-process
parts in the role (typed), not in attributes of its own on Locust's `Environment`; every message name is
declared once, in `messages.py`. And the roles themselves, on a real Locust master and worker talking over
loopback (in a child process: gevent's monkey-patching stays out of pytest's).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOAD = ROOT / "tokenload" / "load"
SOURCES = sorted([*(ROOT / "tokenload").rglob("*.py"), *(ROOT / "locustfiles").rglob("*.py")])


def test_only_the_role_module_looks_at_the_runner_class() -> None:
    checks = re.compile(r"isinstance\([^)]*Runner\)")
    found = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in SOURCES if path.name != "roles.py"
             for line in path.read_text(encoding="utf-8").splitlines() if checks.search(line)]
    assert not found, "role checks outside tokenload/load/roles.py:\n" + "\n".join(found)


def test_the_load_package_sets_no_attribute_of_its_own_on_locusts_objects() -> None:
    found = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in sorted(LOAD.glob("*.py"))
             for line in path.read_text(encoding="utf-8").splitlines() if "type: ignore[attr-defined]" in line]
    assert not found, "\n".join(found)


def test_every_part_of_a_process_is_reached_through_its_role() -> None:
    """No `environment.tokenload_*` and no `getattr(environment, "tokenload...")`: one attribute, set by `attach`."""
    untyped = re.compile(r"[\w)]\.tokenload\w*|(getattr|hasattr|setattr)\([^,]+, \"tokenload")
    found = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in [*SOURCES, *sorted((ROOT / "benchmarks").glob("*.py"))]
             for line in path.read_text(encoding="utf-8").splitlines() if untyped.search(line)]
    assert not found, "\n".join(found)


def test_every_message_is_declared_once_in_the_messages_module() -> None:
    """A name ending in _MESSAGE is assigned in messages.py only, and no two messages share a wire name."""
    declared: dict[str, str] = {}
    elsewhere: list[str] = []
    for path in sorted(LOAD.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.endswith("_MESSAGE"):
                        if path.name == "messages.py":
                            declared[target.id] = node.value.value
                        else:
                            elsewhere.append(f"{path.name}: {target.id}")
    assert not elsewhere, f"message names declared outside messages.py: {elsewhere}"
    assert len(declared) == 11 and len(set(declared.values())) == len(declared), declared


CHILD = r"""
import json, socket, sys, time

import gevent
from locust.env import Environment

from tokenload.load import roles

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
master_env, worker_env, local_env = Environment(), Environment(), Environment()
master_env.create_master_runner("127.0.0.1", port)
worker_env.create_worker_runner("127.0.0.1", port)
local_env.create_local_runner()
master, worker, local = roles.attach(master_env), roles.attach(worker_env), roles.attach(local_env)
deadline = time.monotonic() + 20
while not master.workers() and time.monotonic() < deadline:
    gevent.sleep(0.1)
got = {}
master.listen("test_up", lambda environment, msg, **_: got.update(up=msg.data))
worker.listen("test_down", lambda environment, msg, **_: got.update(down=msg.data))
worker.to_master("test_up", {"from": worker.worker_id})
master.to_workers("test_down", {"n": 1})
local.to_workers("test_down", {"n": 2})  # nobody to tell: nothing happens
while len(got) < 2 and time.monotonic() < deadline:
    gevent.sleep(0.1)
try:
    local.to_master("test_up")
    refused = False
except RuntimeError:
    refused = True
KEY = roles.Part("a list")
local.put(KEY, [1])
try:
    master.need(KEY)
    missing = None
except LookupError as exc:
    missing = str(exc)
print(json.dumps({
    "kinds": [[r.name, r.leads, r.runs_users, r.has_workers, r.follows] for r in (local, master, worker)],
    "found": [roles.of(env) is r for env, r in ((local_env, local), (master_env, master), (worker_env, worker))],
    "workers": [w.id for w in master.workers()], "worker_id": worker.worker_id, "local_id": local.worker_id,
    "got": got, "refused": refused, "part": local.need(KEY), "missing": missing,
    "unwired": roles.find(Environment()) is None,
}))
sys.stdout.flush()
master_env.runner.quit()
worker_env.runner.quit()
"""


def test_each_kind_of_process_gets_its_role_and_messages_go_up_and_down() -> None:
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["kinds"] == [["local", True, True, False, False], ["master", True, False, True, False],
                            ["worker", False, True, False, True]]
    assert out["found"] == [True, True, True] and out["unwired"] is True
    assert out["workers"] == [out["worker_id"]] and out["local_id"] == "local"
    assert out["got"] == {"up": {"from": out["worker_id"]}, "down": {"n": 1}}  # the local process's went nowhere
    assert out["refused"] is True  # a local process has no master
    assert out["part"] == [1] and "master process has no a list" in out["missing"]
