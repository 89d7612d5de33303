"""An outage: the channel stopped serving at a moment, whatever the load.

A breakpoint is errors (or latency) that follow the load: they appear when the
load rises and stay at the levels above. An outage is errors that begin at a
moment: a level that had served without trouble stops being served, from then on
nearly every request fails, and it does not matter what load was offered (the
server was killed, a relay lost its backend, a backend hung). The two call for
different fixes, so the verdict must not confuse them: an outage read as a
breakpoint says "not even 4 users" of a channel that served 4 users until it died.

`find_outage` looks at the finished requests in the order their outcome was known
(`finished_at`) for a run of load errors (`tokenload.errors.LOAD_KINDS`, rate limits
and overload push-backs left out: they have their own reports) that

- holds at least `MIN_FAILURES` load errors, and one for every other user then running,
  and at least `FAILED_SHARE` load errors until the channel served again (recovered) or
  the run ended;
- began at a load level that had served at least `MIN_SERVED_BEFORE` requests
  before it, with no more load errors among them than the SLO allows (the errors
  did not come with a rise in load), or, when most of them are refused connections
  (a port that stopped listening: no load does that), after the run had served that
  many at any level (a search's probe too new to have served);
- began abruptly when its errors are timeouts: the same level's successes just
  before had a TTFT far under the time the failures waited (a queue that grows
  towards the timeout is load, not an outage).

The moment it began is the earliest sign of the failures: when a cut stream was
cut, when a stalled stream gave its last token, when a request that never got an
answer was sent. The words are the channel's own (a relay's message names its
lost backend), read from requests.parquet.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tokenload import errors as ek
from tokenload.analysis.records import chunks
from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import Outage
from tokenload.failures import fix_for, upstream_failure
from tokenload.rundir import REQUESTS_FILE
from tokenload.slo import Slo

MIN_FAILURES = 3
FAILED_SHARE = 0.9
MIN_SERVED_BEFORE = 3
# Timeouts make an outage only when the successes just before waited less than this share of the failures' wait.
ABRUPT_SHARE = 0.5
# Push-backs are the channel's answer to load or a quota, with their own report (rate limits), never an outage.
_NOT_OUTAGE = frozenset({ek.RATE_LIMITED, ek.OVERLOADED})
_TIMEOUTS = frozenset({ek.TIMEOUT_FIRST_TOKEN, ek.TIMEOUT_STALL})
# The failures that show the moment only when they end: a stream cut mid-answer.
_CUT = frozenset({ek.DISCONNECTED})
RELAY_BACKEND_DOWN = ("the relay answered but the model server behind it did not: bring the backend up (or ask "
                      "the relay's operator to)")


def _began(rows: pd.DataFrame) -> np.ndarray:
    """When each failure began: a cut at its end, a stall at its last token, anything else when it was sent."""
    kind = rows["error_kind"].astype(str).to_numpy()
    started = rows["started_at"].to_numpy(dtype=float)
    last_token = started + rows["e2e_s"].fillna(rows["ttft_s"]).to_numpy(dtype=float)
    began = np.where(np.isin(kind, list(_CUT)), rows["finished_at"].to_numpy(dtype=float), started)
    return np.where((kind == ek.TIMEOUT_STALL) & np.isfinite(last_token), last_token, began)


def _failure_runs(outcome: np.ndarray) -> list[tuple[int, int]]:
    """(first, end) index pairs of the candidate outages in outcome order: from a load error ("fail") to the
    next success ("ok"), or to the end of the run."""
    oks = np.flatnonzero(outcome == "ok")
    fails = np.flatnonzero(outcome == "fail")
    if not len(fails):
        return []
    after = np.searchsorted(oks, fails)  # the successes before each failure: one run per count
    firsts = fails[np.r_[True, after[1:] != after[:-1]]]
    ends = np.searchsorted(oks, firsts)
    return [(int(f), int(oks[e]) if e < len(oks) else len(outcome)) for f, e in zip(firsts, ends)]


def find_outage(df: pd.DataFrame, table: pd.DataFrame, slo: Slo, run_started_at: float | None,
                run_dir: Path | None = None) -> Outage | None:
    """summary.json's `outage`, or None when the errors (if any) did not begin at a moment.

    `table`: the steps (their load levels); `run_dir`: where to read the channel's words (none: no words)."""
    done = df[~df["in_flight"]].sort_values("finished_at", kind="stable")
    if len(done) < MIN_FAILURES + MIN_SERVED_BEFORE:
        return None
    kinds = done["error_kind"].astype(str).to_numpy()
    is_ok = done["status"].eq("ok").to_numpy()
    counts = np.isin(kinds, sorted(ek.LOAD_KINDS - _NOT_OUTAGE)) & ~is_ok
    # Configuration and input errors are neither: they say nothing about whether the channel is up.
    outcome = np.where(is_ok, "ok", np.where(counts, "fail", "other"))
    for first, end in _failure_runs(outcome):
        failed = done.iloc[first:end][counts[first:end]]
        # As many failures as half the users then (each had a request in flight), and almost nothing else.
        enough = max(MIN_FAILURES, int(failed["active_users"].iloc[0]) // 2)
        if len(failed) < enough or len(failed) < FAILED_SHARE * (end - first):
            continue
        found = _judge(done.iloc[:first], failed, slo)
        if found is not None:
            return _describe(found, failed, done.iloc[end] if end < len(done) else None, table, run_started_at,
                             run_dir)
    return None


def _judge(earlier: pd.DataFrame, failed: pd.DataFrame, slo: Slo) -> dict[str, Any] | None:
    """The run of failures as an outage (when, at which level, what was served there before), or None.

    `earlier`: the requests whose outcome was known before the run of failures began."""
    began = float(np.min(_began(failed)))
    first = failed.iloc[0]  # in the order outcomes were known
    before = earlier[earlier["step"] == first["step"]]
    served = before[before["status"].eq("ok")]
    load_errors = before["error_kind"].astype(str).isin(sorted(ek.LOAD_KINDS)) & before["status"].eq("error")
    level_served = len(served) >= MIN_SERVED_BEFORE and load_errors.sum() <= slo.max_error_rate * max(len(before), 1)
    # A port that stopped listening after it had answered went down whatever the load (an overloaded server
    # queues, times out or pushes back; it does not close its port): the run's earlier successes show it was up,
    # when the failures began at a level too new to have served (a search's next probe, a ramp's step).
    refused = failed["error_kind"].astype(str).eq(ek.CONNECTION_REFUSED).mean() >= 0.5
    whole_run = not level_served and refused and int(earlier["status"].eq("ok").sum()) >= MIN_SERVED_BEFORE
    if whole_run:
        served = earlier[earlier["status"].eq("ok")]
    elif not level_served:
        return None
    timeouts = failed["error_kind"].astype(str).isin(sorted(_TIMEOUTS))
    if timeouts.any():
        waited = (failed.loc[timeouts, "finished_at"] - failed.loc[timeouts, "started_at"]).min()
        recent = served.tail(max(MIN_SERVED_BEFORE, 2 * int(first["active_users"] or 1)))
        if not recent["ttft_s"].quantile(0.95) < ABRUPT_SHARE * waited:
            return None
    return {"began": began, "step": int(first["step"]), "active_users": int(first["active_users"]),
            "served_before": int(len(served)), "whole_run": whole_run}


def channel_words(run_dir: Path | None, since: float = -np.inf,
                  until: float | None = None) -> dict[str, tuple[int | None, str | None]]:
    """Each error kind's (HTTP status, message) most often given between `since` and `until` (finished_at), read
    from requests.parquet (the analysis frame holds no messages): an outage's words, and the diagnosis's."""
    if run_dir is None or not (run_dir / REQUESTS_FILE).exists():
        return {}
    import pyarrow.parquet as pq

    path = run_dir / REQUESTS_FILE
    if not {"error_message", "http_status", "finished_at"} <= set(pq.read_schema(path).names):
        return {}
    said: dict[str, Counter[tuple[int, str]]] = {}
    for rows in chunks(path, ["error_kind", "http_status", "error_message", "finished_at"]):  # a long run's too
        rows = rows[rows["error_kind"].notna() & (rows["finished_at"] >= since)
                    & (rows["finished_at"] <= (until if until is not None else np.inf))]
        for kind, group in rows.groupby("error_kind"):
            said.setdefault(str(kind), Counter()).update(zip(group["http_status"].fillna(-1).astype(int),
                                                             group["error_message"].fillna("")))
    words = {}
    for kind in sorted(said):
        (status, message), _ = said[kind].most_common(1)[0]
        words[kind] = (None if status < 0 else int(status)), (message or None)
    return words


def _describe(found: dict[str, Any], failed: pd.DataFrame, recovered: pd.Series | None, table: pd.DataFrame,
              run_started_at: float | None, run_dir: Path | None) -> Outage:
    zero = run_started_at if run_started_at is not None else float(failed["started_at"].min())
    began = found["began"]
    by_kind = failed["error_kind"].astype(str).value_counts()
    ended = None if recovered is None else float(recovered["finished_at"])
    kind = str(by_kind.index[0])
    status, message = channel_words(run_dir, began, ended).get(kind, (None, None))
    step = found["step"]
    row = table.loc[step] if step in table.index else None
    level = (level_text(row["load_level"], str(row["load_unit"])) if row is not None
             else level_text(found["active_users"], "users"))
    kinds_text = ", ".join(f"{n} {kind}" for kind, n in by_kind.items())
    span = ("until the end of the run" if ended is None
            else f"until it served again at {ended - zero:.1f} s")
    said = ""
    if message:
        who = "the channel said" if status is not None else "the client saw"
        said = f"; {who}{f' (HTTP {status})' if status is not None else ''}: \"{message[:300]}\""
    where = "in the run" if found["whole_run"] else "there"
    verdict = (f"the channel went down at {began - zero:.1f} s (step {step} at {level}; "
               f"{found['served_before']} requests had succeeded {where} before): from then {span} {len(failed)} requests "
               f"failed ({kinds_text}){said}. An outage, not a breakpoint: the errors began at a moment, not with "
               "the load")
    fix = (RELAY_BACKEND_DOWN if message and upstream_failure(status, message)
           else fix_for(kind, message) or "check the channel's logs for the moment it went down")
    advice = f"the channel went down at {began - zero:.1f} s ({kind}): {fix}; then run again"
    return {"at_s": round(began - zero, 3), "at": began, "step": found["step"], "active_users": found["active_users"],
            "served_before": found["served_before"], "failed": int(len(failed)),
            "errors_by_kind": {str(k): int(v) for k, v in by_kind.items()},
            "recovered_at_s": None if ended is None else round(ended - zero, 3),
            "http_status": status, "message": message, "verdict": verdict, "advice": advice}
