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

One RUN_DIR of several models (`tokenload run levers --model A --model B`)
compares its models instead, each one's requests as a run of its own (--models
picks them, the first the baseline). Runs of other models get a headline about
the models, at matched load level, prompt and output length: "sim-30b vs
sim-7b: TTFT x2.50 [2.41, 2.58], TPOT x2.54 [2.50, 2.58], ...".

Labels default to the runs' start times (the model names for one run's models).
Every run is judged by one SLO: the baseline's (its scenario's [slo]), with the
--slo-* flags applied.

Thresholds (docs/ci.md) gate every other run against the baseline:
'ttft.p95 <= +10%' at every matched load level from the bootstrap interval of
the delta, 'capacity >= baseline - 1' against the baseline's own number, and
absolute ones ('ttft.p95 < 1.2') on each run alone. The baseline may also be a
run's summary.json kept as a file: the thresholds are then judged from its
steps (their percentiles and intervals), and no comparison is written.
Exit codes: 0 the comparison was written and no threshold was breached; 99 a
threshold was breached; 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from tokenload.commands import threshold_flags
from tokenload.commands.slo_flags import add_slo_arguments, slo_overrides

if TYPE_CHECKING:
    from rich.console import Console

    from tokenload.thresholds import Threshold

HELP = "compare runs (off-peak vs peak) level by level: deltas, intervals, significance, overlaid charts"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", metavar="RUN_DIR", nargs="+",
                        help="two or more run directories, the first the baseline (with --threshold it may be "
                             "a summary.json kept as a file); or one run of several models")
    parser.add_argument("--models", metavar="A,B,...",
                        help="with one RUN_DIR: compare these of its models (default: all), the first the baseline")
    parser.add_argument("--labels", metavar="A,B,...", help="comma-separated label per run (default: start times)")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: compare-<time> next to the first run)")
    parser.add_argument("--quiet", action="store_true",
                        help="no delta table: the comparison path (and the thresholds' table, when any)")
    parser.add_argument("--relay", action="store_true",
                        help="the runs after the first went through a relay in front of the first run's channel: "
                             "say what the relay adds (TTFT on a named basis, inter-token gaps, TTFB, held headers)")
    add_slo_arguments(parser)
    threshold_flags.add_threshold_arguments(parser, baseline=True)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokenload.analysis.compare import compare_runs, comparison_table
    from tokenload.analysis.thresholds import check_relative

    thresholds = threshold_flags.from_args(args, baseline=True)
    check_relative(thresholds)
    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    console = Console(stderr=args.quiet)
    if Path(args.run_dirs[0]).is_file():
        return _against_summary(args, thresholds, labels, console)
    models = [x.strip() for x in args.models.split(",")] if args.models else None
    comparison = compare_runs(args.run_dirs, labels, args.out, slo_overrides=slo_overrides(args), console=console,
                              relay=args.relay, thresholds=thresholds, models=models)
    if not args.quiet:
        for line in comparison.get("models") or []:
            console.print(line["headline"], markup=False, soft_wrap=True)
        console.print(comparison_table(comparison))
    gate = threshold_flags.report(comparison["thresholds"], args,
                                  title=f"against {comparison['baseline']}")
    print(f"{comparison['out_dir']}/comparison.html")
    return gate


def _against_summary(args: argparse.Namespace, thresholds: list[Threshold], labels: list[str] | None,
                     console: Console) -> int:
    """A kept summary.json as the baseline: each run's thresholds judged against it, from its steps."""
    import json

    from tokenload.analysis.pipeline import analyze
    from tokenload.analysis.thresholds import judge_against
    from tokenload.errors import ConfigError
    from tokenload.slo import Slo

    path = Path(args.run_dirs[0])
    try:
        baseline = json.loads(path.read_text(encoding="utf-8"))
        slo = Slo.from_dict({k: baseline["slo"][k] for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "target",
                                                               "max_error_rate")})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a summary.json that `tokenload analyze` wrote ({exc}); give the "
                          "baseline's run directory or its summary.json") from None
    if not thresholds:
        raise ConfigError(f"{path} is a summary.json: without its records only thresholds can be judged against "
                          "it; give --threshold, or the baseline's run directory to compare")
    if len(args.run_dirs) < 2:
        raise ConfigError("compare needs a run directory to judge against the baseline")
    names = labels or [Path(d).name for d in args.run_dirs]
    if len(names) != len(args.run_dirs):
        raise ConfigError(f"--labels has {len(names)} label(s) for {len(args.run_dirs)} run(s): give one per run")
    results = []
    for name, run_dir in zip(names[1:], args.run_dirs[1:]):
        candidate = analyze(run_dir, dataclasses.replace(slo, **slo_overrides(args)), console=console, write=False)
        results += judge_against(baseline, candidate, thresholds, None, name)
    console.print(f"baseline {path}: a summary.json, no records: the thresholds are judged from its steps' "
                  "percentiles and intervals (a level-by-level comparison needs its run directory)",
                  markup=False, soft_wrap=True)
    return threshold_flags.report(results, args, title=f"against {names[0]}")
