"""Live Prometheus metrics of tokenload's own records (`--prometheus-port` on `tokenload run` and `watch`).

The numbers come from the request records as they are made (the same rows
requests.parquet and the history database get), so what a dashboard shows and
what the run directory holds at the end agree: `tokenload_ttft_seconds_count`
is the number of records with a TTFT, `tokenload_requests_total` by `status`
the records by status. Each metric lives in a registry of its own (never
prometheus_client's global one, so nothing else a library user registers leaks
in) and is served (prometheus_client's page, the standard library's threading
WSGI server) from a thread of the
process that owns the records: the supervising `tokenload run` (never a Locust
process, so the load path does not pay for it) or `tokenload watch`.

Labels stay few and bounded: `run_id` (one per `tokenload run`, `watch` for
the watch's samples) and `step` (the plan's steps) on the latencies and
counters, `status` and `error_kind` (the contract's kinds) on the requests.
`tokenload_itl_seconds` observes each request's median inter-token latency
(the record's `itl_p50_s`): the record keeps no per-token gaps.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from tokenload.errors import ConfigError

# Bucket bounds in seconds, from a fast local server to a slow relay under load.
TTFT_BUCKETS: Final = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0)
TOKEN_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                        2.0)
E2E_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
                      180.0, 300.0, 600.0)
# Record column -> (metric name, help, buckets).
HISTOGRAMS: Final = {
    "ttft_s": ("tokenload_ttft_seconds", "time to first token of each request that got one", TTFT_BUCKETS),
    "tpot_s": ("tokenload_tpot_seconds", "time per output token after the first, per request", TOKEN_BUCKETS),
    "itl_p50_s": ("tokenload_itl_seconds", "each request's median inter-token latency", TOKEN_BUCKETS),
    "e2e_s": ("tokenload_e2e_seconds", "end-to-end latency of each finished request", E2E_BUCKETS),
}
# The record columns `observe` reads.
COLUMNS: Final = ("status", "error_kind", "step", "output_tokens", *HISTOGRAMS)


class _Scrapes:
    """Numbers each scrape when it begins to read the registry and wakes whoever waits when its page has been written
    to the socket. Counted any earlier (when the registry was read), a scrape let the command close and exit while
    the page was half written: the scraper read headers and an empty page (1 watch in ~40, three at once on 2 cores).
    """

    def __init__(self) -> None:
        self.begun = 0
        self.written = 0  # the highest number of a scrape whose page has been written
        self.changed = threading.Condition()

    def begin(self) -> int:
        with self.changed:
            self.begun += 1
            return self.begun

    def wrote(self, number: int) -> None:
        with self.changed:
            self.written = max(self.written, number)
            self.changed.notify_all()


class _AfterPage:
    """A WSGI page that calls `done` when the server closes it, which it does after writing the last byte."""

    def __init__(self, page: Iterable[bytes], done: Callable[[], None]) -> None:
        self._page = list(page)
        self._done = done

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._page)

    def __len__(self) -> int:  # wsgiref sends a Content-Length for a page of one block
        return len(self._page)

    def close(self) -> None:
        self._done()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scraper that never reads does not keep the command alive


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the parent's name)
        """Scrapes are not the command's news: nothing on stderr."""


class LiveMetrics:
    """The live metrics of one run or watch, in their own registry; `serve` exposes them over HTTP."""

    def __init__(self, run_id: str = "") -> None:
        self.run_id = run_id  # `tokenload run` sets it when the run gets its id, before the first record
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("run_id", "step")
        self._histograms = {column: Histogram(name, text, labels, registry=self.registry, buckets=buckets)
                            for column, (name, text, buckets) in HISTOGRAMS.items()}
        self._requests = Counter("tokenload_requests", "requests recorded, by status (ok, error, cancelled) "
                                 "and error kind (empty unless an error)", (*labels, "status", "error_kind"),
                                 registry=self.registry)
        self._tokens = Counter("tokenload_output_tokens", "output tokens of the recorded requests", labels,
                               registry=self.registry)
        self._users = Gauge("tokenload_active_users", "users (streams) running now", ("run_id",),
                            registry=self.registry)
        self._children: dict[tuple[str, str], tuple[list[tuple[str, Any]], Any]] = {}
        self._scrapes = _Scrapes()
        self._sealed_at: int | None = None
        self._server: Any = None

    def serve(self, host: str, port: int) -> LiveMetrics:
        """Listen on host:port (`/metrics`); a port that cannot be bound is a ConfigError naming the flag."""
        exposition = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> _AfterPage:
            number = self._scrapes.begin()
            return _AfterPage(exposition(environ, start_response), lambda: self._scrapes.wrote(number))

        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            self._server = make_server(host, port, app, type("_Server", (_Server,), {"address_family": family}),
                                       handler_class=_Quiet)
        except OSError as exc:
            raise ConfigError(f"--prometheus-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                              "choose a free port") from None
        threading.Thread(target=self._server.serve_forever, name="tokenload-metrics", daemon=True).start()
        return self

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def observe(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Count records (dicts with at least `COLUMNS`); returns how many."""
        n = 0
        for row in rows:
            n += 1
            step = str(row.get("step") or 0)
            histograms, tokens = self._step_children(step)
            for column, histogram in histograms:
                value = row.get(column)
                if value is not None and value == value:  # NaN: Arrow's null read through pandas
                    histogram.observe(value)
            self._requests.labels(self.run_id, step, str(row.get("status")), row.get("error_kind") or "").inc()
            if row.get("output_tokens"):
                tokens.inc(row["output_tokens"])
        return n

    def _step_children(self, step: str) -> tuple[list[tuple[str, Any]], Any]:
        """One step's labelled histograms and token counter, looked up once (`labels` is the costly part)."""
        key = (self.run_id, step)
        if key not in self._children:
            self._children[key] = ([(column, h.labels(*key)) for column, h in self._histograms.items()],
                                   self._tokens.labels(*key))
        return self._children[key]

    def set_active_users(self, users: int) -> None:
        self._users.labels(self.run_id).set(users)

    def seal(self) -> None:
        """The numbers are final: a scrape that begins from now on reads them (`linger` waits for one)."""
        with self._scrapes.changed:
            self._sealed_at = self._scrapes.begun

    def linger(self, timeout_s: float) -> bool:
        """Keep serving until a scrape begun since `seal` (or since now) has been answered, or `timeout_s`; True if
        one was. A scrape between the seal and this call counts: whoever saw the end may have scraped already."""
        if self._server is None:
            return False
        with self._scrapes.changed:
            seen = self._scrapes.begun if self._sealed_at is None else self._sealed_at
            deadline = time.monotonic() + timeout_s
            while self._scrapes.written <= seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._scrapes.changed.wait(min(left, 0.5))  # short waits: Ctrl-C is handled between them
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
