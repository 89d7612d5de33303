"""Fetch and parse a server's Prometheus text; find its `/metrics`; sample it for the length of a run.

Parsing is prometheus_client's (`text_string_to_metric_families`), the
reference parser of the exposition format, not a home-made one. A scrape sends
no credentials: inference servers publish `/metrics` without the API key, and a
relay's answer (404, 401, an HTML page) only means there is no server view.

`Sampler` runs in a thread of the process that supervises Locust (`tokenload
run`, headless or `--web`), so it shares no event loop or socket with the users;
it writes each round's raw samples (time, source, name, labels, value) at once
beside the run's request segments, and finalising the run (`collect`) turns
them into RUN_DIR/server_metrics.parquet, also for a run whose `tokenload run`
was killed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenload.errors import ConfigError
from tokenload.rundir import SEGMENTS_DIR, SERVER_METRICS_FILE
from tokenload.servermetrics.vocabulary import TERMS, lookup, servers

# A scrape that takes longer than this is abandoned (the next tick tries again).
SCRAPE_TIMEOUT_S = 2.0
# After this many failed scrapes in a row a source is asked less often: the wait doubles, up to BACKOFF_MAX_S.
BACKOFF_AFTER = 3
BACKOFF_MAX_S = 30.0
ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"

Row = tuple[str, str, float]  # sample name, labels as sorted JSON, value


def public_url(url: str) -> str:
    """The URL without user info, query or fragment: safe for the manifest and messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def origin_metrics_url(base_url: str) -> str:
    """`<the base URL's origin>/metrics`: where vLLM, SGLang, llama.cpp and TGI all serve it."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


def parse(text: str) -> list[Row]:
    """Every sample of an exposition text; ValueError when the text is not Prometheus text."""
    rows: list[Row] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            rows.append((sample.name, json.dumps(sample.labels, sort_keys=True, separators=(",", ":")),
                         float(sample.value)))
    return rows


def scrape(client: httpx.Client, url: str) -> list[Row]:
    """One scrape; ValueError naming what came back when it is not Prometheus text."""
    try:
        response = client.get(url, headers={"accept": ACCEPT})
    except httpx.HTTPError as exc:
        raise ValueError(f"{public_url(url)} did not answer ({type(exc).__name__})") from None
    if response.status_code != 200:
        raise ValueError(f"{public_url(url)} answered HTTP {response.status_code}")
    if "html" in response.headers.get("content-type", "").lower():
        raise ValueError(f"{public_url(url)} answered an HTML page, not Prometheus text")
    try:
        rows = parse(response.text)
    except ValueError as exc:
        raise ValueError(f"{public_url(url)} did not answer Prometheus text ({str(exc)[:80]})") from None
    if not rows:
        raise ValueError(f"{public_url(url)} answered no samples")
    return rows


def gauges(rows: list[Row]) -> dict[str, float]:
    """The vocabulary's gauges in one scrape: term -> value (several series added or averaged as TERMS says)."""
    found: dict[str, list[float]] = {}
    for name, _, value in rows:
        hit = lookup(name)
        if hit is not None and TERMS[hit[0]].kind == "gauge":
            found.setdefault(hit[0], []).append(value)
    return {term: sum(v) if TERMS[term].how == "sum" else sum(v) / len(v) for term, v in found.items()}


def combine(per_source: list[dict[str, float]]) -> dict[str, float]:
    """Several sources' gauges as one server's: added or averaged as `TERMS` says (replicas add their queues)."""
    out: dict[str, float] = {}
    for term in {t for g in per_source for t in g}:
        values = [g[term] for g in per_source if term in g]
        out[term] = sum(values) if TERMS[term].how == "sum" else sum(values) / len(values)
    return out


def describe(found: dict[str, float]) -> str:
    """Gauges in a few words for a status line: "KV 80% 4 running 2 waiting"."""
    return " ".join(f"{v:g} {k}" if k != "kv_cache_usage" else f"KV {100 * v:.0f}%" for k, v in sorted(found.items()))


def snapshot(urls: Sequence[str]) -> tuple[dict[str, float], str | None]:
    """One scrape of every URL now: the gauges combined, and the last problem (a source that did not answer)."""
    found: list[dict[str, float]] = []
    problem = None
    with client() as http:
        for url in urls:
            try:
                found.append(gauges(scrape(http, url)))
            except ValueError as exc:
                problem = str(exc)
    return combine(found), problem


def client() -> httpx.Client:
    return httpx.Client(timeout=SCRAPE_TIMEOUT_S, follow_redirects=False, trust_env=False)


