"""Ways to run the simulator: a background thread, a subprocess, or the foreground CLI.

The thread form suits plain tests; Locust-based tests must use the subprocess
form because Locust monkey-patches the process with gevent. The foreground form
backs `tokenload sim`, including `--workers N` processes sharing one port
through SO_REUSEPORT.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenload.compat import python_module
from tokenload.errors import HarnessError
from tokenload.sim.profile import Profile, load_profile, with_overrides
from tokenload.sim.server import SimServer


@dataclass
class SimHandle:
    """A simulator running in a background thread of this process."""

    base_url: str
    server: SimServer
    truth_path: Path | None


def _resolve(profile: Profile | str | Path | None, overrides: dict[str, Any]) -> Profile:
    base = profile if isinstance(profile, Profile) else load_profile(profile)
    return with_overrides(base, **overrides) if overrides else base


@contextlib.contextmanager
def serve_in_thread(profile: Profile | str | Path | None = None, *, api_key: str | None = None,
                    models: list[str] | None = None, truth_path: str | Path | None = None, prefix: str = "/api",
                    host: str = "127.0.0.1", port: int = 0, **overrides: Any) -> Iterator[SimHandle]:
    """Run a SimServer on its own event loop in a daemon thread; stop it on exit.

    `profile` is a Profile, a built-in name or a TOML path; `overrides` replace
    profile knobs (validated like a profile file).
    """
    server = SimServer(_resolve(profile, overrides), host=host, port=port, api_key=api_key, models=models,
                       truth_path=truth_path, prefix=prefix)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    failure: list[BaseException] = []

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.start())
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)
            ready.set()
            loop.close()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(server.close())
        loop.close()

    thread = threading.Thread(target=main, name="tokenload-sim", daemon=True)
    thread.start()
    ready.wait()
    if failure:
        raise failure[0]
    try:
        yield SimHandle(server.base_url, server, server.truth_path)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


class SimProcess:
    """`python -m tokenload sim --port 0 ARGS` as a context manager with `.base_url`."""

    def __init__(self, args: Sequence[str] = (), *, timeout: float = 20) -> None:
        self.args = list(args)
        self.timeout = timeout
        self.base_url = ""
        self.truth_path = Path(self.args[self.args.index("--truth") + 1]) if "--truth" in self.args else None
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> SimProcess:
        self.process = subprocess.Popen(
            [*python_module("tokenload"), "sim", "--port", "0", *self.args],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )
        assert self.process.stdout is not None
        deadline = time.monotonic() + self.timeout
        while not self.base_url:
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([self.process.stdout], [], [], max(remaining, 0))
            if readable:
                line = self.process.stdout.readline()
                if not line:
                    break
                self.base_url = line.strip()
            elif remaining <= 0:
                break
        if not self.base_url:
            try:
                rc: int | None = self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                rc = None
            self.__exit__(None, None, None)
            if rc is None:
                raise HarnessError(f"tokenload sim did not print its URL within {self.timeout} s")
            raise HarnessError(f"tokenload sim exited with code {rc} before serving (its error is printed above)")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def launch(args: Sequence[str] = (), *, timeout: float = 20) -> SimProcess:
    """Context manager: a simulator subprocess (for gevent/Locust processes); see SimProcess."""
    return SimProcess(args, timeout=timeout)


def _listener(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when
    # their proto says TCP, and without it Nagle holds the first token behind the
    # headers until the client's delayed ACK (about 40 ms the truth file never sees).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


async def _serve_until_signal(server: SimServer, announce: bool) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = await server.start()
    if announce:
        print(url, flush=True)
    await stop.wait()
    await server.close()


def serve_foreground(profile: Profile, *, host: str, port: int, api_key: str | None, models: list[str] | None,
                     truth_path: Path | None, prefix: str, workers: int) -> int:
    """Serve until SIGINT/SIGTERM; with workers > 1 fork that many processes on one SO_REUSEPORT port.

    Each worker runs the whole behaviour model on its own (its own slots, queue,
    rate limits and /metrics), so `--workers` multiplies capacity; it exists for
    throughput benchmarks, not for modelling a channel.
    """
    if truth_path is not None:
        truth_path.write_text("")
    sock = _listener(host, port, reuse_port=workers > 1)
    port = sock.getsockname()[1]
    children: list[int] = []
    for _ in range(workers - 1):
        pid = os.fork()
        if pid == 0:
            sock.close()
            child_sock = _listener(host, port, reuse_port=True)
            server = SimServer(profile, api_key=api_key, models=models, truth_path=truth_path, prefix=prefix,
                               sock=child_sock)
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(_serve_until_signal(server, announce=False))
            os._exit(0)
        children.append(pid)
    server = SimServer(profile, api_key=api_key, models=models, truth_path=truth_path, prefix=prefix, sock=sock)
    try:
        asyncio.run(_serve_until_signal(server, announce=True))
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in children:
            os.waitpid(pid, 0)
    return 0
