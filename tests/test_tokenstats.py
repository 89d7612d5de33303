"""The live token statistics: histogram percentiles against the raw values, and worker deltas merging exactly."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from tokenload.load.tokenstats import SERIES_KEEP_S, SERIES_S, Hist, TokenStats


def _records(n: int, seed: int, run_id: str = "r1") -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ok = rng.random() > 0.1
        started = 1000.0 + i * 0.05
        e2e = rng.lognormvariate(0, 0.5)
        out.append({"run_id": run_id, "step": 1 + i % 3, "active_users": 1 + i % 3, "status": "ok" if ok else "error",
                    "error_kind": None if ok else rng.choice(["rate_limited", "timeout_stall"]),
                    "started_at": started, "finished_at": started + e2e,
                    "ttft_s": rng.lognormvariate(-1, 0.7) if ok else None,
                    "tpot_s": rng.uniform(0.01, 0.05) if ok else None, "e2e_s": e2e if ok else None,
                    "input_tokens": rng.randint(10, 500), "output_tokens": rng.randint(1, 200) if ok else 0})
    return out


@pytest.mark.parametrize("pct", [50, 95, 99])
def test_histogram_percentile_within_half_a_percent_of_the_raw_one(pct: int) -> None:
    values = np.random.default_rng(3).lognormal(-1, 1.2, 20_000)
    hist = Hist()
    for v in values:
        hist.add(float(v))
    raw = float(np.percentile(values, pct))
    assert hist.percentile(pct) == pytest.approx(raw, rel=0.01)
    vectorised = Hist()
    vectorised.add_many(values)
    assert vectorised == hist


@pytest.mark.parametrize("tokens", [20, 2_000])
def test_gaps_are_counted_alike_for_a_short_and_a_long_stream(tokens: int) -> None:
    """`add_gaps` counts a short stream in plain Python and a long one with numpy: the same buckets either way,
    gaps of tokens read together (0) left out as before."""
    times = np.cumsum(np.random.default_rng(tokens).lognormal(-4, 1, tokens))
    times[5] = times[4]
    hist = Hist()
    hist.add_gaps(times.tolist())
    vectorised = Hist()
    vectorised.add_many(np.diff(times))
    assert hist == vectorised and hist.n == tokens - 2


def test_counting_a_request_of_a_known_step_and_moment_builds_no_cell() -> None:
    """The load generator counts every request it finishes here, in its event loop: where the request's cells
    exist, nothing is built (`setdefault(key, Cell())` built two cells of seven counters each, then dropped them)."""
    stats = TokenStats()
    record = _records(1, 1)[0]
    times = [0.02 * i for i in range(20)]
    stats.observe(record, times)
    tracemalloc.start()
    try:
        stats.observe(record, times)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1024, peak


def test_empty_histogram_has_no_percentile() -> None:
    assert Hist().percentile(50) is None


def test_worker_deltas_merge_to_exactly_the_whole() -> None:
    """Two workers each send three deltas (in any order): the master sees what one process seeing all would."""
    recs = _records(600, 1)
    whole = TokenStats()
    for r in recs:
        whole.observe(r, [0.0, 0.02, 0.05])
    workers = [TokenStats(), TokenStats()]
    deltas = []
    for chunk in range(3):
        for i, r in enumerate(recs[chunk * 200:(chunk + 1) * 200]):
            workers[i % 2].observe(r, [0.0, 0.02, 0.05])
        deltas += [w.take_wire() for w in workers]
    assert all(w.take_wire() == {} for w in workers)  # a delta is handed over once, then forgotten
    master = TokenStats()
    for delta in reversed(deltas):
        master.merge_wire(delta)
    got, want = master.run("r1"), whole.run("r1")
    assert got.total().summary() == want.total().summary()
    for step in want.steps:
        assert got.steps[step].summary() == want.steps[step].summary()
    assert got.timeline() == want.timeline()
    total = got.total().summary()
    assert total["requests"] == 600
    assert total["errors"] == sum(r["status"] == "error" for r in recs)
    assert total["output_tokens"] == sum(r["output_tokens"] for r in recs)
    assert sum(total["error_kinds"].values()) == total["errors"]
    ok_ttft = [r["ttft_s"] for r in recs if r["ttft_s"] is not None]
    assert total["ttft_p50_s"] == pytest.approx(float(np.percentile(ok_ttft, 50)), rel=0.02)


def test_runs_are_kept_apart() -> None:
    stats = TokenStats()
    for r in _records(30, 2, "a") + _records(10, 3, "b"):
        stats.observe(r)
    assert stats.run("a").total().requests == 30 and stats.run("b").total().requests == 10


def test_a_long_run_keeps_the_histograms_of_its_last_minute_only_and_every_point_of_its_timeline() -> None:
    """Two hours of records, 2 s a point: the master keeps every point's histograms no longer than SERIES_KEEP_S
    (before: 3,600 points' histograms, about 1.6 KB each, for the whole run: 7.1 MB traced, now 1.3 MB); the
    charts still draw every point, its counts exact and its percentiles those it had while it was recent."""
    rng = random.Random(5)
    recs = []
    for i in range(14_400):  # 2 records/s for 2 hours
        started = 1000.0 + i * 0.5
        recs.append({"run_id": "r1", "step": 1, "active_users": 4, "status": "ok", "started_at": started,
                     "finished_at": started + 0.3, "ttft_s": rng.lognormvariate(-1, 0.5), "tpot_s": 0.02,
                     "e2e_s": 0.3, "input_tokens": 10, "output_tokens": 1 + i % 7})
    whole = TokenStats()
    for r in recs:
        whole.observe(r)
    master, worker = TokenStats(), TokenStats()
    for k in range(0, len(recs), 6):  # a worker's delta every 3 s
        for r in recs[k:k + 6]:
            worker.observe(r)
        master.merge_wire(worker.take_wire())
    for stats in (whole, master):
        run = stats.run("r1")
        assert len(run.series) <= SERIES_KEEP_S / SERIES_S + 1 and len(run.points) > 3_500
        line = run.timeline()
        assert len(line["t"]) == 3_600 and sum(line["rps"]) * SERIES_S == len(recs)
        assert sum(line["output_tok_s"]) * SERIES_S == sum(r["output_tokens"] for r in recs)
        assert all(p is not None for p in line["ttft_p50_s"])
        assert run.total().summary()["requests"] == len(recs)
    assert master.run("r1").timeline() == whole.run("r1").timeline()
