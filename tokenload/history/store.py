"""The history database: request rows of many samples and runs, by channel and time.

One small interface (`HistoryStore`) so that a shared server database can be
added later for teams watching from several places; `SqliteHistory` is the
local implementation: stdlib `sqlite3` in WAL mode, so readers never block the
watcher and several watchers can share one file (each write is one
`BEGIN IMMEDIATE` transaction; a busy file is waited for, never given up on
within `BUSY_TIMEOUT_S`).

A row has the columns of requests.parquet (`tokenload.load.records.SCHEMA`,
followed as it grows: a column added there is added to an existing database on
open) plus `channel` (a fingerprint: protocol, host and model, never a secret),
`sample_id` and `source` (`watch` or `run`); `query` adds `server_<term>`
columns (`server_running`, `server_waiting`, `server_kv_cache_usage`) from the
server's gauges that `watch --server-metrics` keeps with each sample. A sample is committed whole in one
transaction with its unique id, so a watcher killed mid-sample leaves either
all of that sample's rows or none, and `request_id` is unique, so ingesting a
run directory twice adds nothing.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import pyarrow as pa

from tokenload.contracts.manifest import Manifest
from tokenload.errors import ConfigError
from tokenload.load.records import COLUMNS, SCHEMA
from tokenload.search.bisect import Search
from tokenload.search.resume import SEARCH_FILE

if TYPE_CHECKING:
    import pandas as pd

    from tokenload.channel import Channel

SCHEMA_VERSION = 3
BUSY_TIMEOUT_S = 60.0
HISTORY_COLUMNS: tuple[str, ...] = ("channel", "sample_id", "source")


def default_db_path() -> Path:
    """`$XDG_DATA_HOME/tokenload/history.db`, else `~/.local/share/tokenload/history.db`."""
    base = os.environ.get("XDG_DATA_HOME", "").strip() or str(Path.home() / ".local" / "share")
    return Path(base).expanduser() / "tokenload" / "history.db"


def channel_fingerprint(protocol: str, url: str, model: str) -> str:
    """`protocol host[:port] model`: which channel a row measured, without any credential.

    Only the host is kept: a URL's user-info and some relays' paths carry keys.
    """
    parts = urlsplit(url)
    host = parts.hostname or "?"
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{protocol} {host} {model}"


def fingerprint_of(channel: Channel) -> str:
    return channel_fingerprint(channel.protocol, channel.base_url, channel.model)


def _sql_type(dtype: pa.DataType) -> str:
    if pa.types.is_floating(dtype):
        return "REAL"
    if pa.types.is_integer(dtype) or pa.types.is_boolean(dtype):
        return "INTEGER"
    return "TEXT"


def _row_columns() -> list[tuple[str, str]]:
    return [(f.name, _sql_type(f.type)) for f in SCHEMA] + [(c, "TEXT") for c in HISTORY_COLUMNS]


def _migrate_v1(db: sqlite3.Connection) -> None:
    columns = ", ".join(f'"{name}" {kind}' for name, kind in _row_columns())
    db.execute(f"CREATE TABLE requests ({columns}, UNIQUE (request_id))")
    db.execute("CREATE INDEX requests_channel_time ON requests (channel, started_at)")
    db.execute("CREATE INDEX requests_time ON requests (started_at)")
    db.execute("CREATE INDEX requests_sample ON requests (sample_id)")
    db.execute(
        "CREATE TABLE samples (sample_id TEXT PRIMARY KEY, channel TEXT NOT NULL, kind TEXT NOT NULL, "
        "started_at REAL NOT NULL, tokens INTEGER NOT NULL DEFAULT 0, requests INTEGER NOT NULL DEFAULT 0, "
        "errors INTEGER NOT NULL DEFAULT 0, note TEXT)"
    )
    db.execute("CREATE INDEX samples_channel_time ON samples (channel, started_at)")


def _migrate_v2(db: sqlite3.Connection) -> None:
    """`watch --server-metrics`: the server's gauges beside each sample, as JSON {term: value}."""
    db.execute("ALTER TABLE samples ADD COLUMN server TEXT")


