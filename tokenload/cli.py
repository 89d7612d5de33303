"""The `tokenload` console script: one subcommand per module in `tokenload.commands`.

Each command module exposes `HELP` (one line), `configure(parser)` and
`run(args) -> int`, and keeps heavy imports inside `run` so `--help` stays fast.
This module owns the exit-code contract: 0 success, 1 the check or
run found a failure, 2 bad input (one line on stderr, no traceback); a reader
that closed stdout early (`tokenload analyze DIR | head`) ends the command
quietly with 1 (as Python and rich do on a broken pipe). Options are never
abbreviated: `--slo-ttf` is an unknown option, not `--slo-ttft`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from collections.abc import Sequence

from tokenload import __version__
from tokenload.errors import ConfigError, HarnessError

COMMANDS: tuple[str, ...] = ("demo", "sim", "probe", "doctor", "run", "analyze", "compare", "watch", "history")


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2, and takes no abbreviated option."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tokenload",
        description="Load-test a streaming LLM channel: TTFT, TPOT, ITL and total latency under load.",
        epilog="Exit codes: 0 success, 1 a check or run found a failure, 2 bad input, 99 a threshold was breached.",
    )
    parser.add_argument("--version", action="version", version=f"tokenload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"tokenload.commands.{name}")
        cmd = sub.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        return int(args._run(args))
    except ConfigError as exc:
        print(f"tokenload: error: {exc}", file=sys.stderr)
        return 2
    except HarnessError as exc:
        print(f"tokenload: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokenload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        # The reader stopped reading: what is left to print is unwanted. Python flushes stdout at exit, into
        # the same closed pipe; /dev/null takes it instead.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _stdout_closed() -> bool:
    """Has the reader of stdout gone (a pipe whose read end is closed), rather than some socket?"""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() on this platform, or no real stdout
        return True


if __name__ == "__main__":
    sys.exit(main())
