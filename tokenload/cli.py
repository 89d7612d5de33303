"""The `tokenload` console script: one subcommand per module in `tokenload.commands`.

Each command module exposes `HELP` (one line), `configure(parser)` and
`run(args) -> int`, and keeps heavy imports inside `run` so `--help` stays fast.
This module owns the exit-code contract: 0 success, 1 the check or
run found a failure, 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tokenload import __version__
from tokenload.errors import ConfigError, HarnessError

COMMANDS: tuple[str, ...] = ("demo", "sim", "probe", "doctor", "run", "analyze", "compare", "watch", "history")


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tokenload",
        description="Load-test a streaming LLM channel: TTFT, TPOT, ITL and total latency under load.",
        epilog="Exit codes: 0 success, 1 a check or run found a failure, 2 bad input.",
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


if __name__ == "__main__":
    sys.exit(main())
