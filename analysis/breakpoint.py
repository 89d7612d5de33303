"""Where the ramp broke the channel: three independent rules, each with its numbers.

- `slo`: the first step whose SLO attainment drops below the target (the one
  before it is the highest concurrency that still met the SLO).
- `knee`: throughput stops growing with users while latency climbs: more users
  only wait longer, the classic saturation signature of a closed-loop ramp.
- `error_rate`: the first step whose load-related error rate (429, 5xx,
  overload, timeouts, disconnects) passes the limit.

The reported breakpoint is the lowest concurrency at which any rule fired;
every rule's outcome stays in `rules` so a reader sees what else happened.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from tokenload.analysis.steps import Slo

ERROR_RATE_LIMIT = 0.05
# Knee: throughput grew by less than this fraction of the relative user increase...
KNEE_SCALING = 0.25
# ...while median e2e latency rose by at least this fraction.
KNEE_LATENCY_RISE = 0.20
# On a tie at one step, the more fundamental cause is reported first.
RULE_ORDER: tuple[str, ...] = ("error_rate", "slo", "knee")


def users(n: float) -> str:
    """'1 user', '32 users'."""
    return f"{int(n)} user" + ("" if int(n) == 1 else "s")


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _slo_rule(steps: pd.DataFrame, slo: Slo) -> dict[str, Any] | None:
    last_good = None
    for _, row in steps.iterrows():
        att = row["slo_attainment"]
        if np.isnan(att):
            continue
        if att < slo.target:
            before = (f"{users(last_good['active_users'])} was the highest that met it "
                      f"({_fmt_pct(last_good['slo_attainment'])})" if last_good is not None
                      else "no step met it, not even the lowest load")
            return {"active_users": int(row["active_users"]),
                    "last_good_active_users": None if last_good is None else int(last_good["active_users"]),
                    "detail": (f"SLO (TTFT <= {slo.ttft_s:g} s and e2e <= {slo.e2e_s:g} s) met by "
                               f"{_fmt_pct(att)} of requests at {users(row['active_users'])}, below the "
                               f"{_fmt_pct(slo.target)} target; {before}")}
        last_good = row
    return None


def _knee_rule(steps: pd.DataFrame) -> dict[str, Any] | None:
    rows = [r for _, r in steps.iterrows() if r["ok"] > 0 and r["output_tok_s"] > 0]
    for prev, row in zip(rows, rows[1:]):
        user_gain = row["active_users"] / prev["active_users"] - 1.0
        if user_gain <= 0:
            continue
        thr_gain = row["output_tok_s"] / prev["output_tok_s"] - 1.0
        lat_rise = row["e2e_p50_s"] / prev["e2e_p50_s"] - 1.0
        if thr_gain < KNEE_SCALING * user_gain and lat_rise >= KNEE_LATENCY_RISE:
            return {"active_users": int(row["active_users"]),
                    "last_good_active_users": int(prev["active_users"]),
                    "detail": (f"from {int(prev['active_users'])} to {users(row['active_users'])} "
                               f"(+{_fmt_pct(user_gain)}) output throughput changed {thr_gain:+.1%} "
                               f"({prev['output_tok_s']:.0f} -> {row['output_tok_s']:.0f} tok/s) while "
                               f"median e2e rose {lat_rise:+.1%} ({prev['e2e_p50_s']:.2f} -> "
                               f"{row['e2e_p50_s']:.2f} s)")}
    return None


def _error_rule(steps: pd.DataFrame, limit: float) -> dict[str, Any] | None:
    last_good = None
    for _, row in steps.iterrows():
        if row["load_error_rate"] > limit:
            return {"active_users": int(row["active_users"]),
                    "last_good_active_users": None if last_good is None else int(last_good),
                    "detail": (f"{_fmt_pct(row['load_error_rate'])} of requests at "
                               f"{users(row['active_users'])} failed with load errors "
                               f"({int(row['load_errors'])} of {int(row['requests'])}), above the "
                               f"{_fmt_pct(limit)} limit")}
        last_good = row["active_users"]
    return None


def find_breakpoint(steps: pd.DataFrame, slo: Slo, error_limit: float = ERROR_RATE_LIMIT) -> dict[str, Any]:
    """Evaluate every rule on steps ordered by concurrency.

    Returns `{"breakpoint": {...} | None, "breakpoint_note": str | None, "rules": {...}}`;
    `breakpoint.active_users` is the first concurrency at which the channel broke.
    """
    steps = steps.sort_values("active_users")
    fired = {"error_rate": _error_rule(steps, error_limit), "slo": _slo_rule(steps, slo),
             "knee": _knee_rule(steps)}
    rules = {name: ({"fired": True, **hit} if hit else {"fired": False}) for name, hit in fired.items()}
    hits = [(hit["active_users"], RULE_ORDER.index(name), name, hit) for name, hit in fired.items() if hit]
    if hits:
        _, _, name, hit = min(hits)
        return {"breakpoint": {"active_users": hit["active_users"], "reason": name, "detail": hit["detail"],
                               "last_good_active_users": hit["last_good_active_users"]},
                "breakpoint_note": None, "rules": rules}
    levels = steps["active_users"].tolist()
    if len(levels) < 2:
        note = (f"a single load step ({users(levels[0]) if levels else 'no users'}) cannot show a breakpoint: "
                "run a ramp to find one")
    else:
        note = (f"the ramp never broke the channel: from {levels[0]} to {users(levels[-1])} SLO attainment "
                f"stayed >= {_fmt_pct(slo.target)}, load errors <= {_fmt_pct(error_limit)} and "
                "throughput kept growing; ramp higher to find the limit")
    return {"breakpoint": None, "breakpoint_note": note, "rules": rules}
