"""How many users really run: a lost worker's users are gone until the next step.

When a Locust worker is lost (killed, crashed, its network cut) the master
marks it missing after about 3 s without heartbeats and, unless
`--enable-rebalancing` is given, does not replace its users: a 40-user step
goes on with 20. Records that still said `active_users = 40` made the analysis
attribute the latency of 20 users to 40.

So the master keeps a census once a second: the users each healthy worker
reported, and the users of every worker that went missing during the current
step. It tells the workers the step's real count (`LIVE_MESSAGE`), and every
record sent after that carries `active_users` = the step's planned users minus
those lost. At the next step the master dispatches the planned users among the
workers still there, so the count is whole again. The count is as good as
Locust's knowledge: a loss is seen about 3-4 s after it happened, and the
records sent in between still carry the planned count.
"""

from __future__ import annotations

from typing import Any

import gevent
from locust.env import Environment

from tokenload.load.control import RunControl
from tokenload.load.messages import LIVE_MESSAGE, LiveUsers
from tokenload.load.roles import Role
from tokenload.load.state import LoadState

POLL_S = 1.0


class Census:
    """Master side: users of healthy workers, users lost in the current step."""

    def __init__(self, role: Role, control: RunControl) -> None:
        self.role = role
        self.control = control
        self.seen: dict[str, int] = {}
        self.lost: dict[str, int] = {}
        self.step = 0
        self.sent: tuple[int, int] | None = None

    def poll(self) -> tuple[int, int] | None:
        """(step, live users) when that changed since the last poll, else None."""
        if not self.control.steps:
            return None
        step, planned = self.control.steps[-1]["step"], self.control.steps[-1]["users"]
        if step != self.step:
            self.step, self.lost = step, {}
        for worker in self.role.workers():
            if worker.missing:
                if worker.id not in self.lost and worker.id in self.seen:
                    self.lost[worker.id] = self.seen.pop(worker.id)
            else:
                self.seen[worker.id] = worker.users
        current = (step, max(0, planned - sum(self.lost.values())))
        if current == self.sent:
            return None
        self.sent = current
        return current

    def run(self) -> None:
        while True:
            gevent.sleep(POLL_S)
            change = self.poll()
            if change is not None:
                live: LiveUsers = {"step": change[0], "users": change[1]}
                self.role.to_workers(LIVE_MESSAGE, live)


def start_census(role: Role, control: RunControl) -> None:
    """On the master: keep the census and tell the workers when a step's real user count changes."""
    gevent.spawn(Census(role, control).run)


def follow_census(role: Role, state: LoadState) -> None:
    """On a worker: label records with the step's real user count once the master knows it."""

    def on_live(environment: Environment, msg: Any, **_: Any) -> None:
        data: LiveUsers = msg.data
        if data["step"] == state.step:
            state.users = data["users"]

    role.listen(LIVE_MESSAGE, on_live)
