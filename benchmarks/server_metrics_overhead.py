"""Does sampling the server's /metrics cost the load path anything? Tokens per Locust CPU-second, with and without.

Each cell is a real `tokenload run` (`runner.execute`, called in this process so
this process is the supervisor) of a constant load against the simulator (in
its own process), alternating a run that scrapes the simulator's `/metrics`
every `--interval` seconds with one that does not (`[server] discover = false`).
Locust's CPU is `RUSAGE_CHILDREN` of this process over the run: only the Locust
processes are reaped inside that window (forked workers count through their
master). The scraper's own CPU is this process's `RUSAGE_SELF` over the run
minus the same for a run without it: it lands in the supervisor, never in Locust.

    python benchmarks/server_metrics_overhead.py          # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from tokenload.channel import Channel
from tokenload.load.runner import execute, plan_run
from tokenload.rundir import REQUESTS_FILE
from tokenload.sim.runner import launch
from tokenload.workload.scenario import Scenario, ServerSection

SCENARIO = {"name": "overhead", "load": {"kind": "constant", "users": 32, "step_s": 10},
            "prompt": {"tokens": 64}, "output": {"max_tokens": 200, "ignore_eos": True}, "stop": {"drain_s": 5}}


def cell(base_url: str, out: Path, scrape: bool, interval_s: float) -> tuple[float, float, float]:
    """(output tokens per Locust CPU-second, Locust CPU s, supervisor CPU s) of one run."""
    scenario = Scenario.from_dict(SCENARIO, "benchmark", Path("."), "overhead")
    scenario = dataclasses.replace(scenario, server=ServerSection(interval_s=interval_s, discover=scrape))
    channel = Channel(base_url=base_url, protocol="anthropic", model="sim-7b")
    plan = plan_run(scenario, channel, out)
    children, own = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    run_dir = execute(plan)
    children2, own2 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    locust_cpu = children2.ru_utime + children2.ru_stime - children.ru_utime - children.ru_stime
    supervisor_cpu = own2.ru_utime + own2.ru_stime - own.ru_utime - own.ru_stime
    tokens = pq.read_table(run_dir / REQUESTS_FILE, columns=["output_tokens"]).column("output_tokens").to_pylist()
    assert (run_dir / "server_metrics.parquet").exists() == scrape
    return sum(t or 0 for t in tokens) / locust_cpu, locust_cpu, supervisor_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="with/without pairs (default 3)")
    parser.add_argument("--interval", type=float, default=1.0, help="scrape interval in seconds (default 1)")
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    with launch(["--profile", "fast"]) as sim, tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for scrape in ((True, False) if i % 2 == 0 else (False, True)):
                results[scrape].append(cell(sim.base_url, Path(tmp) / f"{i}-{scrape}", scrape, args.interval))
                tok, cpu, sup = results[scrape][-1]
                print(f"pair {i + 1} {'scrape   ' if scrape else 'no scrape'}: {tok:,.0f} tokens per Locust "
                      f"CPU-second (Locust {cpu:.2f} s, supervisor {sup:.2f} s)", flush=True)
    for scrape in (False, True):
        toks = [r[0] for r in results[scrape]]
        print(f"{'with' if scrape else 'without'} scraping: median {statistics.median(toks):,.0f} tokens per Locust "
              f"CPU-second (min {min(toks):,.0f}, max {max(toks):,.0f}); supervisor CPU median "
              f"{statistics.median(r[2] for r in results[scrape]):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