def _migrate_v3(db: sqlite3.Connection) -> None:
    """The capacities searched stress runs found (one row per run, `Capacity`)."""
    db.execute("CREATE TABLE capacities (sample_id TEXT PRIMARY KEY, channel TEXT NOT NULL, started_at REAL NOT NULL, "
               "over TEXT NOT NULL, capacity REAL, upper REAL, min_level REAL NOT NULL, max_level REAL NOT NULL)")
    db.execute("CREATE INDEX capacities_channel_time ON capacities (channel, started_at)")


# Migration k brings a database from version k to k + 1; append, never edit.
MIGRATIONS = (_migrate_v1, _migrate_v2, _migrate_v3)
assert len(MIGRATIONS) == SCHEMA_VERSION


@dataclass(frozen=True)
class Sample:
    """One sampling round (or one ingested run) as the `samples` table keeps it."""

    sample_id: str
    channel: str
    # probe: a watch sample; skipped: one the token budget did not allow; run: an ingested run;
    # reserved: tokens booked for a sample or stress run in progress (left behind by a killed watcher)
    kind: str
    started_at: float
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    note: str | None = None
    # the server's gauges when the sample began (`watch --server-metrics`): JSON {"running": 4, ...}
    server: str | None = None


@dataclass(frozen=True)
class Capacity:
    """What one searched run (`[load] kind = "search"`, e.g. `watch --stress search@...`) found.

    `capacity` is the highest passing level (None: none passed), `upper` the lowest level that failed or
    stayed undecided below the target (None: none): the boundary lies in [capacity, upper].
    """

    sample_id: str
    channel: str
    started_at: float
    over: str  # users or rate
    capacity: float | None
    upper: float | None
    min_level: float
    max_level: float


def row_tokens(row: Mapping[str, Any]) -> int:
    """Tokens a request spent: input plus output (what a token budget counts)."""
    return int(row.get("input_tokens") or 0) + int(row.get("output_tokens") or 0)


class HistoryStore(Protocol):
    """What watch and history need from a history database; SQLite today, a server later."""

    def add_sample(self, sample: Sample, rows: Sequence[Mapping[str, Any]], source: str = "watch") -> int:
        """Commit a sample and its request rows in one transaction; returns rows added.

        The sample replaces its reservation (same id), if any; a request id
        already stored is not added again, so adding a run twice adds nothing.
        """
        ...

    def reserve(self, sample: Sample, budget: int, since: float, until: float) -> bool:
        """Book `sample.tokens` against `budget` for [since, until), atomically; False when it does not fit.

        Checking and booking in one transaction is what keeps a budget shared by
        several watchers of a channel; a reservation left by a killed watcher
        stays booked (the budget errs on the safe side).
        """
        ...

    def release(self, sample_id: str) -> None:
        """Drop a reservation that was not used."""
        ...

    def tokens_used(self, channel: str, since: float, until: float) -> int:
        """Tokens the samples of `channel` spent in [since, until): the budget's ledger."""
        ...

    def last_sample_at(self, channel: str) -> float | None:
        """When `channel`'s newest sample started (None before the first): a restarted watcher resumes from it."""
        ...

    def samples(self, channel: str | None = None) -> list[Sample]:
        """The samples (of `channel`, or all), oldest first."""
        ...

    def query(self, *, since: float | None = None, channels: Sequence[str] | None = None) -> pd.DataFrame:
        """Request rows, oldest first, with the history columns."""
        ...

    def channels(self) -> list[tuple[str, int]]:
        """Every channel fingerprint with its row count, most rows first."""
        ...

    def add_capacity(self, capacity: Capacity) -> None:
        """Keep a searched run's capacity (adding the same run again replaces it)."""
        ...

    def capacities(self, channel: str, since: float | None = None) -> list[Capacity]:
        """`channel`'s searched capacities, oldest first."""
        ...

    def close(self) -> None: ...


