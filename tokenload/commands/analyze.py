"""Analyse a run directory: fits, the formula under load, the breakpoint, a diagnosis.

Reads RUN_DIR/requests.parquet (one row per request, written by `tokenload run`)
and writes into RUN_DIR:

  summary.json   the numbers scripts read (the published keys plus extras; see the README)
  plots/*.png    TTFT vs input, e2e vs output, latency and throughput vs
                 concurrency, TTFT/TPOT/e2e CDFs, run timeline
  report.html    self-contained report: verdict, charts, tables

Every percentile comes from the raw per-request records; a request still open
when the run stopped counts as censored (its latency is at least what it
waited), and a percentile it reaches is reported as a lower bound. Steps are
load levels: users for a closed loop, offered requests/s for an open loop.
Throughput counts tokens in the window they were streamed. Fits use successful
requests of the low-load steps only (steps whose median TTFT and TPOT are
within 1.25x of the lowest-load step's, or those up to --low-load-users), so
queueing does not masquerade as prefill or decode cost.

The SLO is the run's own (its scenario's [slo] table, as manifest.json
recorded it); each --slo-* flag replaces one of its fields. Configuration and
input errors (auth, model, base URL, bad request, context_length) are not
judged: they count neither for nor against the SLO.

Thresholds (docs/ci.md): the run's own (its scenario's [thresholds], and the
`run --threshold` flags it ran with) and every --threshold given here are judged
into summary.json's `thresholds[]` and shown as a ✓/✗ table; --junit writes
them as JUnit XML, and with $GITHUB_STEP_SUMMARY set a Markdown summary is
appended to it.

Exit codes: 0 the report was written (even when it finds the channel broke:
read the verdict or summary.json's `breakpoint` and `diagnosis`) and no
threshold was breached; 99 a threshold was breached; 2 bad input (not a run
directory, missing columns, an empty run: the report, when one could be
written, says what is missing; a threshold naming no number, with the valid
names).

A run whose `tokenload run` was killed (even with SIGKILL) holds only its
flushed record segments: analyze finalises them first (requests.parquet and
manifest.json, stop reason `interrupted`) and says how many records it
recovered.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenload.commands import threshold_flags
from tokenload.commands.slo_flags import add_slo_arguments, slo_overrides

if TYPE_CHECKING:
    from rich.console import Console

HELP = "analyse a run: summary.json, plots and report.html, verdict table"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `tokenload run`")
    parser.add_argument("--low-load-users", type=int, default=None, metavar="N",
                        help="fit TTFT/e2e on steps with at most N users (default: chosen from the data)")
    parser.add_argument("--warmup", type=float, default=None, metavar="S",
                        help="leave requests started in each step's first S seconds out of its statistics "
                             "(default: the scenario's [load] step_warmup_s, else 0)")
    parser.add_argument("--percentiles", default=None, metavar="P,P,...",
                        help="latency percentiles per step and overall, e.g. 50,90,95,99,99.9 (default 50,95,99; "
                             "50 and 95 are always included)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="goodput criteria in milliseconds, any of ttft:X tpot:Y itl:Z e2e:W (as vLLM's "
                             "bench): a request is good when it meets all given; default: the SLO")
    parser.add_argument("--quiet", action="store_true",
                        help="no verdict table: the report path (and the thresholds' table, when any)")
    parser.add_argument("--csv", action="store_true",
                        help="also export every record, all columns, to RUN_DIR/requests.csv (for spreadsheets)")
    add_slo_arguments(parser)
    threshold_flags.add_threshold_arguments(parser)


def export_csv(run_dir: Path) -> Path:
    """requests.parquet as CSV, every column (`tokenload.record.RequestRecord`; the analysis reads only the parquet)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from tokenload.rundir import REQUESTS_FILE

    path = run_dir / "requests.csv"
    pacsv.write_csv(pq.read_table(run_dir / REQUESTS_FILE), path)
    return path


def _recover(run_dir: Path, console: Console) -> None:
    """Finalise a killed run's segments, so it can be analysed like any other (one line says so)."""
    from tokenload.load.rundirs import recover

    recovered = recover(run_dir) if run_dir.is_dir() else None
    if recovered is not None:
        console.print(f"recovered {recovered} records from the segments of a run that was not finalised "
                      "(its `tokenload run` was killed)", markup=False, soft_wrap=True)


def parse_percentiles(text: str | None) -> tuple[float, ...]:
    """'50,90,99.9' -> (50.0, 90.0, 95.0, 99.9): sorted, with the p50 and p95 the summary always has."""
    from tokenload.analysis.steps import PERCENTILES
    from tokenload.errors import ConfigError

    if text is None:
        return PERCENTILES
    try:
        values = {float(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise ConfigError(f"--percentiles {text!r}: expected numbers separated by commas, e.g. 50,90,99.9") from None
    if not values or any(not 0 < v < 100 for v in values):
        raise ConfigError(f"--percentiles {text!r}: each must be between 0 and 100 (exclusive), e.g. 50,90,99.9")
    return tuple(sorted(values | {50.0, 95.0}))


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'e2e:3000'] -> {'ttft': 0.5, 'e2e': 3.0} (milliseconds in, seconds out)."""
    from tokenload.analysis.steps import GOODPUT_COLUMNS
    from tokenload.errors import ConfigError

    out: dict[str, float] = {}
    for item in items or []:
        metric, _, value = item.partition(":")
        if metric not in GOODPUT_COLUMNS:
            raise ConfigError(f"--goodput {item!r}: the metric must be one of {', '.join(GOODPUT_COLUMNS)} "
                              "(e.g. ttft:500)")
        try:
            ms = float(value)
        except ValueError:
            raise ConfigError(f"--goodput {item!r}: expected METRIC:MILLISECONDS, e.g. ttft:500") from None
        if ms <= 0:
            raise ConfigError(f"--goodput {item!r}: the bound must be > 0 ms")
        out[metric] = ms / 1000.0
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokenload.analysis.pipeline import analyze, print_verdict, scenario_thresholds
    from tokenload.analysis.steps import StepOptions
    from tokenload.errors import ConfigError

    if args.warmup is not None and args.warmup < 0:
        raise ConfigError(f"--warmup must be 0 or more seconds, got {args.warmup:g}")
    options = StepOptions(percentiles=parse_percentiles(args.percentiles), warmup_s=args.warmup,
                          goodput=parse_goodput(args.goodput))
    thresholds = threshold_flags.from_args(args)
    console = Console(stderr=args.quiet)
    _recover(Path(args.run_dir), console)
    analysis = analyze(args.run_dir, slo_overrides=slo_overrides(args), low_load_users=args.low_load_users,
                       console=console, options=options, thresholds=thresholds)
    summary = analysis.summary
    if not args.quiet:
        print_verdict(summary, console)
    gate = threshold_flags.report(summary["thresholds"], args, title=threshold_flags.title(summary),
                                  inconclusive=scenario_thresholds(analysis.run.manifest)[1],
                                  verdict=threshold_flags.verdict_pairs(summary),
                                  plots=sorted(str(p) for p in Path(args.run_dir).glob("plots/*.png")))
    print(f"{summary['run']['run_dir']}/report.html")
    if args.csv:
        print(export_csv(Path(args.run_dir)))
    if summary["run"]["requests"] == 0:
        print("tokenload: error: the run recorded no requests; report.html says what is missing", file=sys.stderr)
        return 2
    return gate
