"""Fetch and parse a server's Prometheus text; find its `/metrics`; sample it for the length of a run.

Parsing is prometheus_client's (`text_string_to_metric_families`), the
reference parser of the exposition format, not a home-made one. A scrape sends
no credentials: inference servers publish `/metrics` without the API key, and a
relay's answer (404, 401, an HTML page) only means there is no server view.

`Sampler` runs in a thread of the process that supervises Locust (`tokenload
run`), so it shares no event loop or socket with the users; it
stops after the last Locust process has exited and writes every raw sample to
RUN_DIR/server_metrics.parquet (time, source, name, labels, value).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenload.errors import ConfigError
from tokenload.rundir import SERVER_METRICS_FILE
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


class Sampler:
    """Scrape every source each `interval_s` in a daemon thread; `stop()` writes the parquet file.

    `live`: also leave each scrape's gauges in that file (`read_live`); `store=False` keeps no samples
    (a web session, whose runs Locust finalises and analyses itself).
    """

    def __init__(self, sources: Sources, run_dir: Path, live: Path | None = None, store: bool = True) -> None:
        self.sources = sources
        self.path = run_dir / SERVER_METRICS_FILE
        self.live = live
        self.store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenload-server-metrics", daemon=True)
        self._times: list[float] = []
        self._source: list[str] = []
        self._rows: list[Row] = []
        self.scrapes = 0
        self._latest: dict[str, dict[str, float]] = {}  # source -> gauge term -> its value in the last scrape
        self.failures: dict[str, int] = {}
        self.last_problem: str | None = None

    def start(self) -> Sampler:
        if self.sources.urls:
            self._thread.start()
        return self

    def _run(self) -> None:
        interval = self.sources.interval_s
        due = {url: time.monotonic() for url in self.sources.urls}
        failed_in_row = dict.fromkeys(self.sources.urls, 0)
        with client() as http:
            while not self._stop.is_set():
                for url in self.sources.urls:
                    if time.monotonic() < due[url]:
                        continue
                    sent = time.time()
                    try:
                        rows = scrape(http, url)
                    except ValueError as exc:
                        failed_in_row[url] += 1
                        self.failures[url] = self.failures.get(url, 0) + 1
                        self.last_problem = str(exc)
                        rows = []
                    else:
                        failed_in_row[url] = 0
                        self._latest[url] = gauges(rows)
                    at = (sent + time.time()) / 2  # the server answered somewhere in between
                    self.scrapes += 1
                    if self.store:
                        self._rows += rows
                        self._times += [at] * len(rows)
                        self._source += [public_url(url)] * len(rows)
                    if self.live is not None and rows:
                        tmp = self.live.with_suffix(".tmp")
                        tmp.write_text(json.dumps({"at": at, "gauges": self.latest()}), encoding="utf-8")
                        os.replace(tmp, self.live)
                    extra = failed_in_row[url] - BACKOFF_AFTER
                    wait = interval if extra < 0 else min(BACKOFF_MAX_S, interval * 2 ** (extra + 1))
                    due[url] = max(due[url] + wait, time.monotonic() + interval / 10)
                self._stop.wait(max(0.0, min(due.values()) - time.monotonic()))

    def latest(self) -> dict[str, float]:
        """The gauges of each source's last good scrape, combined (for the live line)."""
        per_source = list(self._latest.values())
        out: dict[str, float] = {}
        for term in {t for g in per_source for t in g}:
            values = [g[term] for g in per_source if term in g]
            out[term] = sum(values) if TERMS[term].how == "sum" else sum(values) / len(values)
        return out

    def stop(self) -> dict[str, Any]:
        """Stop sampling, write the samples, and return what the manifest records about them."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(SCRAPE_TIMEOUT_S * len(self.sources.urls) + 1.0)
        if self.live is not None:
            self.live.unlink(missing_ok=True)
        if not self.sources.urls:
            return {"sources": [], "note": self.sources.note}
        if not self.store:
            return {"sources": [public_url(u) for u in self.sources.urls], "scrapes": self.scrapes}
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({
            "time": pa.array(self._times, pa.float64()),
            "source": pa.array(self._source, pa.string()).dictionary_encode(),
            "name": pa.array([r[0] for r in self._rows], pa.string()).dictionary_encode(),
            "labels": pa.array([r[1] for r in self._rows], pa.string()),
            "value": pa.array([r[2] for r in self._rows], pa.float64()),
        })
        pq.write_table(table, self.path)
        names = {r[0] for r in self._rows}
        out: dict[str, Any] = {
            "sources": [public_url(u) for u in self.sources.urls], "file": SERVER_METRICS_FILE,
            "interval_s": self.sources.interval_s, "scrapes": self.scrapes,
            "failed_scrapes": sum(self.failures.values()), "samples": len(self._rows),
            "servers": sorted(set(self.sources.found) | set(servers(names))),
        }
        if self.last_problem:
            out["last_problem"] = self.last_problem
        return out
