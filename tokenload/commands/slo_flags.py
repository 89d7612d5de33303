"""The `--slo-*` flags, defined once for run, analyze, compare, doctor and watch.

Every flag overrides one field of the SLO a command starts from (a scenario's
`[slo]` table, the analysed run's, or `tokenload.slo.DEFAULT` where there is no
scenario); a flag left out keeps that field. A threshold flag given `off` drops
that term from the SLO (any subset of TTFT, TPOT, ITL and e2e may be judged).
A value out of range is one line and exit code 2, before anything is sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from tokenload.errors import ConfigError
from tokenload.slo import DEFAULT, Slo

# (flag, Slo field, metavar, what it bounds)
FLAGS: tuple[tuple[str, str, str, str], ...] = (
    ("--slo-ttft", "ttft_s", "S", "time to first token per request, seconds"),
    ("--slo-tpot", "tpot_s", "S", "time per output token per request, seconds"),
    ("--slo-itl", "itl_s", "S", "inter-token latency per request (its p99 gap), seconds"),
    ("--slo-e2e", "e2e_s", "S", "end-to-end latency per request, seconds"),
    ("--slo-target", "target", "SHARE", "share of requests that must meet every threshold, in (0, 1]"),
    ("--slo-max-error-rate", "max_error_rate", "SHARE", "highest share of load errors a load level may have, in [0, 1]"),
)
THRESHOLDS = frozenset({"ttft_s", "tpot_s", "itl_s", "e2e_s"})


def _default_text(name: str) -> str:
    value = getattr(DEFAULT, name)
    return "not judged" if value is None else f"{value:g}"


def _parser(name: str) -> Any:
    """The argparse `type` of one flag: a checked number (or `off` for a threshold)."""

    def parse(text: str) -> float | None:
        if name in THRESHOLDS and text.strip().lower() == "off":
            return None
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if name in THRESHOLDS and not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r}: a threshold is a positive number of seconds, or off")
        if name == "target" and not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"{text!r}: the target is a share in (0, 1], e.g. 0.9")
        if name == "max_error_rate" and not 0 <= value <= 1:
            raise argparse.ArgumentTypeError(f"{text!r}: the error rate is a share in [0, 1], e.g. 0.05")
        return value

    parse.__name__ = name  # argparse names the type in its messages
    return parse


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the six `--slo-*` flags (one group, the same help on every command)."""
    group = parser.add_argument_group(
        "SLO", "override the SLO's fields (default: the scenario's [slo] table, else tokenload's defaults); "
               "a threshold given `off` is left out of the SLO")
    for flag, name, metavar, what in FLAGS:
        off = "|off" if name in THRESHOLDS else ""
        group.add_argument(flag, dest=f"slo_{name}", type=_parser(name), default=argparse.SUPPRESS,
                           metavar=f"{metavar}{off}", help=f"{what} (default {_default_text(name)})")


def slo_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SLO fields the flags set (None: the threshold was turned off)."""
    return {name: getattr(args, f"slo_{name}") for _, name, _, _ in FLAGS if hasattr(args, f"slo_{name}")}


def apply_overrides(slo: Slo, overrides: dict[str, Any]) -> Slo:
    """`slo` with the flags' fields replaced (each value was checked when parsed)."""
    return dataclasses.replace(slo, **overrides) if overrides else slo


def slo_from_args(args: argparse.Namespace, base: Slo = DEFAULT) -> Slo:
    """`base` (a scenario's `[slo]`, else the default) with the flags applied.

    An SLO the flags left without any threshold is refused: a scenario's `[slo]`
    table that names none means the defaults, so the run could not record it.
    """
    slo = apply_overrides(base, slo_overrides(args))
    if not slo.thresholds:
        raise ConfigError("the --slo-* flags turned off every threshold: keep at least one of --slo-ttft, "
                          "--slo-tpot, --slo-itl, --slo-e2e")
    return slo
