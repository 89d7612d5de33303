"""The server's side of each step: its own gauges and histograms beside the client's numbers.

`tokenload run` samples the inference server's Prometheus metrics into
server_metrics.parquet (tokenload.servermetrics). Here each step's window gets
`steps[].server` (the contract keys, only those the server reports:
`running_mean`, `waiting_mean`, `kv_cache_usage_mean`, `queue_time_p50_s`,
`server_ttft_p50_s`, `client_minus_server_ttft_p50_s`), and the step where the
channel broke (or the highest load) is explained from the server's side when
its numbers show a cause: every batch slot busy with requests waiting, a full
KV cache, or a server TTFT that stayed flat while the client's grew (the time
is added between the client and the server: a relay, a gateway, the network).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import inf
from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.analysis.records import Run
from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import ServerCause, ServerMetrics, StepServer, Summary
from tokenload.rundir import SERVER_METRICS_FILE
from tokenload.servermetrics import series

STEP_KEYS = ("running_mean", "waiting_mean", "kv_cache_usage_mean", "queue_time_p50_s", "server_ttft_p50_s",
             "client_minus_server_ttft_p50_s")
# A step's requests "waited" when on average at least this many were queued on the server.
WAITING_MIN = 0.5
# The KV cache counts as full from this share on.
KV_FULL = 0.95
# The server's TTFT "stayed" while it grew by at most this factor, and the client's "grew" by at least this one...
SERVER_FLAT = 1.5
CLIENT_GREW = 1.5
# ...and the time outside the server is at least this share of the client's TTFT.
OUTSIDE_SHARE = 0.5


def _r(x: float | None) -> float | None:
    return None if x is None or x != x else float(f"{x:.6g}")


def _count(x: float) -> str:
    """'4' for 3.96, '3.5' for 3.5: a mean of requests, said as a count where it is one."""
    return f"{x:.0f}" if abs(x - round(x)) < 0.15 else f"{x:.1f}"


def _step(df: pd.DataFrame, start: float, end: float, client_ttft: float | None) -> tuple[StepServer, dict[str, Any]]:
    """(the contract keys, the other numbers) of one window."""
    keys: dict[str, Any] = {}
    more: dict[str, Any] = {}
    for term in ("running", "waiting", "kv_cache_usage"):
        got = series.window_gauge(df, term, start, end)
        if got is not None:
            keys[f"{term}_mean"] = _r(got[0])
            more[f"{term}_max"] = _r(got[1])
            more["scrapes"] = got[2]
    for term, key in (("queue_time", "queue_time_p50_s"), ("server_ttft", "server_ttft_p50_s"),
                      ("prefill_time", "prefill_time_p50_s"), ("decode_time", "decode_time_p50_s")):
        quantile = series.window_quantile(df, term, start, end, 0.5)
        if quantile is not None:
            (keys if key in STEP_KEYS else more)[key] = _r(quantile.value)
            more[f"{term}_n"] = quantile.n
            # the estimate is only as fine as the server's buckets: the one it lies in says how fine
            more[f"{term}_p50_bucket_s"] = [_r(quantile.lower), None if quantile.upper == inf else quantile.upper]
    if keys.get("server_ttft_p50_s") is not None and client_ttft is not None:
        keys["client_minus_server_ttft_p50_s"] = _r(client_ttft - keys["server_ttft_p50_s"])
    for term in ("prompt_tokens", "generation_tokens", "preemptions"):
        rate = series.window_rate(df, term, start, end)
        if rate is not None:
            more[f"{term}_per_s"] = _r(rate)
    return cast(StepServer, {k: keys[k] for k in STEP_KEYS if k in keys}), more


def _cause(details: dict[int, dict[str, Any]], at: Mapping[str, Any], low: Mapping[str, Any]) -> ServerCause | None:
    """The server-side reason for the latency at step `at`, compared with the lowest-load step `low`."""
    server, more = at.get("server") or {}, details.get(at["step"], {})
    load = level_text(at["load_level"], at["load_unit"])
    kv = more.get("kv_cache_usage_max")
    if kv is not None and kv >= KV_FULL:
        preempted = more.get("preemptions_per_s") or 0.0
        tail = ("requests were preempted" if preempted > 0 else
                "new requests had to wait for cache space") + ": shorter prompts or outputs, or fewer users, fit it"
        return {"kind": "kv_cache", "step": at["step"], "text": f"at {load} the KV cache reached {100 * kv:.0f}%: {tail}"}
    waiting, running = server.get("waiting_mean"), server.get("running_mean")
    if waiting is not None and running is not None and waiting >= WAITING_MIN:
        queue = server.get("queue_time_p50_s")
        grew = (f" (the server's queue time p50 {queue:.2g} s)" if queue is not None else "")
        return {"kind": "queue", "step": at["step"],
                "text": f"at {load} {_count(running)} requests ran and {_count(waiting)} waited: every batch slot was "
                        f"busy, TTFT grew by the queue time{grew}; the server's capacity sets this limit: keep "
                        f"concurrency near {_count(running)} or give the server more slots or replicas"}
    s_at, s_low = server.get("server_ttft_p50_s"), (low.get("server") or {}).get("server_ttft_p50_s")
    c_at, c_low = at.get("ttft_p50_s"), low.get("ttft_p50_s")
    if (s_at is not None and s_low is not None and c_at is not None and c_low is not None
            and at["step"] != low["step"] and c_low > 0 and s_low > 0):
        # the server's p50 is at most its bucket's upper bound: the gap must hold against that, not the estimate
        upper = (more.get("server_ttft_p50_bucket_s") or [None, None])[1]
        if (c_at >= CLIENT_GREW * c_low and s_at <= SERVER_FLAT * s_low and upper is not None
                and c_at - upper >= OUTSIDE_SHARE * c_at):
            return {"kind": "between", "step": at["step"],
                    "text": f"the server's own TTFT stayed at {s_at:.2g} s while the client's grew to {c_at:.2g} s "
                            f"at {load}: the time is added between you and the server (a relay, gateway or the "
                            "network), not by the server"}
    return None


# A scrape this close to a request's first token or end cannot tell on which side the server counted it.
GUARD_S = 0.1
# The server's own time to a first token, best first: (term, part, in words).
SERVER_TIMES = (("server_ttft", "sum", "the server's TTFT histogram"),
                ("prefill_seconds", "value", "llama.cpp's prompt_seconds_total"))


@dataclass(frozen=True)
class Outside:
    """Per block of scrapes: our requests' TTFT summed, less the server's own time for them (seconds), and how
    many requests; the time their first tokens spent outside the server (a relay, the network, the client)."""

    seconds: np.ndarray
    requests: np.ndarray
    source: str

    @property
    def mean_s(self) -> float:
        return float(self.seconds.sum() / self.requests.sum())


def outside_server(run: Run, start: float, end: float) -> Outside | None:
    """The time our requests' first tokens spent outside the server in [start, end), from its own metrics.

    The server's counters only say how much it counted between two scrapes, so the window is cut at the
    scrapes no request straddles (from its first token, or its send without one, to its end, `GUARD_S`
    either side: a server counts a request at one of those) into blocks of whole requests; a block's client TTFT sum less the server's own time (its TTFT histogram's `_sum`, whose
    `_count` must be our requests; else llama.cpp's prompt seconds, added as each request ends) is what its
    requests spent outside. A block with a failed request or another client's is left out. None without
    the server's metrics or a block.
    """
    raw = series.load(run.run_dir / SERVER_METRICS_FILE)
    if raw is None or raw.empty:
        return None
    df = series.mapped(raw)
    found = next(((term, part, source) for term, part, source in SERVER_TIMES
                  if len(series.cumulative(df, term, part))), None)
    if found is None:
        return None
    term, part, source = found
    totals = series.cumulative(df, term, part)
    counts = series.cumulative(df, term, "count") if part == "sum" else None
    recs = run.df
    first = (recs["started_at"] + recs["ttft_s"]).fillna(recs["started_at"])
    lo = first.to_numpy(dtype=float) - GUARD_S
    hi = np.where(recs["in_flight"].to_numpy(), np.inf, recs["finished_at"].to_numpy(dtype=float)) + GUARD_S
    times = totals.index.to_numpy(dtype=float)
    times = times[(times >= start) & (times <= end)]
    cuts = [t for t in times if not ((lo < t) & (t < hi)).any()]
    seconds, requests = [], []
    for a, b in zip(cuts, cuts[1:]):
        inside = (lo > a) & (hi <= b)
        members = recs[inside]
        if members.empty or not members["status"].eq("ok").all():
            continue
        if counts is not None and round(float(counts[b] - counts[a])) != len(members):
            continue
        server = float(totals[b] - totals[a])
        if server < 0:  # the server restarted: its counter began again
            continue
        seconds.append(float(members["ttft_s"].sum()) - server)
        requests.append(len(members))
    if not requests:
        return None
    return Outside(np.array(seconds), np.array(requests), source)


def attach(summary: Summary, run: Run, table: pd.DataFrame) -> None:
    """Add `steps[].server`, `server_metrics` and the server-side cause to a summary (in place)."""
    entry = run.manifest.get("server_metrics") or {}
    raw = series.load(run.run_dir / SERVER_METRICS_FILE)
    if raw is None or raw.empty or table.empty:
        summary["server_metrics"] = {"note": entry.get("note") or "no server metrics were sampled in this run"}
        return
    df = series.mapped(raw)
    details: dict[int, dict[str, Any]] = {}
    for record in summary["steps"]:
        row = table.loc[record["step"]]
        # the table's start already leaves the step's warm-up out, as the client's statistics do
        start, end = float(row["start"]), float(row["end"])
        record["server"], details[record["step"]] = _step(df, start, end, record.get("ttft_p50_s"))
    overview: ServerMetrics = {
        "sources": entry.get("sources") or sorted(raw["source"].unique()), "servers": entry.get("servers", []),
        "terms": series.terms(df), "raw_names": int(raw["name"].nunique()),
        "steps": [{"step": s, **d} for s, d in details.items()], "cause": None,
    }
    summary["server_metrics"] = overview
    measured = sorted((r for r in summary["steps"] if r.get("ok")), key=lambda r: (r["load_level"], r["step"]))
    if not measured:
        return
    bp = summary.get("breakpoint")
    at = next((r for r in measured if bp and r["step"] == bp["step"]), measured[-1])
    cause = _cause(details, at, measured[0])
    if cause is None:
        return
    overview["cause"] = cause
    if bp:
        bp["server_cause"] = cause["text"]
        bp["detail"] = f"{bp['detail']}; server side: {cause['text']}"
    diagnosis = summary["diagnosis"]
    diagnosis["server_cause"] = cause["text"]
    # first, unless errors bound the run: the channel's own failures stay the first fix
    at_index = 1 if diagnosis["bound"] == "errors" and diagnosis["advice"] else 0
    diagnosis["advice"] = [*diagnosis["advice"][:at_index], cause["text"], *diagnosis["advice"][at_index:]]
