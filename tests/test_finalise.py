"""Finalising a long run in bounded memory (`records.merge_segments`, `rundirs.finalise`) and the master's courier
state (`courier.Numbers`, `courier.RecentIds`): real segments on disk, no Locust.

The streamed merge must give requests.parquet exactly as the one-piece merge did (every segment read, concatenated
in name order, sorted stably by start time) whatever the run's length; the tests force its pieces, spills and
merge rounds on small runs by shrinking the piece size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tokenload import quantiles
from tokenload.load import records
from tokenload.load.rundirs import finalise


def _filled(kind: pa.DataType, n: int, rng: np.random.Generator) -> pa.Array:
    """A column of values, as in a real record (every column has one in most records)."""
    if kind == pa.string():
        return pa.array(rng.integers(10**17, 10**18, n)).cast(pa.string())
    if kind == pa.bool_():
        return pa.array(rng.uniform(size=n) < 0.5)
    return pa.array(rng.uniform(0, 1000, n)).cast(kind, safe=False)


def _segments(run_dir: Path, workers: int, per_worker: int, per_segment: int, seed: int = 0) -> pa.Table:
    """Segments as the load processes write them (records in the order they finished, a segment per flush), with
    ties in start time across workers, a missing start and a long request that finishes far from its start;
    returns every record, in the segments' name order."""
    rng = np.random.default_rng(seed)
    seg = run_dir / records.SEGMENTS_DIR
    seg.mkdir(parents=True)
    named = []
    for w in range(workers):
        i = np.arange(per_worker)
        started = np.round(1_700_000_000 + np.sort(rng.uniform(0, 60, per_worker)), 2)  # 10 ms steps: ties
        e2e = rng.lognormal(0, 1, per_worker)
        e2e[rng.uniform(size=per_worker) < 0.01] = 45.0  # a few long requests, out of order by far
        columns = {"request_id": pc.binary_join_element_wise(f"t{w}", pa.array(i).cast(pa.string()), "-"), "run_id": pa.array(["r"] * per_worker),
                   "worker": pa.array([f"w{w}"] * per_worker), "status": pa.array(np.where(i % 7, "ok", "error")),
                   "started_at": pa.array(started, mask=(w == 0) & (i == 3)), "e2e_s": pa.array(e2e),
                   "late_s": pa.array(e2e / 100), "in_flight": pa.array(i % 11 == 0),
                   "output_tokens": pa.array(i % 50)}
        full = pa.table([columns.get(f.name, _filled(f.type, per_worker, rng)) for f in records.SCHEMA],
                        schema=records.SCHEMA).take(np.argsort(started + e2e, kind="stable"))  # in finishing order
        for k in range(0, per_worker, per_segment):
            name = records.segment_name(f"w{w}", k // per_segment)
            records.write_segment(seg / name, full.slice(k, per_segment))
            named.append((name, full.slice(k, per_segment)))
    return pa.concat_tables([t for _, t in sorted(named, key=lambda x: x[0])])


def _one_piece(table: pa.Table) -> pa.Table:
    """The merge before streaming: everything at once, sorted by start time."""
    return table.sort_by([("started_at", "ascending")])


@pytest.mark.parametrize("sort_rows, fan_in", [(10**9, 64), (500, 64), (300, 3)])
def test_the_streamed_merge_writes_what_the_one_piece_merge_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  sort_rows: int, fan_in: int) -> None:
    """One piece, pieces merged at once, and pieces merged in two levels: the same rows in the same order (ties in
    start time in the segments' order, the missing start last), in row groups of ROW_GROUP_ROWS."""
    monkeypatch.setattr(records, "SORT_ROWS", sort_rows)
    monkeypatch.setattr(records, "MERGE_FAN_IN", fan_in)
    monkeypatch.setattr(records, "SPILL_BATCH_ROWS", 64)
    monkeypatch.setattr(records, "ROW_GROUP_ROWS", 1000)
    everything = _segments(tmp_path, workers=5, per_worker=900, per_segment=97)
    merged = finalise(tmp_path)
    written = pq.read_table(tmp_path / "requests.parquet")
    assert written.equals(_one_piece(everything))
    assert written.column("started_at").null_count == 1 and written.column("started_at")[-1].as_py() is None
    assert pq.ParquetFile(tmp_path / "requests.parquet").num_row_groups == 5
    assert merged.rows == 4500 and merged.copies == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["records"]["total"] == 4500
    assert manifest["records"]["per_worker"] == {f"w{w}": 900 for w in range(5)}
    assert manifest["records"]["in_flight"] == sum(1 for i in range(900) if i % 11 == 0) * 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "requests.parquet"]


