"""Long runs: finalise and analyse 10M and 36M records, beside today's code.

**Synthetic** (`--records 10000000,36000000`): segments as `--workers` load processes write them at
`--rate` records/s in total (one Arrow IPC segment per process per second, each record finishing in
that second, in the order they finished; a steady load of one step: TTFT = 0.2 s + 0.3 ms x input
tokens, TPOT 20 ms, lognormal noise, 0.5% overloaded errors, one stream in a thousand 20-60 s long,
and the streams still open at the end cut there), with the run's control, scenario and state files.
Then, each in a fresh process so its peak RSS is its own:

- finalise: `rundirs.finalise` (the merge into requests.parquet and manifest.json);
- analyse: `analysis.pipeline.analyze_run` (summary.json, plots, report.html).

Both run with this tree's code and, on the same segments and the same requests.parquet, with the
code of `--baseline` (a git revision, default the one before issue 37; taken from `git archive`),
but only up to `--baseline-max` records: the baseline holds every record in memory (about 1.8 KB
each to finalise), and a larger run would take the shared machine down. The segments are written
lz4-compressed (`--segments uncompressed` writes them as the load processes do: 670 B per record on
disk, 24 GB for 36M). Everything is deleted after each size unless `--keep`.

The soak of issue 37 (30 minutes against the simulator, the master's RSS every 10 s) is not here yet.

    nice python benchmarks/long_runs.py --records 1000000              # a few minutes
    nice python benchmarks/long_runs.py --records 10000000,36000000    # about an hour on 2 busy cores
    nice python benchmarks/long_runs.py --records 36000000 --finalise-only --keep --dir /tmp/lr   # then:
    nice python benchmarks/long_runs.py --analyse /tmp/lr/long-runs-XXXX/run-36000000            # each stage once
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import feather

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "c77cf47"  # main before issue 37
START = 1_780_000_000.0

# Run in a child: the code under test (this tree's, or the baseline's source at argv[1]), one stage, its own peak.
CHILD = r"""
import json, resource, sys, time
source, stage, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
if source != "-":  # the baseline's tree first, before the installed package's finder
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, source)
from pathlib import Path
import tokenload
started, cpu = time.perf_counter(), time.process_time()
if stage == "finalise":
    from tokenload.load.rundirs import finalise
    finalise(Path(run_dir))
else:
    from tokenload.analysis.pipeline import analyze_run
    analyze_run(run_dir)
