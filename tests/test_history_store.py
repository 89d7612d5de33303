"""The history database: schema and migration, idempotent ingest, concurrent writers, default path."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import uuid
from contextlib import closing
from pathlib import Path

import pytest

from tokenload.cli import main
from tokenload.errors import ConfigError
from tokenload.history.store import (
    SCHEMA_VERSION,
    Capacity,
    Sample,
    SqliteHistory,
    channel_fingerprint,
    default_db_path,
    open_store,
)
from tokenload.load.records import COLUMNS

CHANNEL = "anthropic 127.0.0.1:9 sim-7b"


def _rows(sample_id: str, n: int, t: float = 1_700_000_000.0) -> list[dict]:
    return [{"request_id": f"{sample_id}-{i}", "started_at": t + i, "status": "ok", "ttft_s": 0.1 * (i + 1),
             "input_tokens": 10, "output_tokens": 5, "protocol": "anthropic", "model": "sim-7b"} for i in range(n)]


def test_rows_keep_every_requests_column_plus_history_columns(tmp_path: Path) -> None:
    with closing(open_store(tmp_path / "h.db")) as store:
        sample = Sample("s1", CHANNEL, "probe", 1_700_000_000.0, tokens=45, requests=3)
        assert store.add_sample(sample, _rows("s1", 3)) == 3
        frame = store.query()
        assert list(frame.columns[: len(COLUMNS)]) == list(COLUMNS)
        assert {"channel", "sample_id", "source"} <= set(frame.columns)
        assert frame["ttft_s"].tolist() == pytest.approx([0.1, 0.2, 0.3])
        assert set(frame["sample_id"]) == {"s1"} and set(frame["source"]) == {"watch"}
        assert store.tokens_used(CHANNEL, 0, 2e9) == 45
        assert store.tokens_used(CHANNEL, 1_700_000_001.0, 2e9) == 0
        assert store.channels() == [(CHANNEL, 3)]
        # the same sample again (a retried commit) adds nothing
        assert store.add_sample(sample, _rows("s1", 3)) == 0
        assert len(store.query()) == 3 and len(store.samples()) == 1
    db = sqlite3.connect(tmp_path / "h.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    indexes = {r[1] for r in db.execute("PRAGMA index_list(requests)")}
    assert "requests_channel_time" in indexes


def test_an_older_file_gains_new_columns_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    open_store(path).close()
    db = sqlite3.connect(path)
    db.execute('ALTER TABLE requests DROP COLUMN "malformed_events"')  # as if made before that column existed
    db.commit()
    db.close()
    with closing(open_store(path)) as store:
        store.add_sample(Sample("s", CHANNEL, "probe", 1.0), [{**_rows("s", 1)[0], "malformed_events": 2}])
        assert store.query()["malformed_events"].tolist() == [2]
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    with pytest.raises(ConfigError, match="newer than this tokenload"):
        open_store(path)


def test_a_version_2_file_gains_the_capacities_table_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    with closing(open_store(path)) as store:
        store.add_sample(Sample("s", CHANNEL, "probe", 1.0), _rows("s", 2))
    db = sqlite3.connect(path)  # as a tokenload of schema 2 left it
    db.execute("DROP TABLE capacities")
    db.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with closing(open_store(path)) as store:
        assert len(store.query()) == 2 and store.capacities(CHANNEL) == []
        found = Capacity("run:a", CHANNEL, 5.0, "users", 24.0, 25.0, 1.0, 256.0)
        store.add_capacity(found)
        store.add_capacity(found)  # the same run added again replaces itself
        store.add_capacity(Capacity("run:b", CHANNEL, 3.0, "users", None, 1.0, 1.0, 256.0))
        assert store.capacities(CHANNEL) == [Capacity("run:b", CHANNEL, 3.0, "users", None, 1.0, 1.0, 256.0), found]
        assert store.capacities(CHANNEL, since=4.0) == [found] and store.capacities("other") == []
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)


def test_a_file_that_is_not_a_database_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    path.write_text("not sqlite at all, " * 100)
    with pytest.raises(ConfigError, match="history database"):
        open_store(path)


def _writer(path: str, tag: str, samples: int) -> None:
    store = SqliteHistory(path)
    for k in range(samples):
        sid = f"{tag}-{k}-{uuid.uuid4().hex[:6]}"
        store.add_sample(Sample(sid, CHANNEL, "probe", 1_700_000_000.0 + k, tokens=15, requests=3), _rows(sid, 3))
    store.close()


def test_two_writer_processes_on_one_file_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "h.db")
    open_store(path).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, tag, 150)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with closing(open_store(path)) as store:
        frame = store.query()
        assert len(frame) == 2 * 150 * 3
        assert frame["request_id"].is_unique
        assert len(store.samples()) == 300
        assert store.tokens_used(CHANNEL, 0, 2e9) == 300 * 15


def test_connections_opening_one_new_file_together_all_open(tmp_path: Path) -> None:
    """Two watchers started together: SQLite refuses a concurrent switch of a new file to WAL at once
    ("database is locked", no busy wait); every opener must still get the store (was 19 failures in 300)."""
    failures: list[str] = []

    def open_and_close(path: Path) -> None:
        try:
            open_store(path).close()
        except ConfigError as exc:
            failures.append(str(exc))

    for i in range(150):
        threads = [threading.Thread(target=open_and_close, args=(tmp_path / f"h{i}.db",)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert failures == []


def test_default_path_honours_xdg_data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "xdg" / "tokenload" / "history.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / ".local" / "share" / "tokenload" / "history.db"


def test_fingerprint_keeps_protocol_host_and_model_only() -> None:
    assert channel_fingerprint("openai-chat", "https://user:sk-secret-123@relay.example:8443/k/sk-path/v1",
                               "gpt-x") == "openai-chat relay.example:8443 gpt-x"


def test_history_add_ingests_a_run_directory_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenload.analysis.synthetic import write_synthetic_run

    run_dir = write_synthetic_run(tmp_path / "run", n=200)
    db = tmp_path / "h.db"
    assert main(["history", "add", str(run_dir), "--db", str(db)]) == 0
    assert "200 of 200 requests added" in capsys.readouterr().out
    assert main(["history", "add", str(run_dir), "--db", str(db)]) == 0
    assert "0 of 200 requests added" in capsys.readouterr().out
    with closing(open_store(db)) as store:
        frame = store.query()
        assert len(frame) == 200 and set(frame["source"]) == {"run"}
        assert store.samples()[0].kind == "run" and store.samples()[0].requests == 200
    assert main(["history", "add", str(tmp_path), "--db", str(db)]) == 2
    assert "not a finished run directory" in capsys.readouterr().err
    assert main(["history", "rm", "x", "--db", str(db)]) == 2
