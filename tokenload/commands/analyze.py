"""Analyse a run directory: fits, the formula under load, the breakpoint, a diagnosis.

Reads RUN_DIR/requests.parquet (one row per request, written by `tokenload run`)
and writes into RUN_DIR:

  summary.json   the numbers scripts read (SPEC.md keys plus extras)
  plots/*.png    TTFT vs input, e2e vs output, latency and throughput vs
                 concurrency, TTFT/TPOT/e2e CDFs, run timeline
  report.html    self-contained report: verdict, charts, tables

Every percentile comes from the raw per-request records. Fits use successful
requests of the low-load steps only (steps whose median TTFT and TPOT are
within 1.25x of the lowest-load step's, or those up to --low-load-users), so
queueing does not masquerade as prefill or decode cost.

Exit codes: 0 the report was written (even when it finds the channel broke:
read the verdict or summary.json's `breakpoint` and `diagnosis`); 2 bad input
(not a run directory, missing columns, an empty run: the report, when one could
be written, says what is missing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "analyse a run: summary.json, plots and report.html, verdict table"


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `tokenload run`")
    parser.add_argument("--slo-ttft", type=_positive, default=1.0, metavar="S", help="TTFT objective in seconds (default 1)")
    parser.add_argument("--slo-e2e", type=_positive, default=3.0, metavar="S",
                        help="end-to-end latency objective in seconds (default 3)")
    parser.add_argument("--slo-target", type=_positive, default=0.90, metavar="FRACTION",
                        help="share of requests that must meet the SLO at a step (default 0.90)")
    parser.add_argument("--low-load-users", type=int, default=None, metavar="N",
                        help="fit TTFT/e2e on steps with at most N users (default: chosen from the data)")
    parser.add_argument("--quiet", action="store_true", help="no verdict table, only the report path")
    parser.add_argument("--csv", action="store_true",
                        help="also export every record, all columns, to RUN_DIR/requests.csv (for spreadsheets)")


def export_csv(run_dir: Path) -> Path:
    """requests.parquet as CSV, every column (`tokenload.record.RequestRecord`; the analysis reads only the parquet)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from tokenload.rundir import REQUESTS_FILE

    path = run_dir / "requests.csv"
    pacsv.write_csv(pq.read_table(run_dir / REQUESTS_FILE), path)
    return path


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokenload.analysis.pipeline import analyze_run, print_verdict
    from tokenload.errors import ConfigError

    if args.slo_target > 1:
        raise ConfigError("--slo-target is a fraction between 0 and 1")
    console = Console(stderr=args.quiet)
    summary = analyze_run(args.run_dir, args.slo_ttft, args.slo_e2e, slo_target=args.slo_target,
                          low_load_users=args.low_load_users, console=console)
    if not args.quiet:
        print_verdict(summary, console)
    print(f"{summary['run']['run_dir']}/report.html")
    if args.csv:
        print(export_csv(Path(args.run_dir)))
    if summary["run"]["requests"] == 0:
        print("tokenload: error: the run recorded no requests; report.html says what is missing", file=sys.stderr)
        return 2
    return 0
