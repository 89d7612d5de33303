"""Compare runs side by side: off-peak vs peak, one channel vs another, model A vs B.

The first RUN_DIR is the baseline. Steps are paired by load level (users, or
offered requests/s): runs that spent different shares of their requests at
each load are never pooled. At every shared level, TTFT, TPOT and end-to-end
latency get p50/p95 deltas with 95% bootstrap intervals and a two-sided
Mann-Whitney U test, Holm-corrected over all levels and metrics; a difference
is called significant when the corrected p < 0.01 and the effect (P(a request
is slower than the baseline's) far enough from 0.5) is not negligible. The
headline counts the levels at which each run was slower or faster; runs that
share no level with the baseline say so.

--relay: the later runs went through a relay (a gateway, a proxy) in front of
the baseline's channel, and each gets what the relay adds per matched level.
The TTFT it adds rests on the best basis both runs have, and the output names
it: the server's own time subtracted (its metrics sampled in both runs: give
the relayed run --server-metrics with the server's address), else each run's
TTFT-vs-input line at one input length, else the raw difference where both
sent the same input length, else the raw difference said to be unmatched;
a raw difference blames the relay for whatever the server did differently
(longer prompts, a prompt-cache hit). Inter-token gaps, TTFB and how often
the headers came only with the first token are compared as measured. Runs
through different URLs are no relay comparison without --relay.

Writes into --out (default: compare-<time> next to the first run):

  comparison.json   runs, headline, per-level deltas with intervals and p-values, overhead
  comparison.html   self-contained: delta table, run table, charts, verdicts
  plots/*.png       overlaid CDFs, per-concurrency curves, each run's fit lines

Labels default to the runs' start times. Every run is judged by one SLO: the
baseline's (its scenario's [slo]), with the --slo-* flags applied.
Exit codes: 0 the comparison was written; 2 bad input.
"""

from __future__ import annotations

import argparse

from tokenload.commands.slo_flags import add_slo_arguments, slo_overrides

HELP = "compare runs (off-peak vs peak) level by level: deltas, intervals, significance, overlaid charts"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="two or more run directories; the first is the baseline")
    parser.add_argument("--labels", metavar="A,B,...", help="comma-separated label per run (default: start times)")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: compare-<time> next to the first run)")
    parser.add_argument("--quiet", action="store_true", help="no delta table, only the comparison path")
    parser.add_argument("--relay", action="store_true",
                        help="the runs after the first went through a relay in front of the first run's channel: "
                             "say what the relay adds (TTFT on a named basis, inter-token gaps, TTFB, held headers)")
    add_slo_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokenload.analysis.compare import compare_runs, comparison_table

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    console = Console(stderr=args.quiet)
    comparison = compare_runs(args.run_dirs, labels, args.out, slo_overrides=slo_overrides(args), console=console,
                              relay=args.relay)
    if not args.quiet:
        console.print(comparison_table(comparison))
    print(f"{comparison['out_dir']}/comparison.html")
    return 0