def test_a_record_written_twice_is_kept_once_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of a segment under another name (a courier batch also written directly): each record once, a warning.
    The one-piece merge refused the whole run (`duplicate request_id values`), which lost it."""
    monkeypatch.setattr(records, "SORT_ROWS", 200)
    everything = _segments(tmp_path, workers=2, per_worker=300, per_segment=50)
    seg = tmp_path / records.SEGMENTS_DIR
    (seg / "w9-000000.arrow").write_bytes((seg / "w1-000002.arrow").read_bytes())
    merged = finalise(tmp_path)
    written = pq.read_table(tmp_path / "requests.parquet")
    assert merged.copies == 50 and written.equals(_one_piece(everything))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert any("twice" in w for w in manifest["warnings"])


def test_lateness_of_a_long_open_loop_run_is_numpys_percentile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest's open-loop lateness read a row group at a time, past the values it may hold at once: the same
    numbers as numpy over the whole column."""
    monkeypatch.setattr(quantiles, "HOLD", 100)
    monkeypatch.setattr(records, "ROW_GROUP_ROWS", 256)
    everything = _segments(tmp_path, workers=3, per_worker=400, per_segment=80)
    records.write_json(tmp_path / records.SEGMENTS_DIR / "scenario.json", {"load": {"kind": "poisson"}})
    finalise(tmp_path)
    late = everything.column("late_s").to_numpy()
    lateness = json.loads((tmp_path / "manifest.json").read_text())["open_loop_lateness"]
    assert lateness["p50_s"] == float(np.percentile(late, 50)) and lateness["p99_s"] == float(np.percentile(late, 99))
    assert lateness["max_s"] == float(late.max()) and lateness["late_fraction"] == float((late > 0.010).mean())


@pytest.mark.parametrize("hold", [7, 100, 10**9])
def test_percentiles_in_bounded_memory_are_numpys(hold: int) -> None:
    """Exact order statistics by narrowing buckets, interpolated as numpy does: equal to its last bit."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        n = int(rng.integers(1, 3000))
        x = [rng.lognormal(0, 2, n), rng.normal(0, 1, n), np.round(rng.uniform(-3, 3, n), 1), np.full(n, 0.25)][trial % 4]
        x[rng.uniform(size=n) < 0.05] = np.nan
        finite = x[np.isfinite(x)]
        percents = [0, 1, 2.5, 37.3, 50, 95, 97.5, 99, 99.9, 100]
        count, got = quantiles.percentiles(lambda x=x: (x[i:i + 337] for i in range(0, len(x), 337)), percents,
                                           hold=hold)
        assert count == len(finite)
        want = np.percentile(finite, percents) if len(finite) else np.full(len(percents), np.nan)
        assert np.array_equal(got, want, equal_nan=True), (trial, hold)


# The merge in a process of its own (its peak is the merge's), every bound of it small: pieces of 2,500 records,
# read 1,024 at a time, 8 at once, row groups of 5,000.
GROWTH = """
import json, resource, sys
from pathlib import Path
from tokenload.load import records
records.SORT_ROWS, records.SPILL_BATCH_ROWS, records.MERGE_FAN_IN, records.ROW_GROUP_ROWS = 2500, 1024, 8, 5000
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
merged = records.merge_segments(Path(sys.argv[1]), records.seal(Path(sys.argv[1])))
print(json.dumps({"rows": merged.rows, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "before_kib": before}))
"""


def _peak_growth(run_dir: Path, rows: int) -> int:
    _segments(run_dir, workers=4, per_worker=rows // 4, per_segment=500)
    out = subprocess.run([sys.executable, "-c", GROWTH, str(run_dir)], capture_output=True, text=True,
                         timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["rows"] == rows
    return int(result["peak_kib"] - result["before_kib"])


@pytest.mark.slow
def test_finalising_holds_no_more_for_a_run_eight_times_as_long(tmp_path: Path) -> None:
    """The merge's peak memory does not grow with the run: 10k and 80k records of 670 B in Arrow (the one-piece
    merge held them all, twice while sorting: 20 and 157 MB above its start)."""
    short = _peak_growth(tmp_path / "short", 10_000)
    long = _peak_growth(tmp_path / "long", 80_000)
    assert long < short + 8 * 1024, (short, long)  # KiB


NUMBERS = """
import json
from tokenload.load import courier
numbers = courier.Numbers()
for seq in [0, 1, 3, 4, 2, *range(5, 100_000)]:
    numbers.add(seq)
out = {"low": numbers.low, "above": sorted(numbers.above), "has": [4 in numbers, 100_000 in numbers]}
numbers.add(100_002)
out["gap"] = [sorted(numbers.above), 100_001 in numbers, 100_002 in numbers]
ids = courier.RecentIds(batches=10)
for batch in range(5_000):
    ids.add(f"w-{batch}-{i}" for i in range(50))
out["ids"] = [len(ids), "w-4999-0" in ids, "w-4990-49" in ids, "w-4989-49" in ids]
print(json.dumps(out))
"""


def test_the_master_remembers_batch_numbers_and_recent_ids_in_flat_memory() -> None:
    """A worker's batch numbers arrived in order leave nothing behind, those out of order only until the gap fills;
    the request ids held are the last RECENT_BATCHES batches', however many came (before: every id of the run).
    In a child process: the courier imports Locust, which would monkey-patch pytest."""
    child = subprocess.run([sys.executable, "-c", NUMBERS], capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(child.stdout)
    assert out["low"] == 100_000 and out["above"] == [] and out["has"] == [True, False]
    assert out["gap"] == [[100_002], False, True]
    assert out["ids"] == [500, True, True, False]
