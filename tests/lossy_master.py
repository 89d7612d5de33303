"""A locustfile for tests: tokenload's own, on a master that loses acknowledgements of batches.

By default it drops every acknowledgement (of a batch or of the worker's
state) from its first batch's until that batch comes again: the worker never
hears that its first batch arrived, so it sends that batch again and the master
gets it twice, for real, over Locust's channel. With `LOSSY_MASTER_MUTE_S=S` in
its environment it drops every acknowledgement for S seconds from the first
batch it receives instead: to the worker, a master it cannot reach. With
`LOSSY_MASTER_STATE_ONLY=1` it drops every acknowledgement of a batch and
passes only those of the worker's state. Either way it writes `acks.json` into
its working directory: for each batch number, the seconds (since its first
batch) at which a copy of it came in.
"""

import json
import os
import time
from pathlib import Path
from typing import Any

from locust import events
from locust.env import Environment

from tokenload.load.messages import ACK_MESSAGE
from tokenload.locustfiles.llm import LLMUser, ScenarioShape

__all__ = ["LLMUser", "ScenarioShape"]

MUTE_S = float(os.environ.get("LOSSY_MASTER_MUTE_S", "0"))
STATE_ONLY = os.environ.get("LOSSY_MASTER_STATE_ONLY") == "1"


@events.init.add_listener
def _lose_acks(environment: Environment, **_: Any) -> None:
    runner = environment.runner
    assert runner is not None
    send = runner.send_message
    first: list[int] = []  # the first batch's number
    arrivals: dict[int, list[float]] = {}  # batch number -> seconds since the first batch, one per copy received
    started: list[float] = []

    def lossy(msg_type: str, data: Any = None, client_id: str | None = None) -> None:
        if msg_type == ACK_MESSAGE:
            now, seq = time.monotonic(), data.get("seq")
            if seq is not None:  # the master answers each copy of a batch it receives
                started[:], first[:] = started or [now], first or [seq]
                arrivals.setdefault(seq, []).append(now - started[0])
                Path("acks.json").write_text(json.dumps(arrivals))
            muted = bool(started) and now - started[0] < MUTE_S
            lost = not (MUTE_S or STATE_ONLY) and bool(first) and len(arrivals[first[0]]) < 2
            if muted or lost or (STATE_ONLY and seq is not None):
                return
        send(msg_type, data, client_id)

    runner.send_message = lossy  # type: ignore[method-assign]
