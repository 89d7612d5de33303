"""The threshold flags of run, analyze and compare, and what a gated command shows and writes for CI.

`--threshold EXPR` (repeatable; `tokenload.thresholds` says what an expression may name), `--inconclusive
fail|pass`, `--junit FILE`. After judging: the ✓/✗ table on stdout, a JUnit XML file (one test case per
threshold, the number, its interval and the bound in the message), a Markdown summary appended to
`$GITHUB_STEP_SUMMARY` when that variable is set, and the exit code: 0 every threshold passed, 99 one was
breached.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenload.errors import ConfigError

if TYPE_CHECKING:
    from tokenload.contracts.summary import Summary, ThresholdResult
    from tokenload.thresholds import Threshold
    from tokenload.workload.scenario import Scenario

MARK = {"pass": "✓", "fail": "✗", "inconclusive": "?"}
STEP_SUMMARY = "GITHUB_STEP_SUMMARY"
WIDTH = 140  # the table's width in a CI log (not a terminal)


def add_threshold_arguments(parser: argparse.ArgumentParser, *, baseline: bool = False) -> None:
    """Add `--threshold`, `--inconclusive` and `--junit` (one group, the same help on every command)."""
    group = parser.add_argument_group("thresholds (CI gates; exit code 99 when one is breached)")
    against = ("; against the baseline (the first run): 'ttft.p95 <= +10%%' at every matched load level, "
               "'capacity >= baseline - 1'" if baseline else "")
    group.add_argument("--threshold", action="append", default=[], metavar="EXPR",
                       help="repeatable: NAME OP BOUND over summary.json's numbers, e.g. 'ttft.p95 < 1.2', "
                            "'error_rate < 0.01', 'slo_attainment >= 0.9', 'steps[users=8].tpot.p50 <= 0.05', "
                            "'models[\"sim-7b\"].e2e.p99 < 8', 'capacity >= 8' (docs/ci.md lists the names); "
                            "a percentile is breached only when its 95%% interval lies beyond the bound" + against)
    group.add_argument("--inconclusive", choices=("pass", "fail"), default=None,
                       help="a threshold whose interval straddles its bound: pass (the default, it is not "
                            "breached) or fail (exit 99 too)")
    group.add_argument("--junit", metavar="FILE", type=Path,
                       help="write the thresholds as JUnit XML: one test case per threshold")


def from_args(args: argparse.Namespace, *, baseline: bool = False) -> list[Threshold]:
    """The `--threshold` flags, parsed (a bad one is exit 2, before anything runs)."""
    from tokenload.thresholds import parse

    return [parse(expr, baseline=baseline) for expr in args.threshold]


def check_plan(scenario: Scenario) -> None:
    """What a run's thresholds name must be in its plan: a step level it runs, a model its channel serves, a
    capacity only of a search (exit 2 before any request)."""
    from tokenload.load.plan import build_plan
    from tokenload.thresholds import parse, resolve

    plan = build_plan(scenario)
    levels = {("users", float(p.users)) for p in plan if p.rate is None} | {
        ("rate", float(p.rate)) for p in plan if p.rate is not None} | {("step", float(p.step)) for p in plan}
    for check in scenario.thresholds.checks:
        t = resolve(parse(check.expr, abort_on_fail=check.abort_on_fail))
        if t.scope == "steps" and isinstance(t.selector, tuple) and plan and t.selector not in levels:
            runs = ", ".join(f"{p.users} users" if p.rate is None else f"{p.rate:g} req/s" for p in plan)
            raise ConfigError(f"threshold {t.expr!r}: scenario {scenario.name} runs no step {t.where}; its steps: "
                              f"{runs}")
        if t.scope == "model" and scenario.channel.models and t.selector not in scenario.channel.models:
            raise ConfigError(f"threshold {t.expr!r}: scenario {scenario.name} sends to no model {t.selector!r}; "
                              f"its models: {', '.join(scenario.channel.models)}")
        if t.name == "capacity" and scenario.load.search is None:
            raise ConfigError(f"threshold {t.expr!r}: capacity is a searched run's; scenario {scenario.name} has "
                              f"[load] kind = {scenario.load.kind!r}, not \"search\"")


def title(summary: Summary) -> str:
    """'ci 2026-12-06 05:40': the run's scenario and start."""
    return " ".join(x for x in (summary["run"]["scenario"], summary["run"]["label"]) if x)


def value_text(value: float | None, relative: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:+.3g}%" if relative else f"{value:.3g}"


def interval_text(ci: Sequence[float | None] | None, relative: bool = False) -> str:
    if not ci:
        return "-"
    lo, hi = ci
    return (f"[{value_text(lo, relative) if lo is not None else '-∞'}, "
            f"{value_text(hi, relative) if hi is not None else '∞'}]")


