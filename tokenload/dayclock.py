"""The local day, possibly compressed: one definition for the simulator and the history views.

A day of `period_s` seconds (86,400 for a real one) is folded from the local
wall clock: `hour = ((t + utc_offset) mod period) / period * 24`. With a real
day that is the local hour of day; with a day compressed by N (`period =
86400 / N`) the simulator's `--time-scale N` and `history --period` fold the
same instant into the same hour, with no start time to share.
"""

from __future__ import annotations

import re
import time

DAY_S = 86_400.0
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d|w)?\s*$")
_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": DAY_S, "w": 7 * DAY_S}


def utc_offset_s(t: float) -> float:
    """The local time zone's offset from UTC at unix time `t` (daylight saving included)."""
    return float(time.localtime(t).tm_gmtoff)


def day_hour(t: float, period_s: float = DAY_S, phase_h: float = 0.0) -> float:
    """Hour of the (compressed) local day at unix time `t`, in [0, 24)."""
    return ((t + utc_offset_s(t)) % period_s / period_s * 24.0 + phase_h) % 24.0


def timezone_name() -> str:
    """The local time zone as people read it, e.g. `CET (UTC+01:00)`."""
    offset = utc_offset_s(time.time())
    sign = "+" if offset >= 0 else "-"
    hours, minutes = divmod(int(abs(offset)) // 60, 60)
    return f"{time.strftime('%Z')} (UTC{sign}{hours:02d}:{minutes:02d})"


def parse_duration(text: str, what: str) -> float:
    """`15m`, `24h`, `7d`, `90s`, `0.5` (seconds) -> seconds; ValueError naming `what` otherwise."""
    match = _DURATION_RE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{what} {text!r} is not a positive duration; write e.g. 90s, 15m, 24h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def duration_text(seconds: float) -> str:
    """Seconds in the largest unit they fill: 15 -> `15 s`, 900 -> `15 min`, 5400 -> `1.5 h`, 0.5 -> `500 ms`."""
    for name, size in (("d", DAY_S), ("h", 3600.0), ("min", 60.0), ("s", 1.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {name}"
    return f"{seconds * 1000:.3g} ms"
