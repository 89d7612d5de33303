"""Locust event wiring: options, per-process setup, record flushing, run finalisation.

Importing this module (the locustfile does) registers the listeners once:

- `init_command_line_parser`: `--scenario`, `--run-dir`, `--run-id` (also from
  `TOKENLOAD_SCENARIO` / `TOKENLOAD_RUN_DIR` / `TOKENLOAD_RUN_ID`).
- `init`: load the scenario; the master (or local runner) gets the `RunControl`
  the shape uses. A worker asks the master for the run instead and does the
  rest when its first run message comes (`series.follow_master`, `_join`): the
  master's resolved scenario, its step messages, its run id; its records go
  into the master's run directory where this machine sees it, else to the
  master over Locust's channel (`courier`: a local spool, sent until
  acknowledged, also while the process quits).
- `init` (checked again at `test_start`), or a worker's join: every process
  that runs users builds its `ProcessContext` (channel, one shared transport,
  prompts, record writer, lag probe) and a greenlet that flushes records every
  second.
- `init`: every process feeds its live token statistics (`tokenstats`: the
  request event carries each record; workers' deltas merge on the master), and
  the master or local process tracks the runs (`series`: with the web UI each
  start is a run directory of its own) and adds the tokenload tab (`webui`).
- `test_stop`: the test's users are stopped: flush what is left and close the
  writer (its run is complete); `quit`: the same for a process that never stopped,
  then a master takes its workers' last batches while it waits for them.
- `init`, for processes `tokenload run` manages and forked workers: the
  lifeline (`lifeline.py`: die with the parent, a worker stops when its master
  is gone) and, on a master with workers, the user census (`census.py`).

When Locust runs headless without `tokenload run` (plain `locust -f`), the
master or local process also finalises the run directory at interpreter exit,
after Locust has reaped its local workers; with the web UI, `series` finalises
each run when it stops.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import os
import random
import signal
import uuid
from pathlib import Path
from typing import Any

import gevent
from locust import events
from locust.env import Environment

from tokenload.channel import Channel
from tokenload.load import census, courier, handoff, lifeline, records, roles, series, tokenstats
from tokenload.load.arrivals import Arrivals, TraceArrivals
from tokenload.load.control import CONTROL, EarlyMessages, RunControl, install_step_listener
from tokenload.load.drain import DRAIN_GRACE_S
from tokenload.load.handoff import bind, resolve_scenario_channel
from tokenload.load.lag import LagProbe, freeze_heap
from tokenload.load.messages import DRAIN_MESSAGE
from tokenload.load.rundirs import default_run_dir, finalise, new_run_id, write_run_info
from tokenload.load.state import LoadState
from tokenload.load.user import PROCESS, ProcessContext
from tokenload.load.warmup import Warmup
from tokenload.protocols import adapter_for
from tokenload.transport.gevent_client import Transport
from tokenload.workload.prompts import PromptSource
from tokenload.workload.scenario import Scenario, load_scenario
from tokenload.workload.traces import load_trace

FLUSH_INTERVAL_S = 1.0
MANAGED_ENV = "TOKENLOAD_MANAGED"  # set by `tokenload run`, which finalises the run itself
_ENVIRONMENT: Environment | None = None
LIFELINE: roles.Part[lifeline.Lifeline] = roles.Part("lifeline")
LAG: roles.Part[LagProbe] = roles.Part("lag probe")  # where users run
if os.environ.get(MANAGED_ENV):
    lifeline.take_sigint()


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    group = parser.add_argument_group("tokenload")
    group.add_argument("--scenario", default="smoke", env_var="TOKENLOAD_SCENARIO",
                       help="scenario .toml (or a packaged name: demo, smoke, ramp, ...)")
    group.add_argument("--run-dir", default="", env_var="TOKENLOAD_RUN_DIR",
                       help="run directory for records (default results/<scenario>-<timestamp>); a worker's, "
                            "unless it is the master's: its spool (default a temporary directory)")
    group.add_argument("--run-id", default="", env_var="TOKENLOAD_RUN_ID", help="run id stored in every record")


@events.init.add_listener
def _init(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None:  # a library user built an Environment by hand; nothing to wire
        return
    global _ENVIRONMENT
    _ENVIRONMENT = environment
    role = roles.attach(environment)
    if role.follows:
        courier.follow_acks(role)
        inbox = EarlyMessages(role)  # before the hello: the master may step before it answers
        series.follow_master(environment, lambda scenario, channel: _join(environment, scenario, channel, inbox))
        _arm_lifeline(environment)
        return
    scenario = load_scenario(opts.scenario)
    state = LoadState.for_scenario(scenario)
    tokenstats.install(environment, scenario.slo)
    if not opts.run_id:
        opts.run_id = new_run_id()
    if not opts.run_dir:
        opts.run_dir = str(default_run_dir(scenario.name))
    run_dir = Path(opts.run_dir)
    bound, channel, sources = _channel_and_sources(scenario, environment.host)
    control = role.put(CONTROL, RunControl(environment, scenario, run_dir, state, channel, sources))
    if role.has_workers:
        census.start_census(role, control)
    if not os.environ.get(MANAGED_ENV):
        write_run_info(run_dir, opts.run_id, bound, channel.public())
        if environment.web_ui is None:  # with the web UI every start is a run of its own, finalised at its stop
            atexit.register(_finalise_standalone, run_dir)
    if role.runs_users:
        _setup_process(environment, scenario, state)
    else:
        warm_inspect()
    series.lead(environment)
    _arm_lifeline(environment)


def _join(environment: Environment, scenario: Scenario, channel: dict[str, Any], inbox: EarlyMessages) -> None:
    """A worker joins its master's run: the master's resolved scenario; under plain Locust, its channel's URL.

    Runs in the handler of the master's first run message, so it is done before any spawn message is handled.
    Under `tokenload run --worker` the channel was resolved on this machine (its flags, environment and key).
    """
    state = LoadState.for_scenario(scenario)
    role = roles.of(environment)
    tokenstats.install(environment, scenario.slo)
    install_step_listener(role, state, inbox)
    census.follow_census(role, state)
    if handoff.channel_from_env() is None and channel.get("base_url"):
        environment.host = channel["base_url"]
    _setup_process(environment, scenario, state)


def warm_inspect() -> None:
    """Pay now, before any user runs, what Locust's stop pays in the event loop at the run's last moment.

    `Runner.stop` logs its caller with `inspect.stack()`, and the first call in a process maps the file of
    every module loaded (a `realpath` each) while the streams sent last wait to be read: their first tokens
    were read late (docs/benchmarks.md, "Start-up burst"). Later calls map only the modules loaded since. Locust guards its own call (a frame without a source file
    can make it fail), and so does this one: it only moves a cost.
    """
    with contextlib.suppress(Exception):
        inspect.stack()


def _channel(scenario: Scenario, host: str | None) -> tuple[Scenario, Channel]:
    """The channel (handed over by `tokenload run`, else resolved like every tokenload command) and the
    scenario bound to it."""
    scenario, channel, _ = _channel_and_sources(scenario, host)
    return scenario, channel


def _channel_and_sources(scenario: Scenario, host: str | None) -> tuple[Scenario, Channel, dict[str, str] | None]:
    """`_channel` plus where each field came from under plain Locust (None under `tokenload run`, whose own
    options set them), so a fix names what the user can change: `--host`, a variable, a settings key."""
    channel = handoff.channel_from_env()
    sources = None
    if channel is None:
        scenario, resolution = resolve_scenario_channel(scenario, "scenario [channel]", {"base_url": host})
        channel = resolution.channel
        sources = {name: "flag --host" if source == "flag --base-url" else source  # Locust's name for it
                   for name, source in resolution.sources.items()}
    scenario, channel = bind(scenario, channel)
    return scenario, channel, sources


def _arm_lifeline(environment: Environment) -> None:
    """Processes `tokenload run` manages, and forked workers, stop when their parent or master is gone, at
    once (open streams cut); a managed web UI quits at its interrupt."""
    role = roles.of(environment)
    if role.follows:
        environment.events.test_stopping.add_listener(lambda **_: role.watch_heartbeats(False))
        environment.events.test_stop.add_listener(lambda **_: role.watch_heartbeats(True))
    forked = role.follows and bool(getattr(environment.parsed_options, "processes", None))
    parent = lifeline.parent_to_watch(forked) if forked or os.environ.get(MANAGED_ENV) else None
    if environment.web_ui is not None and os.environ.get(MANAGED_ENV):
        lifeline.on_interrupt(lambda: _quit_web_ui(environment))
    if parent is None and not role.follows:
        return

    def cut_open_streams() -> None:  # before Locust's stop begins: it reads the drain when it starts
        environment.stop_timeout = 0

    line = role.put(LIFELINE, lifeline.Lifeline(parent, role.last_heartbeat if role.follows else None,
                                                on_lost=cut_open_streams))
    if role.has_workers:
        environment.events.test_stopping.add_listener(lambda **_: _workers_cut_if_lost(role, line))
    line.arm()


def _workers_cut_if_lost(master: roles.Role, line: lifeline.Lifeline) -> None:
    """A master whose parent is gone stops: its workers cut their streams too (no drain), told ahead of the
    stop or quit on the same socket. Otherwise they drain with the value the master sent earlier while the
    master waits for them, and a killed `tokenload run --processes 2` loaded the channel 4 s longer."""
    if line.reason is not None:
        master.to_workers(DRAIN_MESSAGE, {"drain_s": 0.0})


def _quit_web_ui(environment: Environment) -> None:
    """`tokenload run --web` quits at its interrupt: Locust alone keeps its UI up after one during the plan.

    The person (or the dead parent) is leaving: the run is finalised, not analysed.
    """
    runs = roles.of(environment).get(series.SERIES)
    if runs is not None:
        runs.on_quitting()
    if environment.web_ui is not None:
        gevent.spawn(environment.web_ui.stop)


def _wait_for_workers(environment: Environment) -> None:
    """A master that quits stays until its workers have drained and flushed (or the drain and a grace
    are over): forked workers stop at once when their master is gone, remote ones miss its heartbeats."""
    role = roles.of(environment)
    control = role.get(CONTROL)
    if control is None or not role.has_workers:
        return
    draining = sorted(w.id for w in role.workers() if not w.missing)  # a lost one flushes no more
    if draining:
        with courier.collecting(environment):
            records.wait_for_workers(control.path.parent.parent, draining, environment.stop_timeout + DRAIN_GRACE_S)


def _setup_process(environment: Environment, scenario: Scenario, state: LoadState) -> None:
    """Build this process's users' shared context, once, before the shape's clock starts.

    Done at `init`, not `test_start`: building adapters, the transport and the
    segment writer takes a few hundred ms, which at `test_start` would delay the
    first users behind the load plan's clock. A test restarted in the web UI
    keeps this context and its writer.
    """
    opts = environment.parsed_options
    assert opts is not None
    role = roles.of(environment)
    worker = records.safe_worker_id(role.worker_id)
    scenario, channel = _channel(scenario, environment.host)
    models = scenario.channel.models
    salt = random.SystemRandom().getrandbits(31)
    load = scenario.load
    arrivals: Arrivals | TraceArrivals | None = None
    probe_warmup = load.search.probe_warmup_s if load.search is not None else 0.0
    if load.kind == "poisson" or (load.open_loop and load.search is not None):
        # Seeded by the worker id: a single-process run repeats its schedule exactly, workers differ.
        arrivals = Arrivals(state, random.Random(f"{scenario.seed}:arrivals:{worker}"), load.arrival, load.burstiness,
                            load.ramp, load.step_s)
    elif load.kind == "trace":
        assert load.trace is not None
        arrivals = TraceArrivals(state, load_trace(load.trace, load.time_unit), load.speed)
    ctx = ProcessContext(
        run_id=opts.run_id,
        worker=worker,
        tag=uuid.uuid4().hex[:8],
        protocol=channel.protocol,
        adapters={m: adapter_for(channel.with_model(m)) for m in models},
        # A late request counts the streams only where they are all this process's (a worker sees its share).
        transport=Transport(channel, count_streams=load.search is not None and not role.follows),
        prompts=PromptSource(scenario, models, salt),
        # A worker's writer comes with the master's run message (`series.follow_master`).
        writer=records.SegmentWriter(None if role.follows else Path(opts.run_dir), worker),
        state=state,
        arrivals=arrivals,
        extra_body=scenario.output.extra_body(),
        think_time_s=load.think_time_s,
        retry=load.retry,
        warmup=Warmup(load.warmup_requests, load.warmup_s, state, probe_warmup, drain=load.search is not None,
                      spawn_rate=load.spawn_rate)
        if load.warmup_requests or load.warmup_s or load.search is not None else None,
        late_s=scenario.slo.ttft_s if load.search is not None else None,
        on_time=load.search is not None and scenario.slo.first_token_decides,
    )
    role.put(PROCESS, ctx)
    warm_inspect()
    role.put(LAG, LagProbe()).start()
    gevent.spawn(_flush_forever, environment)
    freeze_heap()
    environment.events.spawning_complete.add_listener(freeze_heap)


def _flush(environment: Environment, done: bool = False) -> None:
    role = roles.find(environment)
    if role is None:  # a library user's Environment: nothing of tokenload's to flush
        return
    ctx = role.get(PROCESS)
    if ctx is not None:
        line = role.get(LIFELINE)
        state = {"lag": role.need(LAG).stats(), "pid": os.getpid(), "lost": None if line is None else line.reason}
        ctx.writer.flush(state, done=done)
    courier.pump(role)


def _flush_forever(environment: Environment) -> None:
    """Flush every second; once the run was finalised under this process (sealed), stop it."""
    ctx = roles.of(environment).need(PROCESS)
    while not ctx.writer.sealed:
        gevent.sleep(FLUSH_INTERVAL_S)
        _flush(environment)
    logging.getLogger(__name__).error("tokenload: the run was finalised without this process's last records; "
                                      "they are dropped and the process stops")
    os.kill(os.getpid(), signal.SIGINT)


@events.test_stop.add_listener
def _test_stop(environment: Environment, **_: Any) -> None:
    """A test's users are all stopped: its records are complete (a next start is a new run)."""
    _flush(environment, done=True)