@dataclass
class Sources:
    """Where a run scrapes, and the one sentence the manifest keeps when it scrapes nothing."""

    urls: list[str]
    interval_s: float
    note: str | None = None
    found: list[str] = field(default_factory=list)  # servers recognised in the first scrape ("vLLM", ...)


def resolve(explicit: Sequence[str], base_url: str, interval_s: float = 1.0, discover: bool = True) -> Sources:
    """The URLs to sample: the ones given (each must answer Prometheus text now: ConfigError otherwise),
    else `<origin>/metrics` when it answers Prometheus text, else none with a note saying why."""
    with client() as http:
        if explicit:
            found: set[str] = set()
            for url in explicit:
                try:
                    found.update(servers({name for name, _, _ in scrape(http, url)}))
                except ValueError as exc:
                    raise ConfigError(f"server metrics: {exc}; give the server's Prometheus /metrics address "
                                      "or leave --server-metrics / [server] metrics_url out") from None
            return Sources(list(explicit), interval_s, found=sorted(found))
        if not discover:
            return Sources([], interval_s, "no server metrics: discovery is off ([server] discover = false)")
        url = origin_metrics_url(base_url)
        try:
            rows = scrape(http, url)
        except ValueError as exc:
            return Sources([], interval_s, f"no server metrics: {exc}")
        return Sources([url], interval_s, found=servers({name for name, _, _ in rows}))


# Where a `tokenload run --web` supervisor leaves the last scrape's gauges for the web UI tab (a Locust process).
LIVE_ENV = "TOKENLOAD_SERVER_LIVE"


def read_live(max_age_s: float = 5.0) -> dict[str, Any] | None:
    """The gauges the supervisor last left in `$TOKENLOAD_SERVER_LIVE`, if fresh; None otherwise."""
    path = os.environ.get(LIVE_ENV)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8")) if path else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and time.time() - float(data.get("at", 0)) <= max_age_s else None


# Where a run's samples wait until it is finalised: RUN_DIR/segments/server/ (beside the request segments).
SEGMENT_DIR = "server"
STATE_FILE = "state.json"


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temporary name and rename: a reader (or a kill) never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


