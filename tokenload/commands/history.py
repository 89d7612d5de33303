"""Hour-of-day and weekday views of a channel's history, its peak and off-peak windows.

`tokenload history` reads the history database that `tokenload watch` fills
and writes history.html, PNG charts and (with --csv) history.csv into --out,
then prints the verdict: when the channel is fast, when it is slow, by how much.

Hours are those of the local time zone (named on every chart). An hour is
peak (off-peak) when the 95% bootstrap interval of its median TTFT over that of
all other hours lies wholly above (below) 1 and the shift is at least 20%; the
windows are the contiguous runs of such hours, told apart at the probes' load
(1 user). With fewer than 12 hours holding 5 successful probes each, the
verdict says the data are too few. The windows are compared like `compare`
compares runs (Mann-Whitney test, effect size), matched by load level, with
the formula error and the TTFT-vs-input fit of each window.
`tokenload history add RUN_DIR...` ingests `tokenload run` directories, so
stress runs at different hours land beside the watch samples (a run already
ingested adds nothing). Searched stress runs (`watch --stress search@03:00,14:00`,
or any `[load] kind = "search"` run added) also put their capacity beside the
latency: the verdict names the capacity found in each window with its boundary
interval ("off-peak (01-06): 24 users (boundary in [24, 25])"), and by hour of day.

The database defaults to $XDG_DATA_HOME/tokenload/history.db, else
~/.local/share/tokenload/history.db.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HELP = "hour-of-day views of the history database, peak and off-peak windows; `history add RUN_DIR` ingests runs"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="*", metavar="add RUN_DIR",
                        help="`add RUN_DIR...`: ingest run directories instead of reporting")
    parser.add_argument("--db", metavar="FILE", help="history database (default: see above)")
    parser.add_argument("--since", default="7d", metavar="DUR", help="look back this far, e.g. 36h, 7d, 4w (default 7d)")
    parser.add_argument("--channel", action="append", metavar="TEXT",
                        help="channels whose fingerprint (protocol host model) contains TEXT; repeat for several "
                             "(default: every channel in the database, one section each)")
    parser.add_argument("--period", default="24h", metavar="DUR",
                        help="length of a day: 24h, or the simulator's compressed day (watch's --period)")
    parser.add_argument("--out", metavar="DIR", help="where history.html and the charts go (default results/history-<time>)")
    parser.add_argument("--csv", action="store_true", help="also write history.csv (every row, with its hour) and hours.csv")


def run(args: argparse.Namespace) -> int:
    from contextlib import closing

    from tokenload.dayclock import parse_duration
    from tokenload.errors import ConfigError
    from tokenload.history.store import default_db_path, ingest_run, open_store

    if args.action and (args.action[0] != "add" or len(args.action) < 2):
        raise ConfigError(f"unexpected {' '.join(args.action)!r}; write `tokenload history add RUN_DIR...` "
                          "or `tokenload history` with options only")
    try:
        since, period = parse_duration(args.since, "--since"), parse_duration(args.period, "--period")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.action:
        with closing(open_store(args.db)) as store:
            for run_dir in args.action[1:]:
                channel, added, total = ingest_run(store, run_dir)
                print(f"{run_dir}: {added} of {total} requests added for {channel} -> {store.path}")
        return 0
    if not Path(args.db or default_db_path()).is_file():
        raise ConfigError(f"no history database at {args.db or default_db_path()}; run `tokenload watch` first "
                          "or give --db")
    with closing(open_store(args.db)) as store:
        known = [name for name, _n in store.channels()]
        chosen = [c for c in known if not args.channel or any(text in c for text in args.channel)]
        if not chosen:
            raise ConfigError(f"no channel matches {', '.join(args.channel or [])}; the database holds: "
                              f"{', '.join(known) or 'nothing yet'}")
        frames = {c: store.query(since=time.time() - since, channels=[c]) for c in chosen}
        capacities = {c: store.capacities(c, since=time.time() - since) for c in chosen}
    return report(frames, period, Path(args.out) if args.out else None, args.csv, capacities)


def report(frames: dict[str, Any], period: float, out: Path | None, csv: bool,
           capacities: dict[str, Any] | None = None) -> int:
    """Analyse each channel's rows (and the capacities its searched stress runs found), write the report,
    print the verdict; shared with `demo --history`."""
    from tokenload.history.report import verdict_lines, write_report
    from tokenload.history.views import analyze_history

    reports = [(c, analyze_history(f, period, capacities=(capacities or {}).get(c, ())), f)
               for c, f in frames.items() if len(f)]
    if not reports:
        print("no requests in the chosen time span: widen --since or keep watching", file=sys.stderr)
        return 1
    out_dir = out or Path("results") / f"history-{time.strftime('%Y%m%d-%H%M%S')}"
    path = write_report(reports, out_dir, csv)
    for channel, result, _frame in reports:
        print("\n".join(verdict_lines(channel, result)))
    print(path)
    return 0
