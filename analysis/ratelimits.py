"""Rate-limit headroom: the limits a channel announced, how close the run came, where limiting began.

The load side records, per request, the rate-limit values its response carried
(`rl_requests_limit`, `rl_requests_remaining`, `rl_tokens_limit`,
`rl_tokens_remaining`: Anthropic's `anthropic-ratelimit-*` or OpenAI's
`x-ratelimit-*`, read by `tokenload.load.pacing`), the wait a push-back caused
(`backoff_s`) and the time each request was held at the client's gate
(`held_s`). This module turns them into `summary.json`'s `rate_limits` and the
report's "Rate limits" section, so a user can tell "the channel was slow" from
"we were told to wait", and how much of the plan's quota a load level uses.

Limits are per minute, as both vendors document them. Runs recorded before
these columns existed (or against a channel that sends no such headers) get
`seen: false` and a note instead of numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload import errors as ek
from tokenload.analysis.records import chunks
from tokenload.contracts.summary import LowestRemaining, RateLimits
from tokenload.rundir import REQUESTS_FILE

COLUMNS = ("step", "started_at", "finished_at", "worker", "error_kind", "in_flight", "rl_requests_limit",
           "rl_requests_remaining", "rl_tokens_limit", "rl_tokens_remaining", "backoff_s", "held_s", "retry_of")


def _int(value: Any) -> int | None:
    return None if value is None or pd.isna(value) else int(value)


def _lowest(df: pd.DataFrame, what: str) -> LowestRemaining | None:
    """The lowest remaining value of one limit, as a count and a share of the limit, with its step."""
    rows = df.dropna(subset=[f"rl_{what}_remaining", f"rl_{what}_limit"])
    rows = rows[rows[f"rl_{what}_limit"] > 0]
    if rows.empty:
        return None
    share = rows[f"rl_{what}_remaining"] / rows[f"rl_{what}_limit"]
    at = share.idxmin()
    return {"remaining": _int(rows.at[at, f"rl_{what}_remaining"]), "limit": _int(rows.at[at, f"rl_{what}_limit"]),
            "share": round(float(share[at]), 4), "step": _int(rows.at[at, "step"])}


def told_to_wait_s(df: pd.DataFrame, end: float | None) -> float:
    """Seconds during which a process was holding back as told, summed over processes.

    Each push-back holds every user of its process from the response's end for
    `backoff_s`; overlapping holds (several users pushed back at once) count once,
    and a hold is cut at the run's end.
    """
    rows = df.dropna(subset=["backoff_s"])
    total = 0.0
    for _, group in rows.groupby("worker"):
        start = group["finished_at"].fillna(group["started_at"]).to_numpy()
        stop = start + group["backoff_s"].to_numpy()
        if end is not None:
            stop = stop.clip(max=end)
        covered_to = float("-inf")
        for a, b in sorted(zip(start, stop)):
            a = max(a, covered_to)
            if b > a:
                total += b - a
                covered_to = b
    return total


def _rows(path: Path, columns: list[str]) -> tuple[pd.DataFrame, float, float, int]:
    """The records `rate_limits` looks at, read a chunk at a time (a long run is never whole in memory): the
    limited, overloaded and pushed-back ones, and each chunk's first lowest share and highest limit announced;
    with the first start, the seconds held and the retries of all of them."""
    kept, started_at, held_s, retries = [], np.inf, 0.0, 0
    for df in chunks(path, columns):
        started_at = min(started_at, float(df["started_at"].min()))
        held_s += float(df["held_s"].fillna(0).sum())
        retries += int(df["retry_of"].notna().sum()) if "retry_of" in df else 0
        keep = df["error_kind"].isin([ek.RATE_LIMITED, ek.OVERLOADED]) | df["backoff_s"].notna()
        for what in ("requests", "tokens"):
            limit, share = df[f"rl_{what}_limit"], df[f"rl_{what}_remaining"] / df[f"rl_{what}_limit"].where(
                lambda x: x > 0)
            keep |= df.index.isin([v.idxmax() if v is limit else v.idxmin() for v in (limit, share) if v.notna().any()])
        kept.append(df[keep])
    return pd.concat(kept, ignore_index=True), started_at, held_s, retries


def rate_limits(run_dir: str | Path, ended_at: float | None = None) -> RateLimits:
    """`summary.json`'s `rate_limits` for one run directory."""
    import pyarrow.parquet as pq

    path = Path(run_dir) / REQUESTS_FILE
    names = set(pq.read_schema(path).names) if path.exists() else set()
    if not {"rl_requests_limit", "backoff_s"} <= names:
        return {"seen": False, "note": "the run recorded no rate-limit information (recorded before tokenload kept it)"}
    df, started_at, held_s, retries = _rows(path, [c for c in COLUMNS if c in names])
    limited = df[df["error_kind"] == ek.RATE_LIMITED]
    overloaded = df[df["error_kind"] == ek.OVERLOADED]
    first = limited.sort_values("started_at").iloc[0] if len(limited) else None
    out: dict[str, Any] = {
        "seen": bool(df[["rl_requests_limit", "rl_tokens_limit"]].notna().any().any()),
        "requests_per_min": _int(df["rl_requests_limit"].max()),
        "tokens_per_min": _int(df["rl_tokens_limit"].max()),
        "lowest_requests_remaining": _lowest(df, "requests"),
        "lowest_tokens_remaining": _lowest(df, "tokens"),
        "rate_limited": len(limited),
        "overloaded": len(overloaded),
        "limited_from_step": _int(first["step"]) if first is not None else None,
        "limited_after_s": round(float(first["started_at"] - started_at), 3) if first is not None else None,
        "backoff_s": round(told_to_wait_s(df, ended_at), 3),
        "held_s": round(held_s, 3),
        "retries": retries,
    }
    if not out["seen"]:
        out["note"] = "the channel sent no rate-limit headers (anthropic-ratelimit-* or x-ratelimit-*)"
    return cast(RateLimits, out)


def rate_limits_html(limits: RateLimits) -> str:
    """The report's "Rate limits" section."""
    from tokenload.analysis.report import h, html_table

    if not limits.get("seen") and not limits.get("rate_limited"):
        return f"<p>{h(limits.get('note', 'no rate-limit information'))}</p>"

    def lowest(item: LowestRemaining | None) -> str:
        if not item:
            return "-"
        return f"{item['remaining']:,} of {item['limit']:,} ({item['share']:.0%}) at step {item['step']}"

    def per_min(value: int | None) -> str:
        return "not announced" if value is None else f"{value:,} per minute"

    step = limits.get("limited_from_step")
    rows = [
        ("requests limit", per_min(limits.get("requests_per_min"))),
        ("tokens limit", per_min(limits.get("tokens_per_min"))),
        ("lowest requests remaining", lowest(limits.get("lowest_requests_remaining"))),
        ("lowest tokens remaining", lowest(limits.get("lowest_tokens_remaining"))),
        ("429 rate limited", f"{limits['rate_limited']:,}"),
        ("overloaded (529/503)", f"{limits['overloaded']:,}"),
        ("limiting began", "never" if step is None else f"step {step}, {limits['limited_after_s']:.1f} s into the run"),
        ("held back as told (back-off)", f"{limits['backoff_s']:.1f} s"),
        ("held by our own gate", f"{limits['held_s']:.1f} s"),
        ("retries", f"{limits['retries']:,}"),
    ]
    return html_table(("", "value"), rows, left=2)
