"""Prompt caching: how much of the input the channel served from its cache, what it saved, and whether it works.

Coding assistants resend a long, stable prefix (system prompt, the conversation
so far) on every turn; a channel that honours prompt caching reads that prefix
from its cache and answers sooner. A relay that strips Anthropic's
`cache_control`, or routes each turn to another backend, silently loses that.

The verdict needs requests that *could* hit: turns after the first of a
session (their prefix was sent one turn earlier). Evidence, strongest first:
the server's usage fields (`cache_read_input_tokens`, OpenAI's `cached_tokens`)
on those turns; without them, whether later turns' TTFT falls below first
turns' although their context is longer. With no repeat turn there is nothing
to judge, and the summary says so instead of guessing, whatever the usage
fields say: llama.cpp reports one cached token (the shared first token) on
nearly every request, which is no evidence of caching. For the same reason a
request counts as a cache hit only when it read a real share of its input.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.contracts.summary import Caching, Summary

# Share of a later turn's input read from the cache above which caching counts as honoured.
HONOURED_HIT_RATIO = 0.5
# Below this share of its input a cache read is noise (a server's shared first token), not a hit;
# later turns reading less than this share overall do not use the cache at all.
MIN_HIT_SHARE = 0.05
# Without usage fields: later turns' median TTFT at most this fraction of first turns' counts as a cache gain.
TTFT_GAIN_RATIO = 0.7


def _median(values: pd.Series) -> float | None:
    arr = values.dropna().to_numpy(dtype=float)
    return float(f"{np.median(arr):.6g}") if arr.size else None


def _ratio(num: float, den: float) -> float | None:
    return float(f"{num / den:.4g}") if den > 0 else None


def caching_summary(df: pd.DataFrame) -> Caching | None:
    """summary.json's `caching` block, or None for runs recorded without cache columns."""
    if "cache_read_input_tokens" not in df:
        return None
    ok = df[df["status"].eq("ok").to_numpy() & ~df["in_flight"].to_numpy()]
    read = pd.to_numeric(ok["cache_read_input_tokens"], errors="coerce")
    created = pd.to_numeric(ok["cache_creation_input_tokens"], errors="coerce")
    reported = bool(read.notna().any())
    turn = pd.to_numeric(ok["turn"], errors="coerce") if "turn" in ok else pd.Series(np.nan, index=ok.index)
    later, first = ok[turn.gt(1).to_numpy()], ok[turn.eq(1).to_numpy()]
    inputs = ok["input_tokens"].fillna(0)
    hits = (read.fillna(0) > 0) & (read.fillna(0) >= MIN_HIT_SHARE * inputs)
    out: dict[str, Any] = {
        "usage_reported": reported,
        "requests": len(ok),
        "requests_with_cache_reads": int(hits.sum()),
        "cache_read_tokens": int(read.fillna(0).sum()),
        "cache_creation_tokens": int(created.fillna(0).sum()),
        "input_tokens": int(inputs.sum()),
        "hit_ratio": _ratio(float(read.fillna(0).sum()), float(inputs.sum())) if reported else None,
        "later_turns": len(later),
        "later_turns_hit_ratio": (_ratio(float(read[later.index].fillna(0).sum()), float(inputs[later.index].sum()))
                                  if reported else None),
        "ttft_p50_cached_s": _median(ok.loc[hits, "ttft_s"]) if reported else None,
        "ttft_p50_uncached_s": _median(ok.loc[~hits, "ttft_s"]) if reported else None,
        "ttft_p50_first_turn_s": _median(first["ttft_s"]),
        "ttft_p50_later_turns_s": _median(later["ttft_s"]),
    }
    out["honoured"], out["verdict"] = _verdict(out)
    return cast(Caching, out)


def _verdict(c: dict[str, Any]) -> tuple[bool | None, str]:
    """(honoured: True / False / None when it cannot be told, one sentence)."""
    first, later = c["ttft_p50_first_turn_s"], c["ttft_p50_later_turns_s"]
    ttft = (f"; TTFT p50 {later:.3g} s on later turns vs {first:.3g} s on first turns"
            if first is not None and later is not None else "")
    if c["later_turns"] == 0:
        return None, ("cannot tell: no request repeated an earlier prefix (use a [session] scenario, "
                      "e.g. coding-session, to test prompt caching)")
    ratio = c["later_turns_hit_ratio"]
    if ratio is not None:
        if ratio >= HONOURED_HIT_RATIO:
            return True, (f"honoured: later turns read {100 * ratio:.0f}% of their input from the cache "
                          f"(hit ratio over all requests {100 * (c['hit_ratio'] or 0):.0f}%){ttft}")
        if ratio < MIN_HIT_SHARE:
            read = f" (they read {100 * ratio:.2g}% of their input: noise, not hits)" if ratio else ""
            return False, (f"NOT honoured: {c['later_turns']} later turns resent a prefix and none read it from "
                           f"the cache{read}{ttft}; a relay may strip cache_control or spread turns over backends")
        return False, (f"partly honoured: later turns read only {100 * ratio:.0f}% of their input from the "
                       f"cache{ttft}")
    if first is None or later is None:
        return None, "cannot tell: the channel reports no cache usage and too few turns succeeded"
    if later <= TTFT_GAIN_RATIO * first:
        return True, f"probably honoured (the channel reports no cache usage fields){ttft}"
    return False, f"probably NOT honoured (no cache usage fields, and later turns are not faster){ttft}"


def verdict_rows(summary: Summary) -> list[tuple[str, str, bool | None]]:
    """The verdict table's caching row, when the run has cache columns."""
    c = summary.get("caching")
    return [("Prompt caching", c["verdict"], c["honoured"])] if c else []


def report_rows(summary: Summary) -> list[list[Any]]:
    """report.html's "Prompt caching" table, as (label, value) rows; empty without cache columns."""
    c = summary.get("caching")
    if not c:
        return []
    return [["verdict", c["verdict"]], ["usage fields reported", "yes" if c["usage_reported"] else "no"],
            ["cache hit ratio (all requests)", _share(c["hit_ratio"])],
            ["cache hit ratio (later turns)", _share(c["later_turns_hit_ratio"])],
            [f"requests with cache hits (≥ {100 * MIN_HIT_SHARE:.0f}% of their input)", f"{c['requests_with_cache_reads']} of {c['requests']}"],
            ["tokens read / written / input",
             f"{c['cache_read_tokens']:,} / {c['cache_creation_tokens']:,} / {c['input_tokens']:,}"],
            ["TTFT p50 with / without cache reads (s)", f"{_num(c['ttft_p50_cached_s'])} / {_num(c['ttft_p50_uncached_s'])}"],
            ["TTFT p50 first / later turns (s)",
             f"{_num(c['ttft_p50_first_turn_s'])} / {_num(c['ttft_p50_later_turns_s'])}"]]


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.3g}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
