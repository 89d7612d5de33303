"""The SLO, one definition for the run, the breakpoint search, `analyze`, `compare`, `doctor` and `watch`.

A request meets the SLO when every threshold that is set holds for it
(`ttft_s`, `tpot_s`, `itl_s` against the request's ITL p99, `e2e_s`; any subset).
A load level meets it when at least `target` of its judged requests meet it
and its load-class error rate is at most `max_error_rate`.

What is judged: successes, and failures whose error class is "load" (timeouts,
rate limits, overload, disconnects, server errors: what load does to a channel).
Configuration and input errors (auth, model, base URL, bad request,
`context_length`) are the user's to fix, not the channel's capacity: they are
left out of the count entirely, neither meeting nor missing the SLO.
A request still open when its window closed is judged by what it had reached:
one that already exceeded a threshold misses it; one that had not is left out
(censored), never counted as a success.

The `[slo]` table of a scenario and the `--slo-*` flags of every command give
the same names and the same defaults (`DEFAULT`): TTFT <= 1 s (longer reads as
"nothing happened") and TPOT <= 0.2 s (slower than about 5 tokens/s the text
falls behind a reader) for 90% of requests. No end-to-end bound by default: a
total latency depends on how long the answer is, which only the user knows
(a 3 s bound failed every 256-token answer of a healthy channel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, cast

from tokenload.contracts.summary import SloTable
from tokenload.errors import error_class

METRICS = ("ttft", "tpot", "itl", "e2e")
# The per-request column each threshold is checked against.
COLUMN = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_p99_s", "e2e": "e2e_s"}
LABEL = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL p99", "e2e": "e2e", "errors": "error rate"}


@dataclass(frozen=True)
class Slo:
    """Per-request thresholds in seconds (None: not part of the SLO) and the share that must meet them."""

    ttft_s: float | None = 1.0
    tpot_s: float | None = 0.2
    itl_s: float | None = None
    e2e_s: float | None = None
    target: float = 0.90
    max_error_rate: float = 0.05

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be a share in (0, 1], got {self.target!r}")
        if not 0 <= self.max_error_rate <= 1:
            raise ValueError(f"max_error_rate must be a share in [0, 1], got {self.max_error_rate!r}")

    @property
    def thresholds(self) -> dict[str, float]:
        """metric -> threshold, for the thresholds that are set."""
        return {m: v for m in METRICS if (v := getattr(self, f"{m}_s")) is not None}

    @property
    def first_token_decides(self) -> bool:
        """TTFT is the only threshold: a request's verdict is known at its first token (unless it fails later)."""
        return self.ttft_s is not None and self.tpot_s is None and self.itl_s is None and self.e2e_s is None

    def with_overrides(self, **values: float | None) -> Slo:
        """This SLO with the given fields replaced (None values leave a field as it is)."""
        given = {k: v for k, v in values.items() if v is not None}
        unknown = set(given) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown SLO fields: {sorted(unknown)}")
        return replace(self, **given)

    def describe(self) -> str:
        """`TTFT <= 0.5 s and e2e <= 3 s for 90% of requests`."""
        terms = " and ".join(f"{LABEL[m]} <= {v:g} s" for m, v in self.thresholds.items()) or "no latency bound"
        return f"{terms} for {self.target:.0%} of requests"

    def to_dict(self) -> SloTable:
        return cast(SloTable, {f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Slo:
        """An SLO as a resolved scenario stores it (thresholds not set are absent); None or {}: `DEFAULT`."""
        if not data:
            return DEFAULT
        return cls(**{**{f"{m}_s": None for m in METRICS}, **data})


DEFAULT = Slo()


def judged(status: str, error_kind: str | None) -> bool:
    """Whether a finished request counts for the SLO: a success, or a failure the load can cause."""
    return status == "ok" or error_class(error_kind) == "load"


def missed_terms(slo: Slo, values: dict[str, float | None]) -> list[str]:
    """The SLO terms one successful request missed (`values`: metric -> seconds, None = not measured).

    A threshold whose value was not measured (TPOT of a one-token answer) is not missed.
    """
    return [m for m, limit in slo.thresholds.items()
            if (v := values.get(m)) is not None and not math.isnan(v) and v > limit]


def verdict(slo: Slo, status: str, error_kind: str | None, values: dict[str, float | None]) -> bool | None:
    """One finished request against the SLO: True met, False missed, None not judged (config/input error)."""
    if not judged(status, error_kind):
        return None
    return status == "ok" and not missed_terms(slo, values)
