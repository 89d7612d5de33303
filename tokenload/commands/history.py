"""Hour-of-day and weekday views of a channel's history, its peak and off-peak windows.

`tokenload history` reads the history database that `tokenload watch` fills
and writes history.html, PNG charts and (with --csv) history.csv into --out,
then prints the verdict: when the channel is fast, when it is slow, by how much.
`tokenload history add RUN_DIR...` ingests `tokenload run` directories, so
stress runs at different hours land beside the watch samples (a run already
ingested adds nothing).

The database defaults to $XDG_DATA_HOME/tokenload/history.db, else
~/.local/share/tokenload/history.db.
"""

from __future__ import annotations

import argparse

HELP = "hour-of-day views of the history database, peak and off-peak windows; `history add RUN_DIR` ingests runs"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="*", metavar="add RUN_DIR",
                        help="`add RUN_DIR...`: ingest run directories instead of reporting")
    parser.add_argument("--db", metavar="FILE", help="history database (default: see above)")


def run(args: argparse.Namespace) -> int:
    from contextlib import closing

    from tokenload.errors import ConfigError
    from tokenload.history.store import ingest_run, open_store

    if args.action and (args.action[0] != "add" or len(args.action) < 2):
        raise ConfigError(f"unexpected {' '.join(args.action)!r}; write `tokenload history add RUN_DIR...` "
                          "or `tokenload history` with options only")
    with closing(open_store(args.db)) as store:
        for run_dir in args.action[1:]:
            channel, added, total = ingest_run(store, run_dir)
            print(f"{run_dir}: {added} of {total} requests added for {channel} -> {store.path}")
    return 0
