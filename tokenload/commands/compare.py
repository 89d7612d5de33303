"""tokenload compare (being built)."""

from __future__ import annotations

import argparse

HELP = "not yet available"


def configure(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    print("tokenload compare: not yet available")
    return 1
