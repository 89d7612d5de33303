"""Benchmark: analyse a 1M-request synthetic run with the full report.

Target on the 2-core dev machine: <= 20 s and <= 2 GB peak RSS for the
analysis (load + statistics + fits + plots + report). Generation and analysis
each run in a fresh interpreter (spawn) so each peak RSS is its own.

    python benchmarks/analysis_scale.py [--rows 1000000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 20.0
TARGET_RSS_MB = 2048.0


def _peak_rss_mb() -> float:
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 1024 / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _generate(run_dir: str, rows: int, out: mp.Queue) -> None:
    from tokenload.analysis.synthetic import Law, write_synthetic_run

    t = time.perf_counter()
    write_synthetic_run(run_dir, Law(error_rates={64: 0.1}), n=rows, seed=0)
    out.put({"generate + write parquet": (time.perf_counter() - t, _peak_rss_mb())})


def _analyze(run_dir: str, out: mp.Queue) -> None:
    import json

    from tokenload.analysis.pipeline import write_report
    from tokenload.analysis.records import load_run
    from tokenload.analysis.summary import summarize

    timings = {}
    t0 = t = time.perf_counter()
    run = load_run(run_dir)
    timings["load + validate"] = time.perf_counter() - t
    t = time.perf_counter()
    analysis = summarize(run)
    timings["steps, fits, breakpoint, diagnosis"] = time.perf_counter() - t
    t = time.perf_counter()
    (Path(run_dir) / "summary.json").write_text(json.dumps(analysis.summary, default=str))
    write_report(analysis, Path(run_dir))
    timings["plots + report.html"] = time.perf_counter() - t
    total = time.perf_counter() - t0
    out.put({**{k: (v, None) for k, v in timings.items()}, "analyze total": (total, _peak_rss_mb()),
             "_rows": (len(run.df), None)})


def _in_fresh_process(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keep", metavar="DIR", help="write the run here and keep it (default: a temp dir)")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.keep or str(Path(tmp) / "run")
        gen = _in_fresh_process(_generate, run_dir, args.rows)
        ana = _in_fresh_process(_analyze, run_dir)
    rows = int(ana.pop("_rows")[0])
    table = Table(title=f"analysis scale benchmark: {rows:,} requests", title_justify="left")
    for col in ("stage", "seconds", "peak RSS MB"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage, (secs, rss) in {**gen, **ana}.items():
        table.add_row(stage, f"{secs:.2f}", "" if rss is None else f"{rss:.0f}")
    total, rss = ana["analyze total"]
    ok = total <= TARGET_S and rss <= TARGET_RSS_MB
    table.caption = (f"target: analyze <= {TARGET_S:g} s and <= {TARGET_RSS_MB:g} MB: "
                     + ("met" if ok else "MISSED"))
    Console().print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
