"""Trace replay: send requests when a recorded trace sent them, with its input and output lengths.

A trace is JSONL or CSV, one request per row, in the shape public traces have
(BurstGPT's CSV, Mooncake's JSONL): a time per row, either an absolute
`timestamp` (any origin: offsets are taken from the first row) or the gap since
the previous row (`interval_s`), and the request's input and output token
counts. Column names of the common traces are understood as they are:

    time        timestamp | Timestamp | time | arrival_time   (`[load] time_unit` s or ms)
    gap         interval_s | inter_arrival_s | delay_s          (always seconds)
    input       input_tokens | input_length | prompt_tokens | Request tokens
    output      output_tokens | output_length | completion_tokens | Response tokens

The replay is open loop: row i is due at the phase start + offset_i / speed,
whatever the channel does, and a send that could not go on time records how
late it was (`scheduled_at`, `late_s`), as Poisson arrivals do.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenload.errors import ConfigError

TIME_KEYS = ("timestamp", "Timestamp", "time", "arrival_time")
GAP_KEYS = ("interval_s", "inter_arrival_s", "delay_s")
INPUT_KEYS = ("input_tokens", "input_length", "prompt_tokens", "Request tokens")
OUTPUT_KEYS = ("output_tokens", "output_length", "completion_tokens", "Response tokens")
TIME_UNITS = {"s": 1.0, "ms": 0.001}


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One recorded request: seconds after the first row, and its lengths."""

    offset_s: float
    input_tokens: int
    output_tokens: int


def _pick(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((row[k] for k in keys if row.get(k) not in (None, "")), None)


def _number(value: Any, what: str, *, integer: bool) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a number, got {json.dumps(value)}") from None
    if not math.isfinite(number) or number < 0 or (integer and (number < 1 or number != int(number))):
        raise ValueError(f"{what}: expected {'an integer >= 1' if integer else 'a number >= 0'}, got {value}")
    return number


def _rows(path: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row as a dict) for a JSONL or CSV trace."""
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        return [(reader.line_num, row) for row in reader]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"trace {path} line {n}: not valid JSON: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"trace {path} line {n}: expected a JSON object")
            out.append((n, obj))
    return out


@functools.lru_cache(maxsize=4)
def load_trace(path: str, time_unit: str = "s") -> tuple[TraceRow, ...]:
    """The trace's rows, sorted by offset; any bad row is one `ConfigError` naming file and line."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"trace {path}: cannot read: {exc}") from None
    scale = TIME_UNITS[time_unit]
    rows: list[TraceRow] = []
    first: float | None = None
    clock = 0.0
    for n, row in _rows(source, text):
        try:
            stamp, gap = _pick(row, TIME_KEYS), _pick(row, GAP_KEYS)
            if stamp is None and gap is None:
                raise ValueError(f"needs a time ({' | '.join(TIME_KEYS)}) or a gap ({' | '.join(GAP_KEYS)})")
            n_in, n_out = _pick(row, INPUT_KEYS), _pick(row, OUTPUT_KEYS)
            if n_in is None or n_out is None:
                raise ValueError(f"needs input ({' | '.join(INPUT_KEYS)}) and output ({' | '.join(OUTPUT_KEYS)}) lengths")
            if stamp is not None:
                at = _number(stamp, "time", integer=False) * scale
                first = at if first is None else first
                clock = at - first
            else:
                clock += _number(gap, "gap", integer=False)
            rows.append(TraceRow(clock, int(_number(n_in, "input", integer=True)),
                                 int(_number(n_out, "output", integer=True))))
        except ValueError as exc:
            raise ConfigError(f"trace {path} line {n}: {exc}") from None
    if not rows:
        raise ConfigError(f"trace {path} holds no requests")
    if min(r.offset_s for r in rows) < 0:
        raise ConfigError(f"trace {path}: a timestamp lies before the first row's; sort the trace by time")
    return tuple(sorted(rows, key=lambda r: r.offset_s))


def trace_span_s(rows: tuple[TraceRow, ...], speed: float) -> float:
    """How long the replay's schedule lasts: the last send, plus a moment so it is inside the plan."""
    return rows[-1].offset_s / speed + 0.5