class SqliteHistory:
    """`HistoryStore` on one SQLite file (WAL mode)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            self._wal()
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"history database {self.path}: {exc}; give another --db or move the file away") from None
        except OSError as exc:
            raise ConfigError(f"history database {self.path}: {exc.strerror}; give a writable --db path") from None

    def _wal(self) -> None:
        """Switch the file to WAL. SQLite answers "locked" at once, without waiting its busy timeout, when
        another connection is switching the same new file (two watchers starting together): wait here."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _migrate(self) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            found = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = int(found[0]) if found else 0
            if version > SCHEMA_VERSION:
                raise ConfigError(f"history database {self.path} has schema {version}, newer than this tokenload "
                                  f"({SCHEMA_VERSION}); upgrade tokenload")
            for migrate in MIGRATIONS[version:]:
                migrate(db)
            have = {r[1] for r in db.execute("PRAGMA table_info(requests)")}
            for name, kind in _row_columns():
                if name not in have:  # a column requests.parquet gained since the file was made
                    db.execute(f'ALTER TABLE requests ADD COLUMN "{name}" {kind}')
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _insert_rows(self, rows: Iterable[Mapping[str, Any]], channel: str, sample_id: str, source: str) -> int:
        names = [*COLUMNS, *HISTORY_COLUMNS]
        quoted = ", ".join(f'"{n}"' for n in names)
        sql = f"INSERT OR IGNORE INTO requests ({quoted}) VALUES ({', '.join('?' for _ in names)})"
        extra = {"channel": channel, "sample_id": sample_id, "source": source}
        values = [tuple(extra[n] if n in extra else _plain(row.get(n)) for n in names) for row in rows]
        before = self._db.total_changes
        self._db.executemany(sql, values)
        return self._db.total_changes - before

    def _write(self, body: Any) -> int:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            added = int(body())
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return added

    def add_sample(self, sample: Sample, rows: Sequence[Mapping[str, Any]], source: str = "watch") -> int:
        def body() -> int:
            self._db.execute(
                "INSERT OR REPLACE INTO samples VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (sample.sample_id, sample.channel, sample.kind, sample.started_at, sample.tokens, sample.requests,
                 sample.errors, sample.note, sample.server),
            )
            return self._insert_rows(rows, sample.channel, sample.sample_id, source)

        return self._write(body)

    def reserve(self, sample: Sample, budget: int, since: float, until: float) -> bool:
        def body() -> int:
            if self.tokens_used(sample.channel, since, until) + sample.tokens > budget:
                return 0
            self._db.execute("INSERT INTO samples VALUES (?, ?, 'reserved', ?, ?, 0, 0, ?, NULL)",
                             (sample.sample_id, sample.channel, sample.started_at, sample.tokens, sample.note))
            return 1

        return bool(self._write(body))

    def release(self, sample_id: str) -> None:
        self._write(lambda: self._db.execute("DELETE FROM samples WHERE sample_id = ? AND kind = 'reserved'",
                                             (sample_id,)).rowcount)

    def tokens_used(self, channel: str, since: float, until: float) -> int:
        found = self._db.execute(
            "SELECT COALESCE(SUM(tokens), 0) FROM samples WHERE channel = ? AND started_at >= ? AND started_at < ?",
            (channel, since, until),
        ).fetchone()
        return int(found[0])

    def last_sample_at(self, channel: str) -> float | None:
        found = self._db.execute("SELECT MAX(started_at) FROM samples WHERE channel = ?", (channel,)).fetchone()
        return None if found[0] is None else float(found[0])

    def samples(self, channel: str | None = None) -> list[Sample]:
        sql = "SELECT * FROM samples" + (" WHERE channel = ?" if channel else "") + " ORDER BY started_at"
        return [Sample(*r) for r in self._db.execute(sql, (channel,) if channel else ())]

    def query(self, *, since: float | None = None, channels: Sequence[str] | None = None) -> pd.DataFrame:
        import pandas as pd

        where: list[str] = []
        params: list[object] = []
        if since is not None:
            where.append("started_at >= ?")
            params.append(since)
        if channels:
            where.append(f"channel IN ({', '.join('?' for _ in channels)})")
            params.extend(channels)
        sql = "SELECT * FROM requests" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY started_at"
        cursor = self._db.execute(sql, params)
        names = [d[0] for d in cursor.description]
        frame = pd.DataFrame.from_records(cursor.fetchall(), columns=names)
        return frame.merge(self._server_gauges(frame), on="sample_id", how="left") if len(frame) else frame

    def _server_gauges(self, frame: pd.DataFrame) -> pd.DataFrame:
        """`server_<term>` columns (server_running, server_waiting, ...) of the samples in `frame`, by sample_id."""
        import json

        import pandas as pd

        ids = list(frame["sample_id"].unique())
        rows = []
        for start in range(0, len(ids), 500):  # SQLite's parameter limit
            chunk = ids[start:start + 500]
            rows += [{"sample_id": sid, **{f"server_{k}": v for k, v in json.loads(server).items()}}
                     for sid, server in self._db.execute(
                         f"SELECT sample_id, server FROM samples WHERE server IS NOT NULL AND sample_id IN "
                         f"({', '.join('?' for _ in chunk)})", chunk)]
        return pd.DataFrame(rows, columns=None if rows else ["sample_id"])

    def channels(self) -> list[tuple[str, int]]:
        rows = self._db.execute("SELECT channel, COUNT(*) AS n FROM requests GROUP BY channel ORDER BY n DESC")
        return [(str(c), int(n)) for c, n in rows]

    def add_capacity(self, capacity: Capacity) -> None:
        self._write(lambda: self._db.execute("INSERT OR REPLACE INTO capacities VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                             tuple(capacity.__dict__.values())).rowcount)

    def capacities(self, channel: str, since: float | None = None) -> list[Capacity]:
        rows = self._db.execute("SELECT * FROM capacities WHERE channel = ? AND started_at >= ? ORDER BY started_at",
                                (channel, -math.inf if since is None else since))
        return [Capacity(*row) for row in rows]

    def close(self) -> None:
        self._db.close()


def _plain(value: Any) -> Any:
    """SQLite takes None, int, float, str and bytes; numpy scalars and bools become those."""
    if value is None or isinstance(value, (str, int, float, bytes)):
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def open_store(path: str | Path | None = None) -> SqliteHistory:
    """The history store at `path` (default `default_db_path()`)."""
    return SqliteHistory(path or default_db_path())


def ingest_run(store: HistoryStore, run_dir: str | Path) -> tuple[str, int, int]:
    """Add a `tokenload run` directory's requests to the store: (channel, rows added, rows in the run).

    The run's manifest names the channel (without secrets); its run id is the
    sample id, so the rows of one stress run stay together.
    """
    import pyarrow.parquet as pq

    from tokenload.rundir import MANIFEST_FILE, REQUESTS_FILE

    run_dir = Path(run_dir)
    requests_path, manifest_path = run_dir / REQUESTS_FILE, run_dir / MANIFEST_FILE
    if not requests_path.is_file() or not manifest_path.is_file():
        raise ConfigError(f"{run_dir} is not a finished run directory (no {REQUESTS_FILE} or {MANIFEST_FILE}); "
                          "give the directory `tokenload run` printed")
    try:
        manifest: Manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        table = pq.read_table(requests_path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ConfigError(f"{run_dir}: cannot read the run: {exc}") from None
    info = manifest.get("channel") or {}
    rows = table.to_pylist()
    model = info.get("model") or (rows[0].get("model") if rows else None) or "?"
    channel = channel_fingerprint(str(info.get("protocol") or "?"), str(info.get("base_url") or ""), str(model))
    sample = Sample(
        sample_id=f"run:{manifest.get('run_id') or run_dir.name}", channel=channel, kind="run",
        started_at=float(manifest.get("started_at") or min((r["started_at"] or 0.0 for r in rows), default=0.0)),
        tokens=sum(row_tokens(r) for r in rows), requests=len(rows),
        errors=sum(1 for r in rows if r.get("status") != "ok"), note=str(run_dir.name),
    )
    added = store.add_sample(sample, rows, source="run")
    found = searched(run_dir)
    if found is not None:
        store.add_capacity(Capacity(sample.sample_id, channel, sample.started_at, found.over, found.capacity,
                                    found.bounds()[1], found.min_level, found.max_level))
    return channel, added, len(rows)


def searched(run_dir: Path) -> Search | None:
    """The search a searched run directory recorded (its search.json), None for other runs."""
    try:
        return Search.from_dict(json.loads((run_dir / SEARCH_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
