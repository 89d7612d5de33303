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
  overload, timeouts, disconnects: `tokenload.errors.LOAD_KINDS`) passes the
  SLO's `max_error_rate`.

When a rule fires at the lowest load the ramp judged, there is no level that
met it: the breakpoint lies below the range (`below_range`, `load_level` null,
"below 2 users"), not at the lowest level.

A run may also have been ended by its own live rule (`[stop]
breakpoint_ttft_p95_s` or `breakpoint_error_rate`): that is its "auto-stop",
an intended end, not an incomplete run. `auto_stop` names it and says how it
relates to the breakpoint found here (they judge different things: one step's
TTFT p95 or error rate against the stop limit, versus every request against
the SLO).

A step with fewer than `MIN_STEP_REQUESTS` finished requests cannot decide any
rule: its percentiles and shares are too noisy, so it is skipped and named in
`undecided` (the fix is a longer step, or `min_requests`). The reported
breakpoint is the lowest load at which any rule fired; every rule's outcome
stays in `rules` so a reader sees what else happened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import Completeness, Outage
from tokenload.slo import Slo

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
            return _hit(row, last_good, f"SLO ({slo.describe()}) met by {_fmt_pct(att)} of judged requests at {_at(row)} (n={int(row['slo_n'])}{interval}), "
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
                                        f"the {_fmt_pct(limit)} limit (the SLO's max_error_rate)")
        last_good = row
    return None


def _below_range(hit: dict[str, Any]) -> dict[str, Any]:
    """A rule that fired at the lowest judged load: no level met it, the breakpoint is below the range."""
    lowest = level_text(hit["load_level"], hit["load_unit"])
    return {**hit, "load_level": None, "active_users": None, "below_range": True,
            "lowest_load_level": hit["load_level"], "lowest_active_users": hit["active_users"],
            "detail": f"below {lowest}: not even the lowest load met it; {hit['detail']}"}


def breakpoint_text(bp: Mapping[str, Any]) -> str:
    """'16 users', or 'below 2 users' when no level met the SLO."""
    if bp.get("below_range"):
        return f"below {level_text(bp['lowest_load_level'], bp['load_unit'])}"
    return level_text(bp["load_level"], bp["load_unit"])


def find_breakpoint(steps: pd.DataFrame, slo: Slo, complete: Completeness | None = None,
                    outage: Outage | None = None) -> dict[str, Any]:
    """Evaluate every rule on the decided steps ordered by load level.

    Returns `{"breakpoint": {...} | None, "breakpoint_note": str | None, "rules": {...}, "undecided": [...]}`;
    `breakpoint.load_level` (in `load_unit`) is the first load at which the channel broke, null with
    `below_range` true when it broke at the lowest load judged. With an `outage` (`analysis/outage.py`) only
    the steps that ended before the channel went down are judged: what came after says nothing about load.
    """
    error_limit = slo.max_error_rate
    if outage is not None:
        steps = steps[steps["end"] <= outage["at"]]
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
        chosen = {**hit, "reason": name, "below_range": False}
        if hit["last_good_load_level"] is None:
            chosen = _below_range(chosen)
        return {"breakpoint": chosen, "breakpoint_note": too_few[2:] or None, "rules": rules, "undecided": undecided}
    levels = [(_at(r)) for _, r in decided.iterrows()]
    done: Mapping[str, Any] = complete or {}
    if outage is not None:
        before = (f"; no rule fired on the steps that ended before it ({levels[0]}"
                  f"{f' to {levels[-1]}' if len(levels) > 1 else ''})" if levels else "; no step ended before it")
        note = (f"none: the channel went down at {outage['at_s']:.1f} s, an outage (its errors began at a moment, "
                f"not with the load){before}" + too_few)
    elif not levels:
        note = "no step had enough requests to judge a breakpoint" + too_few
    elif done.get("auto_stop"):
        note = (f"no breakpoint by the SLO up to {levels[-1]}, where the run's auto-stop ended it "
                f"({done['auto_stop']}): the live rule fired before the SLO did" + too_few)
    elif done.get("interrupted") or done.get("truncated"):
        note = (f"no breakpoint up to {levels[-1]}, but {done.get('note')}: the higher loads were not measured, "
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


def auto_stop(stop: Any, steps: pd.DataFrame) -> dict[str, Any] | None:
    """The live auto-stop (`[stop] breakpoint_ttft_p95_s` / `breakpoint_error_rate`) that ended the run, if one did,
    from manifest.json's `stop` record (`tokenload.contracts.manifest.StopRecord`)."""
    if not isinstance(stop, dict) or not stop.get("key"):
        return None
    step = int(stop["step"])
    row = steps.loc[step] if step in steps.index else None
    return {"rule": stop["key"], "step": step, "condition": stop["condition"], "reason": stop["reason"],
            "load_level": None if row is None else float(row["load_level"]),
            "load_unit": None if row is None else str(row["load_unit"])}


def auto_stop_relation(stop: dict[str, Any], bp: dict[str, Any] | None, slo: Slo, judged_up_to: str | None) -> str:
    """One sentence: where the live rule stopped the run, and where the SLO breakpoint is."""
    at = (level_text(stop["load_level"], stop["load_unit"]) if stop["load_level"] is not None
          else f"step {stop['step']}")
    head = f"auto-stop at {at} ({stop['condition']}, [stop] {stop['rule']})"
    if bp is None:
        upto = f" up to {judged_up_to}" if judged_up_to else ""
        return (f"{head}; the SLO ({slo.describe()}) held{upto}: the live rule is stricter than the SLO, "
                "so the capacity by the SLO may be higher")
    where = breakpoint_text(bp)
    what = "SLO breakpoint" if bp["reason"] == "slo" else f"breakpoint ({bp['reason']} rule)"
    if bp.get("below_range"):
        return f"{head}; the {what} is {where}: no level met it"
    if stop["load_level"] is not None and bp["load_level"] < stop["load_level"]:
        why = (" (the live rule judges one step's TTFT p95 against its own limit; the SLO judges every request "
               f"against {slo.describe()})" if stop["rule"] == "breakpoint_ttft_p95_s" else
               " (the live rule judges only the error rate; the SLO judges every request's latency too)")
        return f"{head}; the {what} is {where}, lower{why}"
    return f"{head}; the {what} is {where}, the same level"
