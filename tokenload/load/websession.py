"""`tokenload run --web`, the supervising side: Locust's command line, the UI's address, the session's runs.

Kept free of Locust imports (importing Locust patches the interpreter with
gevent; this runs in the `tokenload` process that supervises Locust).

With the web UI every start is a run of its own (`tokenload.load.series`),
finalised by the Locust master at its stop. The first run is the directory
`tokenload run` was given; later ones are its siblings `DIR-2`, `DIR-3`, ...
After Locust exits, `session_runs` lists the runs of this session and
finalises any that Locust could not (a second Ctrl-C kills it).
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tokenload.errors import ConfigError
from tokenload.load import records
from tokenload.load.rundirs import RUN_INFO, finalise, read_json
from tokenload.rundir import MANIFEST_FILE

DEFAULT_PORT = 8089  # Locust's
PORT_ENV = "LOCUST_WEB_PORT"


def web_port(port: int | None) -> int:
    """The port Locust's UI will use: the option, else Locust's own environment variable, else its default."""
    return port if port is not None else int(os.environ.get(PORT_ENV) or DEFAULT_PORT)


def locust_args(host: str, port: int | None) -> list[str]:
    """Locust's options for a web UI that starts the scenario at once and stays up after the plan (until Ctrl-C)."""
    return ["--web-host", host, "--web-port", str(web_port(port)), "--autostart"]


def check_port(host: str, port: int | None) -> None:
    """A `ConfigError` unless Locust's UI can listen on `host`:`port` now, checked before anything starts.

    Locust finds a busy port only after the run has begun, and an orphaned UI
    from an earlier run answers on it: its page was announced as this run's
    while this run went on without a UI. The check binds like Locust's server
    (SO_REUSEADDR: a port in TIME_WAIT is free, one with a listener is not).
    """
    number = web_port(port)
    bind_host = "" if host == "*" else host
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((bind_host, number))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"--web: port {number} on {host} is already in use (another web UI, perhaps an "
                                  "earlier run's?); stop that process or choose a free port with --web-port N") from None
            raise ConfigError(f"--web: cannot listen on {host} port {number} ({exc.strerror}); choose another "
                              "--web-host or --web-port") from None


def url(host: str, port: int | None) -> str:
    shown = "127.0.0.1" if host in ("", "*", "0.0.0.0") else host
    return f"http://{shown}:{web_port(port)}/"


def announce_when_up(address: str, say: Callable[[str], None], timeout_s: float = 60.0) -> threading.Event:
    """Call `say(address)` once the UI answers (polled from a thread); set the returned event to give up."""
    stop = threading.Event()

    def poll() -> None:
        deadline = time.monotonic() + timeout_s
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(address, timeout=2):
                    say(address)
                    return
            except OSError:
                stop.wait(0.2)

    threading.Thread(target=poll, name="tokenload-web-url", daemon=True).start()
    return stop


def _siblings(first: Path) -> list[tuple[int, Path]]:
    """The directories named like the session's runs (`first`, `first-2`, ...), with their start number."""
    pattern = re.compile(re.escape(first.name) + r"(?:-(\d+))?")
    found = []
    for path in first.parent.glob(f"{first.name}*"):
        match = pattern.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1) or 1), path))
    return found


def current_run(first: Path, since: float) -> Path | None:
    """The run of this session that is being recorded now (its segments are open), or None between runs.

    The server-metrics sampler of the supervising process asks this once a
    round, so each start's samples land in that start's run directory.
    """
    open_runs = []
    for number, path in _siblings(first):
        started = read_json(path / records.SEGMENTS_DIR / RUN_INFO).get("started_at") or 0.0
        if started >= since:  # open (not sealed) and begun by this session
            open_runs.append((number, path))
    return max(open_runs)[1] if open_runs else None


def session_runs(first: Path, since: float) -> list[Path]:
    """This session's run directories in start order; runs Locust left unfinalised are finalised here."""
    found: list[tuple[int, Path]] = []
    for number, path in _siblings(first):
        if (path / records.SEGMENTS_DIR).is_dir() and not (path / MANIFEST_FILE).exists():
            finalise(path)
        try:
            started = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8")).get("started_at") or 0.0
        except (OSError, ValueError):
            continue
        if started >= since:
            found.append((number, path))
    return [path for _, path in sorted(found)]