@events.quitting.add_listener
def _quitting(environment: Environment, **_: Any) -> None:
    role = roles.find(environment)
    if role is None:  # a library user's Environment: nothing of tokenload's to stop
        return
    line, ctx = role.get(LIFELINE), role.get(PROCESS)
    if (line is not None and line.check()) or (ctx is not None and ctx.writer.sealed):
        environment.stop_timeout = 0  # nobody waits for a drain: stop now, open streams are kept as records
    if line is not None:
        line.quiet()
    control = role.get(CONTROL)
    if control is not None:
        control.finish("interrupted")


@events.quit.add_listener
def _quit(exit_code: int, **_: Any) -> None:
    """The last event of a Locust process (it carries no environment, hence `_ENVIRONMENT`)."""
    if _ENVIRONMENT is not None:
        _flush(_ENVIRONMENT, done=True)
        # Also when the master seemed gone: a network cut heals, and the master takes batches until it finalises.
        unsent = courier.settle(_ENVIRONMENT)
        if unsent:
            logging.getLogger(__name__).error("tokenload: the master did not acknowledge %d record batches; "
                                              "they stay in %s", len(unsent), Path(unsent[0]).parent)
        _wait_for_workers(_ENVIRONMENT)
        control = roles.of(_ENVIRONMENT).get(CONTROL)
        if control is not None:
            control.write_live()


def _finalise_standalone(run_dir: Path) -> None:
    finalise(run_dir)
    print(f"tokenload: records in {run_dir}")