def where_text(r: ThresholdResult) -> str:
    """Where, and the note when there is one: 'at 4 users; relative to the baseline's 0.81 s'."""
    return r["where"] + (f"; {r['note']}" if r["note"] else "")


def message(r: ThresholdResult) -> str:
    """'ttft.p95 < 0.05: 0.213 [0.205, 0.221] (the whole run): fail' (the bound is in the expression)."""
    rel = r["relative"]
    return f"{r['expr']}: {value_text(r['value'], rel)} {interval_text(r['ci'], rel)} ({where_text(r)}): {r['result']}"


def table(results: Sequence[ThresholdResult], title: str) -> Any:
    """The ✓/✗ table (rich)."""
    from rich.table import Table
    from rich.text import Text

    out = Table(title=Text(title), title_justify="left")
    for head in ("", "threshold", "value", "95% interval", "result", "where"):
        out.add_column(head, overflow="fold", no_wrap=head != "where", justify="right" if head == "value" else "left")
    for r in results:
        style = {"pass": "green", "fail": "red", "inconclusive": "yellow"}[r["result"]]
        rel = r["relative"]
        out.add_row(*(Text(cell) for cell in (MARK[r["result"]], r["expr"], value_text(r["value"], rel),
                                              interval_text(r["ci"], rel), r["result"], where_text(r))), style=style)
    return out


def junit(results: Sequence[ThresholdResult], path: Path, suite: str, inconclusive: str) -> Path:
    """JUnit XML: a test suite of one test case per threshold; a breach is a failure, an inconclusive one a
    failure with `--inconclusive fail`, else skipped."""
    import xml.etree.ElementTree as ET

    failing = [r for r in results if r["result"] == "fail" or (r["result"] == "inconclusive" and inconclusive == "fail")]
    skipped = [r for r in results if r["result"] == "inconclusive" and r not in failing]
    counts = {"tests": str(len(results)), "failures": str(len(failing)), "errors": "0", "skipped": str(len(skipped))}
    root = ET.Element("testsuites", {"name": "tokenload", **counts})
    node = ET.SubElement(root, "testsuite", {"name": suite, **counts, "time": "0"})
    for r in results:
        case = ET.SubElement(node, "testcase", {"classname": "tokenload.thresholds", "name": r["expr"], "time": "0"})
        if r in failing:
            ET.SubElement(case, "failure", {"message": message(r), "type": r["result"]}).text = message(r)
        elif r in skipped:
            ET.SubElement(case, "skipped", {"message": message(r)})
        else:
            ET.SubElement(case, "system-out").text = message(r)
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path


def markdown(results: Sequence[ThresholdResult], title: str, verdict: Sequence[tuple[str, str]] = (),
             plots: Sequence[str] = ()) -> str:
    """The step summary: thresholds ✓/✗, the verdict table, the plots' paths."""
    breached = sum(r["result"] == "fail" for r in results)
    lines = [f"### tokenload: {title}: {'✗ ' + str(breached) + ' of ' if breached else '✓ '}"
             f"{len(results)} threshold(s) {'breached' if breached else 'passed'}", "",
             "| | threshold | value | 95% interval | result | where |", "|---|---|---|---|---|---|"]
    lines += [f"| {MARK[r['result']]} | `{r['expr']}` | {value_text(r['value'], r['relative'])} | "
              f"{interval_text(r['ci'], r['relative'])} | {r['result']} | {where_text(r)} |" for r in results]
    if verdict:
        lines += ["", "<details><summary>Verdict</summary>", "", "| | finding |", "|---|---|"]
        lines += [f"| {topic} | {finding.replace('|', '/')} |" for topic, finding in verdict]
        lines += ["", "</details>"]
    if plots:
        lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in plots)]
    return "\n".join(lines) + "\n\n"


def report(results: Sequence[ThresholdResult], args: argparse.Namespace, *, title: str,
           inconclusive: str = "pass", verdict: Sequence[tuple[str, str]] = (), plots: Sequence[str] = ()) -> int:
    """Show the judged thresholds, write what CI reads, and return the exit code (0 or 99; 0 with none)."""
    from rich.console import Console

    from tokenload.thresholds import exit_code

    if not results:
        return 0
    inconclusive = args.inconclusive or inconclusive
    Console(width=None if sys.stdout.isatty() else WIDTH).print(table(results, f"thresholds: {title}"))
    if args.junit is not None:
        junit(results, args.junit, title, inconclusive)
    summary_file = os.environ.get(STEP_SUMMARY)
    if summary_file:
        with open(summary_file, "a", encoding="utf-8") as out:
            out.write(markdown(results, title, verdict, plots))
    return exit_code([r["result"] for r in results], inconclusive)


def verdict_pairs(summary: Summary) -> list[tuple[str, str]]:
    """The verdict table's (topic, finding) rows, for the step summary."""
    from tokenload.analysis.report import verdict_rows

    return [(topic, finding) for topic, finding, _ in verdict_rows(summary)]
