"""Step windows, load levels, and throughput counted by time.

A step is a window of wall time in which the load generator held one load
level: a number of users (closed loop) or an offered arrival rate (open loop).
The manifest records both the plan and when each step began and ended; runs
without it (synthetic runs, old runs) fall back to the records themselves.

Throughput is measured *in the window*, not by the step a request started in:
each request's output tokens are spread evenly between its first and last
token (an open stream up to its last seen token), its input tokens count when
its first token arrived (prefill done), a completion counts when it ended. A
request that started late in step 3 and streamed through step 4 then adds to
step 4's throughput for what it produced there, which is what the channel did.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from tokenload.contracts.manifest import Manifest

USERS = "users"
RATE = "req/s"


def level_text(level: float, unit: str) -> str:
    """'1 user', '32 users', '8 req/s'."""
    if unit == RATE:
        return f"{level:g} req/s"
    return f"{int(level)} user" + ("" if int(level) == 1 else "s")


def manifest_steps(manifest: Manifest) -> dict[int, dict[str, Any]]:
    """Step number -> the manifest's plan and record of it (users, rate, started_at, ended_at ...)."""
    steps: dict[int, dict[str, Any]] = {}
    for entry in [*(manifest.get("plan") or []), *(manifest.get("steps") or [])]:
        if isinstance(entry, dict) and isinstance(entry.get("step"), int):
            steps.setdefault(entry["step"], {}).update(entry)
    return steps


def step_windows(df: pd.DataFrame, manifest: Manifest, run_end: float) -> pd.DataFrame:
    """One row per step: start, end (unix s), load_level, load_unit, planned users and rate.

    A step's window is the manifest's [started_at, ended_at]; without those it runs
    from its first request to the next step's first request (the last to the run's end).
    """
    grouped = df.groupby("step", sort=True)
    return windows_of(pd.DataFrame({"first_start": grouped["started_at"].min(),
                                    "users_seen": grouped["active_users"].max()}), manifest, run_end)


def windows_of(seen: pd.DataFrame, manifest: Manifest, run_end: float) -> pd.DataFrame:
    """`step_windows` from what the records say of each step: its first start and most users (`first_start`,
    `users_seen`, indexed by step)."""
    planned = manifest_steps(manifest)
    table = seen.copy()
    starts, ends, levels, units, users, rates = [], [], [], [], [], []
    for step, row in table.iterrows():
        plan = planned.get(int(step), {})
        started = plan.get("started_at")
        starts.append(float(started) if isinstance(started, (int, float)) else float(row["first_start"]))
        ended = plan.get("ended_at")
        ends.append(float(ended) if isinstance(ended, (int, float)) else np.nan)
        rate = plan.get("rate")
        user_count = plan.get("users", row["users_seen"])
        users.append(int(user_count) if isinstance(user_count, (int, float)) else int(row["users_seen"]))
        rates.append(float(rate) if isinstance(rate, (int, float)) else np.nan)
        if isinstance(rate, (int, float)):
            levels.append(float(rate))
            units.append(RATE)
        else:
            levels.append(float(row["users_seen"]))
            units.append(USERS)
    table["start"] = starts
    table["end"] = ends
    table["load_level"] = levels
    table["load_unit"] = units
    table["planned_users"] = users
    table["offered_rate"] = rates
    table = table.sort_values("start")
    # A step without a recorded end (a killed run, a synthetic one) ends where the next begins.
    following = table["start"].shift(-1).fillna(max(run_end, float(table["start"].max())))
    table["end"] = table["end"].fillna(following)
    table["duration_s"] = (table["end"] - table["start"]).where(lambda d: d > 0)
    return table.drop(columns=["first_start", "users_seen"])


def _overlap(first: np.ndarray, last: np.ndarray, a: float, b: float) -> np.ndarray:
    """Share of each interval [first, last] inside [a, b); a zero-length interval is a point."""
    span = last - first
    inside = np.clip(np.minimum(last, b) - np.maximum(first, a), 0.0, None)
    point = (first >= a) & (first < b)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(span > 0, inside / np.where(span > 0, span, 1.0), point.astype(np.float64))
    return np.where(np.isfinite(share), share, 0.0)


def by_time(df: pd.DataFrame, windows: pd.DataFrame, cut: float, good: np.ndarray) -> pd.DataFrame:
    """Per step window: tokens streamed, input tokens prefilled, completions, the seconds requests held the channel
    (`busy_s`: the window's mean concurrency times its width), and the good completions:
    the step's own requests that met the criteria (`good`) and ended in its window (a request is judged at the
    load it was sent into, so goodput never exceeds the rate of the step's requests that met them).

    `cut` is when the run stopped: a request cut open occupies the channel until it was cut (its `cut_at`,
    else `cut`).
    """
    started = df["started_at"].to_numpy()
    ttft = df["ttft_s"].to_numpy()
    first = started + ttft
    last = started + np.where(np.isfinite(df["e2e_s"].to_numpy()), df["e2e_s"].to_numpy(), ttft)
    out_tokens = np.nan_to_num(df["output_tokens"].to_numpy(), nan=0.0)
    in_tokens = np.nan_to_num(df["input_tokens"].to_numpy(), nan=0.0)
    has_first = np.isfinite(first)
    in_flight = df["in_flight"].to_numpy()
    done = df["status"].eq("ok").to_numpy() & ~in_flight
    finished = df["finished_at"].to_numpy()
    steps = df["step"].to_numpy()
    cut_at = df["cut_at"].to_numpy(dtype=np.float64) if "cut_at" in df else np.full(len(df), np.nan)
    occupied_to = np.where(in_flight, np.where(np.isfinite(cut_at), cut_at, cut),
                           np.where(np.isfinite(finished), finished, started))
    rows = {}
    for step, w in windows.iterrows():
        a, b = float(w["start"]), float(w["end"])
        width = b - a
        if not width > 0:
            rows[step] = dict.fromkeys(("output_tokens_window", "input_tokens_window", "completions_window",
                                        "good_completions_window", "busy_s"), np.nan)
            continue
        streamed = float((out_tokens[has_first] * _overlap(first[has_first], last[has_first], a, b)).sum())
        prefilled = float(in_tokens[has_first & (first >= a) & (first < b)].sum())
        ended_here = done & (finished >= a) & (finished < b)
        completions = int(ended_here.sum())
        busy = np.clip(np.minimum(occupied_to, b) - np.maximum(started, a), 0.0, None).sum()
        rows[step] = {"output_tokens_window": streamed, "input_tokens_window": prefilled,
                      "completions_window": completions,
                      "good_completions_window": int((ended_here & good & (steps == step)).sum()),
                      "busy_s": float(busy)}
    return pd.DataFrame.from_dict(rows, orient="index")