class Sampler:
    """Scrape every source each `interval_s` in a daemon thread, writing the samples as they come.

    `target()` names the run directory the samples belong to now (None: none,
    e.g. between two runs of a web session); each round's samples are written
    at once as a segment of RUN_DIR/segments/server/, so a `tokenload run`
    killed with SIGKILL keeps every sample up to its last second, and
    finalising the run (`collect`) turns them into server_metrics.parquet. A
    run directory whose segments/ is gone (sealed: finalised) is never
    written again. `live`: also leave each scrape's gauges in that file
    (`read_live`); `keep_gauges`: keep (time, gauges) of every round in
    `history` (doctor's view of the server during its checks).
    """

    def __init__(self, sources: Sources, target: Callable[[], Path | None] | None = None, live: Path | None = None,
                 keep_gauges: bool = False) -> None:
        self.sources = sources
        self.target = target or (lambda: None)
        self.live = live
        self.keep_gauges = keep_gauges
        self.history: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenload-server-metrics", daemon=True)
        self.scrapes = 0
        self._latest: dict[str, dict[str, float]] = {}  # source -> gauge term -> its value in the last scrape
        self.failures: dict[str, int] = {}
        self.last_problem: str | None = None
        self._dir: Path | None = None  # the segments directory being written, and what was written to it
        self._seq = 0
        self._written = {"scrapes": 0, "failed_scrapes": 0}
        self._names: set[str] = set()

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        interval = self.sources.interval_s
        due = {url: time.monotonic() for url in self.sources.urls}
        failed_in_row = dict.fromkeys(self.sources.urls, 0)
        with client() as http:
            while True:
                batch: list[tuple[float, str, Row]] = []
                scraped = failed = 0
                last = self._stop.is_set()  # stopping: one last scrape of every source, due or not
                for url in self.sources.urls:
                    if time.monotonic() < due[url] and not last:
                        continue
                    sent = time.time()
                    try:
                        rows = scrape(http, url)
                    except ValueError as exc:
                        failed_in_row[url] += 1
                        failed += 1
                        self.failures[url] = self.failures.get(url, 0) + 1
                        self.last_problem = str(exc)
                        rows = []
                    else:
                        failed_in_row[url] = 0
                        self._latest[url] = gauges(rows)
                    at = (sent + time.time()) / 2  # the server answered somewhere in between
                    self.scrapes += 1
                    scraped += 1
                    batch += [(at, public_url(url), row) for row in rows]
                    extra = failed_in_row[url] - BACKOFF_AFTER
                    wait = interval if extra < 0 else min(BACKOFF_MAX_S, interval * 2 ** (extra + 1))
                    due[url] = max(due[url] + wait, time.monotonic() + interval / 10)
                if batch:
                    self._show(batch[-1][0])
                self._write(batch, scraped, failed)
                if last:
                    return
                next_due = min(due.values(), default=time.monotonic() + interval)
                self._stop.wait(max(0.0, next_due - time.monotonic()))

    def _show(self, at: float) -> None:
        """Hand the round's gauges to whoever watches them live (the web tab's file, doctor's history)."""
        now = json.dumps({"at": at, "gauges": self.latest()})
        if self.live is not None:
            _atomic(self.live, lambda tmp: tmp.write_text(now, encoding="utf-8"))
        if self.keep_gauges:
            self.history.append((at, self.latest()))

    def _write(self, batch: list[tuple[float, str, Row]], scraped: int, failed: int) -> None:
        """Append one round's samples to the current run directory's segments (and its state file)."""
        run_dir = self.target()
        seg = None if run_dir is None else run_dir / SEGMENTS_DIR
        if seg is None or not seg.is_dir():
            self._dir = None
            return
        here = seg / SEGMENT_DIR
        if here != self._dir:  # a new run (a web session's next start): its own counts
            self._dir, self._seq, self._written, self._names = here, 0, {"scrapes": 0, "failed_scrapes": 0}, set()
        try:
            here.mkdir(exist_ok=True)  # never parents: a sealed run's segments/ must not come back
            if batch:
                import pyarrow as pa
                from pyarrow import feather

                table = pa.table({
                    "time": pa.array([b[0] for b in batch], pa.float64()),
                    "source": pa.array([b[1] for b in batch], pa.string()),
                    "name": pa.array([b[2][0] for b in batch], pa.string()),
                    "labels": pa.array([b[2][1] for b in batch], pa.string()),
                    "value": pa.array([b[2][2] for b in batch], pa.float64()),
                })
                _atomic(here / f"{self._seq:06d}.arrow",
                        lambda tmp: feather.write_feather(table, tmp, compression="uncompressed"))
                self._seq += 1
                self._names.update(b[2][0] for b in batch)
            self._written["scrapes"] += scraped
            self._written["failed_scrapes"] += failed
            state: dict[str, Any] = {"sources": [public_url(u) for u in self.sources.urls]}
            if self.sources.urls:
                state.update(interval_s=self.sources.interval_s, **self._written,
                             servers=sorted(set(self.sources.found) | set(servers(self._names))))
                if self.last_problem:
                    state["last_problem"] = self.last_problem
            else:
                state["note"] = self.sources.note
            _atomic(here / STATE_FILE, lambda tmp: tmp.write_text(json.dumps(state), encoding="utf-8"))
        except FileNotFoundError:
            self._dir = None  # sealed under us: this round's samples belong to no run

    def latest(self) -> dict[str, float]:
        """The gauges of each source's last good scrape, combined (for the live line)."""
        return combine(list(self._latest.values()))

    def stop(self) -> None:
        """Stop sampling after one last scrape of every source, so the samples up to now are written."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(SCRAPE_TIMEOUT_S * len(self.sources.urls) + 1.0)
        if self.live is not None:
            self.live.unlink(missing_ok=True)


def collect(sealed: Path, run_dir: Path) -> dict[str, Any] | None:
    """Turn a finalised run's server segments into RUN_DIR/server_metrics.parquet; the manifest's entry.

    None when the run had no sampler (a worker machine, plain `locust -f`).
    """
    here = sealed / SEGMENT_DIR
    try:
        entry: dict[str, Any] = json.loads((here / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not entry.get("sources"):
        return entry
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyarrow import feather

    tables = [feather.read_table(p) for p in sorted(here.glob("*.arrow"))]
    table = pa.concat_tables(tables) if tables else pa.table({
        "time": pa.array([], pa.float64()), "source": pa.array([], pa.string()), "name": pa.array([], pa.string()),
        "labels": pa.array([], pa.string()), "value": pa.array([], pa.float64())})
    table = table.set_column(1, "source", table.column("source").dictionary_encode())
    table = table.set_column(2, "name", table.column("name").dictionary_encode())
    _atomic(run_dir / SERVER_METRICS_FILE, lambda tmp: pq.write_table(table, tmp))
    return {**entry, "file": SERVER_METRICS_FILE, "samples": len(table)}
