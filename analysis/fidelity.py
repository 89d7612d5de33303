"""Channel fidelity over a run: does the channel do what its answers say?

A relay can lie where a client cannot see the model: it ignores `max_tokens`
(more tokens than asked), reports fewer output tokens in its usage than it
streamed token deltas (each delta carries at least one token; more usage than
deltas is normal, a delta may carry several), or holds the response headers
until the first token (TTFB = TTFT: the client cannot tell network from
model). Each is counted over the run's successful requests; the verdict names
those seen, and they describe the channel, not the load.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tokenload.contracts.summary import Fidelity, Summary

# Headers held until the first token: judged on requests whose TTFT is at least this long (s), counted when
# the headers came within this share of TTFT before the first token, and a finding when most requests did so.
HEADER_HOLD_MIN_TTFT_S = 0.1
HEADER_HOLD_SHARE = 0.1
HEADER_HOLD_MAJORITY = 0.5


def _numbers(df: pd.DataFrame, column: str) -> np.ndarray:
    if column not in df:
        return np.full(len(df), np.nan)
    return pd.to_numeric(df[column], errors="coerce").to_numpy(dtype=float)


def fidelity_summary(df: pd.DataFrame) -> Fidelity:
    """summary.json's `fidelity` block: counts of each kind of unfaithful answer and the findings they make."""
    ok = df[df["status"].eq("ok").to_numpy() & ~df["in_flight"].to_numpy()]
    chunks, usage, asked = _numbers(ok, "chunks"), _numbers(ok, "output_tokens"), _numbers(ok, "max_tokens")
    from_server = (ok["output_tokens_source"].astype("string").fillna("") != "chunks").to_numpy() \
        if "output_tokens_source" in ok else np.zeros(len(ok), dtype=bool)
    got = np.fmax(chunks, np.where(from_server, usage, np.nan))
    over = int(np.sum(got > asked))
    below = int(np.sum(from_server & (usage < chunks)))
    ttfb, ttft = _numbers(ok, "ttfb_s"), _numbers(ok, "ttft_s")
    judged = ttft >= HEADER_HOLD_MIN_TTFT_S
    held = int(np.sum(judged & (ttft - ttfb <= HEADER_HOLD_SHARE * ttft)))
    findings = []
    if over:
        findings.append(f"the channel ignores max_tokens: {over} of {len(ok)} answers had more tokens than asked")
    if below:
        findings.append(f"its usage undercounts: {below} answers reported fewer output tokens than token deltas "
                        "streamed")
    if judged.sum() and held >= HEADER_HOLD_MAJORITY * judged.sum():
        findings.append(f"response headers came only with the first token in {held} of {int(judged.sum())} answers "
                        "(TTFB = TTFT): a relay buffers the response start")
    return {"requests": len(ok), "max_tokens_exceeded": over, "usage_below_deltas": below,
            "headers_held": held, "headers_judged": int(judged.sum()), "findings": findings}


def verdict_rows(summary: Summary) -> list[tuple[str, str, bool | None]]:
    """The verdict table's "Channel fidelity" row, only when something was found."""
    f = summary.get("fidelity")
    return [("Channel fidelity", "; ".join(f["findings"]), False)] if f and f["findings"] else []