print(json.dumps({"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "code": tokenload.__file__}))
"""


def _worker_names(workers: int) -> list[str]:
    return [f"loadhost-{4000 + w}_{w:02d}{'ab' * 12}" for w in range(workers)]


def _second(rng: np.random.Generator, s: int, rate: int, workers: int, counters: np.ndarray,
            schema: pa.Schema, last: bool) -> list[tuple[int, pa.Table]]:
    """The records that finished in second `s` of the run, per worker, in the order they finished."""
    n = rate
    worker = rng.integers(0, workers, n)
    finished = START + s + np.sort(rng.uniform(0, 1, n))
    n_in = rng.integers(64, 2049, n).astype(np.float64)
    n_out = rng.integers(16, 257, n)
    ttft = (0.2 + 0.0003 * n_in) * rng.lognormal(0, 0.1, n)
    tpot = 0.02 * rng.lognormal(0, 0.1, n)
    e2e = ttft + tpot * (n_out - 1)
    long = rng.uniform(0, 1, n) < 0.001
    e2e = np.where(long, rng.uniform(20, 60, n), e2e)
    started = finished - e2e
    error = rng.uniform(0, 1, n) < 0.005
    cut = np.zeros(n, dtype=bool)
    if last:  # the streams still open when the run stopped: cut at its end, each as far as it got
        cut = rng.uniform(0, 1, n) < 0.5
    ok = ~error & ~cut
    counter = np.zeros(n, dtype=np.int64)
    for w in range(workers):
        mine = worker == w
        counter[mine] = counters[w] + np.arange(int(mine.sum()))
        counters[w] += int(mine.sum())
    tags = pa.array([f"{w:02d}c0ffee" for w in range(workers)]).take(pa.array(worker))
    request_id = pc.binary_join_element_wise(tags, pc.utf8_lpad(pa.array(counter).cast(pa.string()), 9, "0"), "-")
    nan = np.full(n, np.nan)
    cut_at = START + s + 1.0
    columns: dict[str, Any] = {
        "request_id": request_id, "run_id": pa.array(["20260101-000000-c0ffee"] * n),
        "worker": pa.array(_worker_names(workers)).take(pa.array(worker)),
        "user_id": pc.binary_join_element_wise(tags, pa.array(rng.integers(0, 500, n)).cast(pa.string()), "-u"),
        "step": pa.array(np.ones(n, dtype=np.int32)), "active_users": pa.array(np.full(n, 10_000, dtype=np.int32)),
        "scheduled_at": started - 0.001, "started_at": started, "protocol": pa.array(["openai-chat"] * n),
        "model": pa.array(["sim-7b"] * n),
        "status": pa.array(np.where(error, "error", np.where(cut, "cancelled", "ok"))),
        "error_kind": pa.array(np.where(error, "overloaded", None)),
        "http_status": pa.array(np.where(error, 529, 200).astype(np.int32)),
        "ttfb_s": np.where(error, 0.05, ttft * 0.9), "ttft_s": np.where(ok | (cut & (ttft < 0.4)), ttft, nan),
        "ttft_text_s": np.where(ok, ttft, nan), "tpot_s": np.where(ok, tpot, nan), "e2e_s": np.where(ok, e2e, nan),
        "input_tokens": n_in.astype(np.int64), "input_tokens_source": pa.array(["server"] * n),
        "output_tokens": np.where(ok, n_out, 0), "output_tokens_source": pa.array(["server"] * n),
        "max_tokens": np.full(n, 256), "chunks": np.where(ok, n_out, 0),
        "itl_p50_s": np.where(ok, tpot, nan), "itl_p99_s": np.where(ok, tpot * 2, nan),
        "itl_max_s": np.where(ok, tpot * 3, nan), "stop_reason": pa.array(np.where(ok, "length", None)),
        "finished_at": np.where(cut, nan, finished), "prompt_tokens_target": n_in.astype(np.int64),
        "in_flight": cut, "cut_at": np.where(cut, cut_at, nan),
        "server_request_id": pc.binary_join_element_wise(
            "chatcmpl-", pa.array(rng.integers(0, 2**62, n)).cast(pa.string()), ""),
        "error_message": pa.array(np.where(error, "529 overloaded", None)),
        "duration_s": np.where(ok, e2e + 0.001, nan), "thinking_chunks": np.zeros(n, dtype=np.int64),
        "malformed_events": np.zeros(n, dtype=np.int64), "connect_s": np.zeros(n),
        "send_lag_s": rng.exponential(0.0002, n), "reconnects": np.zeros(n, dtype=np.int64),
        "first_read_tokens": np.ones(n, dtype=np.int64), "ttft_exact": np.ones(n, dtype=bool),
        "eos_only": np.zeros(n, dtype=bool), "truncated": np.zeros(n, dtype=bool), "held_s": np.zeros(n),
        "context_tokens": n_in.astype(np.int64), "phase": pa.array(["measure"] * n),
        "judged_at": np.where(ok | error, finished, nan),
    }
    table = pa.table([pa.array(columns[f.name], f.type, from_pandas=True) if f.name in columns
                      else pa.nulls(n, f.type) for f in schema], schema=schema)
    order = np.lexsort((finished, worker))
    table = table.take(pa.array(order))
    bounds = np.searchsorted(worker[order], np.arange(workers + 1))
    return [(w, table.slice(bounds[w], bounds[w + 1] - bounds[w])) for w in range(workers)]


def synthesize(run_dir: Path, records: int, workers: int, rate: int, compression: str, seed: int = 0) -> None:
    """A finished run's segments directory, as `--workers` processes at `--rate` records/s would have left it."""
    from tokenload.load import records as segments

    seg = run_dir / segments.SEGMENTS_DIR
    seg.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    seconds = -(-records // rate)
    counters = np.zeros(workers, dtype=np.int64)
    names = _worker_names(workers)
    for s in range(seconds):
        for w, table in _second(rng, s, min(rate, records - s * rate), workers, counters, segments.SCHEMA,
                                last=s == seconds - 1):
            if table.num_rows:
                feather.write_feather(table, seg / segments.segment_name(names[w], s), compression=compression)
    ended = START + seconds
    steps = [{"step": 1, "start_s": 0.0, "end_s": float(seconds + 60), "users": 10_000, "rate": None,
              "started_at": START - 60}]
    segments.write_json(seg / "control.json", {"plan": steps, "steps": steps, "stop_reason": "plan completed",
                                               "workers": names})
    segments.write_json(seg / "run.json", {"run_id": "20260101-000000-c0ffee", "started_at": START - 60,
                                           "channel": {"protocol": "openai-chat", "base_url": "http://sim",
                                                       "model": "sim-7b"}})
    segments.write_json(seg / "scenario.json", {"name": "soak", "load": {"kind": "constant", "users": 10_000}})
    for w, name in enumerate(names):
        segments.write_json(seg / f"{name}.state.json", {"worker": name, "records": int(counters[w]),
                                                         "segments": seconds, "done": True, "updated_at": ended})


def _baseline(revision: str, into: Path) -> Path:
    """The baseline's package as it would be installed (analysis/ as tokenload/analysis), from `git archive`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "tokenload", "analysis"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    shutil.move(str(into / "analysis"), str(into / "tokenload" / "analysis"))
    return into


def _stage(source: Path | None, stage: str, run_dir: Path) -> dict[str, Any]:
    proc = subprocess.run(["nice", sys.executable, "-c", CHILD, str(source or "-"), stage, str(run_dir)],
                          capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"failed": last[:160]}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _cell(result: dict[str, Any]) -> str:
    if "failed" in result:
        return f"failed: {result['failed']}"
    if "skipped" in result:
        return result["skipped"]
    return f"{result['wall_s']:.0f} s, {result['peak_mb']:,.0f} MB"


def synthetic(sizes: list[int], args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    baseline = _baseline(args.baseline, Path(tempfile.mkdtemp(prefix="baseline-", dir=tmp)))
    rows = []
    for records in sizes:
        run_dir = tmp / f"run-{records}"
        started = time.perf_counter()
        synthesize(run_dir, records, args.workers, args.rate, args.segments)
        made = time.perf_counter() - started
        disk = sum(p.stat().st_size for p in (run_dir / "segments").iterdir()) / 1e9
        row: dict[str, Any] = {"records": records, "synthesize_s": made, "segments_gb": disk,
                               "load": os.getloadavg()[0]}
        old = None
        if records <= args.baseline_max:
            copy = tmp / f"baseline-{records}"
            shutil.copytree(run_dir, copy)
            row["finalise_baseline"] = _stage(baseline, "finalise", copy)
            old = copy
        else:
            row["finalise_baseline"] = {"skipped": f"not run (about {1.8 * records / 1e6:.0f} GB)"}
        row["finalise"] = _stage(None, "finalise", run_dir)
        row["parquet_gb"] = (run_dir / "requests.parquet").stat().st_size / 1e9
        skipped = {"skipped": "not run (--finalise-only)"}
        if old is not None:
            row["same_records"] = _same(old, run_dir)
            row["analyse_baseline"] = skipped if args.finalise_only else _stage(baseline, "analyse", old)
            shutil.rmtree(old)
        else:
            row["analyse_baseline"] = {"skipped": "not run (it loads every record)"}
        row["analyse"] = skipped if args.finalise_only else _stage(None, "analyse", run_dir)
        row["load_after"] = os.getloadavg()[0]
        row["run_dir"] = str(run_dir) if args.keep else None
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
        if not args.keep:
            shutil.rmtree(run_dir)
    return rows


def _same(a: Path, b: Path) -> bool:
    return bool(pq.read_table(a / "requests.parquet").equals(pq.read_table(b / "requests.parquet")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", default="1000000", help="synthetic run sizes, comma-separated (0: none)")
    parser.add_argument("--workers", type=int, default=20)
    parser.add_argument("--rate", type=int, default=10_000, help="records/s of the synthetic run, all workers")
    parser.add_argument("--segments", choices=["lz4", "uncompressed"], default="lz4")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of today's code to run beside")
    parser.add_argument("--baseline-max", type=int, default=1_000_000,
                        help="largest run the baseline is given (it holds every record in memory)")
    parser.add_argument("--dir", default=None, help="where the runs are written (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the runs")
    parser.add_argument("--finalise-only", action="store_true", help="finalise, do not analyse")
    parser.add_argument("--analyse", default=None, metavar="RUN_DIR,...",
                        help="only analyse these finalised runs (kept by --keep --finalise-only) with this tree's code")
    args = parser.parse_args()
    if args.analyse:
        for run_dir in args.analyse.split(","):
            load = os.getloadavg()[0]
            result = _stage(None, "analyse", Path(run_dir))
            records = pq.ParquetFile(Path(run_dir) / "requests.parquet").metadata.num_rows
            print(f"| {records:,} | analyse: {_cell(result)}, {result.get('cpu_s', 0):.0f} s CPU | load average "
                  f"{load:.0f}-{os.getloadavg()[0]:.0f} |")
        return 0
    sizes = [int(x) for x in args.records.split(",") if int(x)]
    with contextlib.ExitStack() as stack:  # --keep: the runs stay where they were written, said on stderr
        name = tempfile.mkdtemp(prefix="long-runs-", dir=args.dir)
        if not args.keep:
            stack.callback(shutil.rmtree, name, ignore_errors=True)
        rows = synthetic(sizes, args, Path(name)) if sizes else []
    print(f"{args.workers} processes' segments at {args.rate:,} records/s ({args.segments}); {os.cpu_count()} CPUs")
    print("| records | segments on disk | finalise: this tree | finalise: baseline | analyse: this tree "
          "| analyse: baseline | load average |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['records']:,} | {r['segments_gb']:.1f} GB | {_cell(r['finalise'])} | "
              f"{_cell(r['finalise_baseline'])} | {_cell(r['analyse'])} | {_cell(r['analyse_baseline'])} | "
              f"{r['load']:.0f}-{r['load_after']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
