"""The three kinds of load process (local, master, worker): what each does, chosen once per process.

Locust runs a test in one process (`LocalRunner`) or as a master that plays the
plan and runs no users, and workers that run the users (`MasterRunner`,
`WorkerRunner`). The plugin picks this process's `Role` from its runner at
`init` (`attach`), the only place that looks at the runner's class; every other
module asks the role (`of`): whether this process leads the run (plan, stop
rules, run directory) or follows a master, runs users, and how a message goes
to the master or the workers (`messages.py` lists them).

The role also keeps this process's parts (its run control, user context, token
statistics, ...) under typed keys (`Part`, as pytest's `StashKey`): one
attribute on Locust's `Environment`, typed, where the parts once were an
attribute each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NamedTuple, TypeVar

if TYPE_CHECKING:  # importing Locust patches the interpreter with gevent: only where Locust runs
    from locust.env import Environment
    from locust.rpc import Message
    from locust.runners import MasterRunner, Runner, WorkerRunner

T = TypeVar("T")
ATTRIBUTE = "tokenload_role"  # the one attribute tokenload sets on Locust's Environment


class Part(Generic[T]):
    """The key of one kind of per-process object a role keeps; `T` is its type."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Part({self.name!r})"


class Worker(NamedTuple):
    """A master's view of one worker: its id, whether Locust marked it missing, its running users."""

    id: str
    missing: bool
    users: int


class Role:
    """A process that runs the whole test alone (Locust's `LocalRunner`): it leads the run and runs the users."""

    name: ClassVar[str] = "local"
    leads: ClassVar[bool] = True  # plays the plan: shape, stop rules, run directory, control.json
    runs_users: ClassVar[bool] = True
    has_workers: ClassVar[bool] = False
    follows: ClassVar[bool] = False  # takes its run, steps and limits from a master

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._parts: dict[Part[Any], Any] = {}

    def put(self, part: Part[T], value: T) -> T:
        self._parts[part] = value
        return value

    def get(self, part: Part[T]) -> T | None:
        value: T | None = self._parts.get(part)
        return value

    def need(self, part: Part[T]) -> T:
        """The part, which this process must have by now."""
        value = self.get(part)
        if value is None:
            raise LookupError(f"this {self.name} process has no {part.name} yet")
        return value

    def drop(self, part: Part[Any]) -> None:
        self._parts.pop(part, None)

    @property
    def worker_id(self) -> str:
        """The name of this process's records and files."""
        return "local"

    @property
    def user_count(self) -> int:
        """Users running now: this process's, or on a master every worker's."""
        return self.runner.user_count

    def workers(self) -> list[Worker]:
        """A master's workers, missing ones included (none elsewhere)."""
        return []

    @property
    def worker_count(self) -> int:
        """A master's workers taking part (Locust's count: neither missing nor stopped)."""
        return 0

    def listen(self, name: str, handler: Callable[..., None], *, replace: bool = False) -> None:
        """`handler(environment, msg)` takes the messages `name` (`replace`: instead of the one before, as a new
        run's control does; else a second listener is an error, as in Locust)."""
        if replace:
            self.runner.custom_messages.pop(name, None)
        self.runner.register_message(name, handler)

    def to_workers(self, name: str, data: Any = None, client_id: str | None = None) -> None:
        """Send to every worker (or to `client_id`); a process without workers has nobody to tell."""

    def to_master(self, name: str, data: Any = None) -> None:
        raise RuntimeError(f"a {self.name} process has no master to send {name} to")

    def next_message(self) -> Message:
        """The next message off Locust's socket, read by hand once Locust's own receiver has stopped."""
        raise RuntimeError(f"a {self.name} process has no socket to read")

    def watch_heartbeats(self, on: bool) -> None:
        """A worker pauses the watches on its master's heartbeats while it drains (see `WorkerRole`)."""

    def last_heartbeat(self) -> float | None:
        """When the master's last heartbeat came (None: no master, or its watch is paused)."""
        return None


class MasterRole(Role):
    """Plays the plan and runs no users; tells its workers each step and gathers their records and statistics."""

    name = "master"
    runs_users = False
    has_workers = True
    runner: MasterRunner

    def workers(self) -> list[Worker]:
        from locust.runners import STATE_MISSING

        return [Worker(c.id, c.state == STATE_MISSING, sum(c.user_classes_count.values()))
                for c in self.runner.clients.all]

    @property
    def worker_count(self) -> int:
        return self.runner.worker_count

    def to_workers(self, name: str, data: Any = None, client_id: str | None = None) -> None:
        self.runner.send_message(name, data, client_id)

    def next_message(self) -> Message:
        return self.runner.server.recv_from_client()[1]


class WorkerRole(Role):
    """Runs its share of the users; takes its run, steps and limits from the master and sends it its records."""

    name = "worker"
    leads = False
    follows = True
    runner: WorkerRunner

    @property
    def worker_id(self) -> str:
        return self.runner.client_id

    def to_master(self, name: str, data: Any = None) -> None:
        self.runner.send_message(name, data)

    def next_message(self) -> Message:
        return self.runner.client.recv()

    def watch_heartbeats(self, on: bool) -> None:
        """Pause the master-heartbeat watches while this worker drains its users, resume them after.

        A worker drains on its master's stop or quit; meanwhile Locust's message loop sits in that stop and
        reads no heartbeat, and a master that quit sends none, so the watches (the lifeline's 5 s, Locust's
        own 60 s: both read `last_heartbeat_timestamp`, and skip an unset one) would cut the drain short.
        `stop_timeout` bounds the drain; a forked worker's parent watch stays on throughout.
        """
        if not on:
            self.runner.last_heartbeat_timestamp = None
        elif self.runner.last_heartbeat_timestamp is None:
            self.runner.last_heartbeat_timestamp = time.time()

    def last_heartbeat(self) -> float | None:
        return self.runner.last_heartbeat_timestamp


def attach(environment: Environment) -> Role:
    """Pick this process's role from its runner and keep it on the environment."""
    from locust.runners import LocalRunner, MasterRunner, WorkerRunner

    runner = environment.runner
    role: Role
    if isinstance(runner, MasterRunner):
        role = MasterRole(runner)
    elif isinstance(runner, WorkerRunner):
        role = WorkerRole(runner)
    elif isinstance(runner, LocalRunner):
        role = Role(runner)
    else:
        raise RuntimeError(f"tokenload needs a Locust runner, not {runner!r}")
    setattr(environment, ATTRIBUTE, role)
    return role


def find(environment: Environment) -> Role | None:
    """This process's role, or None where the plugin did not wire the environment (built by hand)."""
    role = getattr(environment, ATTRIBUTE, None)
    return role if isinstance(role, Role) else None


def of(environment: Environment) -> Role:
    """This process's role (`attach` ran at `init`)."""
    role = find(environment)
    if role is None:
        raise LookupError("no tokenload role on this Locust environment: the plugin's init has not run")
    return role

