"""Where the ramp broke the channel: three independent rules, each with its numbers.

Steps are ordered by load level: users for a closed-loop ramp, offered
requests/s for an open-loop rate sweep; every message names the level in its
own unit ("at 16 users", "at 8 req/s").

- `slo`: the first step whose SLO attainment drops below the target (the one
  before it is the highest load that still met the SLO). The detail gives the
  attainment's 95% Wilson interval, so a reader sees how close to the target
  it was.
- `knee`: throughput stops growing with the load while latency climbs: more
  users (or more offered requests) only wait longer, the saturation signature.
- `error_rate`: the first step whose load-related error rate (429, 5xx,
  overload, timeouts, disconnects: `tokenload.errors.LOAD_KINDS`) passes the limit.

A step with fewer than `MIN_STEP_REQUESTS` finished requests cannot decide any
rule: its percentiles and shares are too noisy, so it is skipped and named in
`undecided` (the fix is a longer step, or `min_requests`). The reported
breakpoint is the lowest load at which any rule fired; every rule's outcome
stays in `rules` so a reader sees what else happened.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.analysis.steps import Slo
from tokenload.analysis.windows import level_text

ERROR_RATE_LIMIT = 0.05
# Knee: throughput grew by less than this fraction of the relative load increase...
KNEE_SCALING = 0.25
# ...while median e2e latency rose by at least this fraction.
KNEE_LATENCY_RISE = 0.20
# On a tie at one step, the more fundamental cause is reported first.
RULE_ORDER: tuple[str, ...] = ("error_rate", "slo", "knee")


def users(n: float) -> str:
    """'1 user', '32 users'."""
    return level_text(n, "users")


def _at(row: pd.Series) -> str:
    return level_text(row["load_level"], str(row["load_unit"]))


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _hit(row: pd.Series, last_good: pd.Series | None, detail: str) -> dict[str, Any]:
    return {"load_level": float(row["load_level"]), "load_unit": str(row["load_unit"]),
            "active_users": int(row["active_users"]), "step": int(cast(int, row.name)),
            "last_good_load_level": None if last_good is None else float(last_good["load_level"]),
            "last_good_active_users": None if last_good is None else int(last_good["active_users"]),
            "detail": detail}


def _slo_rule(steps: pd.DataFrame, slo: Slo) -> dict[str, Any] | None:
    last_good = None
    for _, row in steps.iterrows():
        att = row["slo_attainment"]
        if np.isnan(att):
            continue
        ci = row.get("slo_ci")
        if att < slo.target:
            interval = f", 95% CI {_fmt_pct(ci[0])}-{_fmt_pct(ci[1])}" if isinstance(ci, tuple) else ""
            before = (f"{_at(last_good)} was the highest that met it ({_fmt_pct(last_good['slo_attainment'])})"
                      if last_good is not None else "no step met it, not even the lowest load")
            return _hit(row, last_good, f"SLO (TTFT <= {slo.ttft_s:g} s and e2e <= {slo.e2e_s:g} s) met by "
                                        f"{_fmt_pct(att)} of requests at {_at(row)} (n={int(row['slo_n'])}{interval}), "
                                        f"below the {_fmt_pct(slo.target)} target; {before}")
        last_good = row
    return None


def _knee_rule(steps: pd.DataFrame) -> dict[str, Any] | None:
    rows = [r for _, r in steps.iterrows() if r["ok"] > 0 and r["output_tok_s"] > 0]
    for prev, row in zip(rows, rows[1:]):
        load_gain = row["load_level"] / prev["load_level"] - 1.0
        if load_gain <= 0:
            continue
        thr_gain = row["output_tok_s"] / prev["output_tok_s"] - 1.0
        lat_rise = row["e2e_p50_s"] / prev["e2e_p50_s"] - 1.0
        if thr_gain < KNEE_SCALING * load_gain and lat_rise >= KNEE_LATENCY_RISE:
            return _hit(row, prev, f"from {_at(prev)} to {_at(row)} (+{_fmt_pct(load_gain)}) output throughput "
                                   f"changed {thr_gain:+.1%} ({prev['output_tok_s']:.0f} -> {row['output_tok_s']:.0f} "
                                   f"tok/s) while median e2e rose {lat_rise:+.1%} ({prev['e2e_p50_s']:.2f} -> "
                                   f"{row['e2e_p50_s']:.2f} s)")
    return None


def _error_rule(steps: pd.DataFrame, limit: float) -> dict[str, Any] | None:
    last_good = None
    for _, row in steps.iterrows():
        if row["load_error_rate"] > limit:
            return _hit(row, last_good, f"{_fmt_pct(row['load_error_rate'])} of requests at {_at(row)} failed with "
                                        f"load errors ({int(row['load_errors'])} of {int(row['requests'])}), above "
                                        f"the {_fmt_pct(limit)} limit")
        last_good = row
    return None


def find_breakpoint(steps: pd.DataFrame, slo: Slo, error_limit: float = ERROR_RATE_LIMIT,
                    complete: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate every rule on the decided steps ordered by load level.

    Returns `{"breakpoint": {...} | None, "breakpoint_note": str | None, "rules": {...}, "undecided": [...]}`;
    `breakpoint.load_level` (in `load_unit`) is the first load at which the channel broke.
    """
    steps = steps.sort_values(["load_level", "start"])
    decided = steps[steps["decided"]] if "decided" in steps else steps
    small = steps.drop(decided.index)
    undecided = [{"step": int(s), "load": _at(r), "n": int(r["ok"] + r["errors"])} for s, r in small.iterrows()]
    fired = {"error_rate": _error_rule(decided, error_limit), "slo": _slo_rule(decided, slo),
             "knee": _knee_rule(decided)}
    rules = {name: ({"fired": True, **hit} if hit else {"fired": False}) for name, hit in fired.items()}
    hits = [(hit["load_level"], RULE_ORDER.index(name), name, hit) for name, hit in fired.items() if hit]
    closed = steps.empty or str(steps["load_unit"].iloc[0]) == "users"
    fix = "lengthen step_s or set [load] min_requests" if closed else "lengthen step_s"
    too_few = ("; " + ", ".join(f"step {u['step']} ({u['load']}, n={u['n']})" for u in undecided) +
               f" had too few requests to judge ({fix})") if undecided else ""
    if hits:
        _, _, name, hit = min(hits)
        return {"breakpoint": {**hit, "reason": name}, "breakpoint_note": too_few[2:] or None, "rules": rules,
                "undecided": undecided}
    levels = [(_at(r)) for _, r in decided.iterrows()]
    complete = complete or {}
    if not levels:
        note = "no step had enough requests to judge a breakpoint" + too_few
    elif complete.get("interrupted") or complete.get("truncated"):
        note = (f"no breakpoint up to {levels[-1]}, but {complete.get('note')}: the higher loads were not measured, "
                "so this is not a verdict on them" + too_few)
    elif len(levels) < 2:
        note = f"a single load step ({levels[0]}) cannot show a breakpoint: run a ramp to find one" + too_few
    else:
        sweep = "ramp" if str(decided["load_unit"].iloc[0]) == "users" else "rate sweep"
        note = (f"the {sweep} never broke the channel: from {levels[0]} to {levels[-1]} SLO attainment "
                f"stayed >= {_fmt_pct(slo.target)}, load errors <= {_fmt_pct(error_limit)} and "
                f"throughput kept growing; {'ramp higher' if sweep == 'ramp' else 'offer higher rates'} to find the "
                "limit" + too_few)
    return {"breakpoint": None, "breakpoint_note": note, "rules": rules, "undecided": undecided}
