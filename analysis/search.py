"""summary.json's `search`: a searched run's capacity, where the boundary lies, and how the probes went.

The run decided each probe live (`tokenload.search.evidence`, from the counts
every process sent the master) and wrote its record to RUN_DIR/search.json.
Here every probe of this run is recounted from its own records (the probe's
step, warm-up rows already dropped by `records.load_run`) against the same
SLO, so `n`, `attainment` and its interval are the records' truth; the
verdicts stay the ones the run acted on. Probes of earlier runs that a
`--resume` continued keep the numbers their run recorded.

The answer: `capacity` (the highest passing level below every failing one),
`first_failing` (decided), `interval` ([capacity, the lowest level that failed
or stayed undecided below the target]: the boundary lies there), `binding` (the SLO term the first failing level missed most), `served`
(the most streams a failing level showed the channel running at once while other requests waited: its
slot count, when it has slots), `shape` ("cliff" or "gradual"), the probes in order, and the tokens and time spent.
The tokens are every token the run sent and received (input and output of every record: the counted requests,
the warm-up ones and those cut open), split into those three parts, per probe and in all.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.analysis.records import Run
from tokenload.analysis.steps import METRICS, PERCENTILES, latency_stats, pkey
from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import EdgeLevel, ProbeRow, SearchSummary
from tokenload.search.bisect import Probe, Search
from tokenload.search.evidence import Evidence, wilson_interval
from tokenload.search.resume import SEARCH_FILE
from tokenload.slo import COLUMN, LABEL, Slo


def _level(value: float | None, over: str) -> float | int | None:
    if value is None:
        return None
    return int(value) if over == "users" else value


def _unit(over: str) -> str:
    return "users" if over == "users" else "req/s"


def _recount(rows: pd.DataFrame, slo: Slo) -> Evidence:
    evidence = Evidence()
    for record in rows.to_dict("records"):
        evidence.count(slo, {str(k): (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()})
    return evidence


def _waited(rows: pd.DataFrame) -> pd.Series:
    """Each request's TTFT, or for a stream the run cut before its first token how long it had waited (until
    its `cut_at`): a lower bound."""
    cut = rows["in_flight"].astype(bool) & rows["ttft_s"].isna()
    waited = rows["cut_at"].astype(float) - rows["started_at"].astype(float)
    return rows["ttft_s"].astype(float).where(~cut, waited)


def _judged_at(rows: pd.DataFrame, slo: Slo) -> pd.Series:
    """When the run counted each request: its record's `judged_at`, or for a run without it, at its end or
    (its first token late for the SLO, or in time for an SLO of TTFT alone) `ttft_s` after it was sent,
    whichever came first."""
    at = rows["finished_at"].astype(float).fillna(rows["started_at"].astype(float))
    if slo.ttft_s is not None:
        deadline = rows["started_at"].astype(float) + slo.ttft_s
        if slo.first_token_decides:
            at = at.where(at < deadline, deadline)
        else:
            at = at.where(~(_waited(rows) > slo.ttft_s), deadline)
    if "judged_at" in rows:
        return rows["judged_at"].astype(float).fillna(at)
    return at


def _trial_rows(rows: pd.DataFrame, slo: Slo, probes: list[Probe], i: int) -> pd.DataFrame:
    """The rows of probe `i`'s step that its verdict counted: judged before it was decided and, for a second
    trial held on in its first trial's step (a run of an earlier version), after the first trial's decision.
    A probe recorded without its decision's time (an older run) keeps every row of its trial's span."""
    p = probes[i]
    same = [q for q in probes if q.step == p.step and q.run_id == p.run_id]
    k = next(j for j, q in enumerate(same) if q is p)
    at = _judged_at(rows, slo)
    if p.decided_at:
        since = same[k - 1].decided_at if k else -math.inf
        return rows[(at > since) & (at <= p.decided_at)]
    if len(same) < 2:
        return rows
    since = same[k].started_at if k else -math.inf
    until = same[k + 1].started_at if k + 1 < len(same) else math.inf
    return rows[(at >= since) & (at < until)]


SPEND_PARTS: tuple[str, ...] = ("counted", "warmup", "cut", "storm_probe")


def _spend(run: Run) -> pd.DataFrame:
    """Every record of the run, warm-up ones and storm probes included: its step, when it was sent, its tokens
    (input + output) and which part of the spend it is (`SPEND_PARTS`: a measured request that ended, a warm-up
    one, one cut open, an error-storm probe)."""
    frames = []
    for rows in (run.df, run.aside):
        if len(rows):
            tokens = rows["input_tokens"].fillna(0.0) + rows["output_tokens"].fillna(0.0)
            phase = rows["phase"].astype("object").to_numpy() if "phase" in rows else np.full(len(rows), None)
            aside = np.isin(phase, SPEND_PARTS)
            part = np.where(rows["in_flight"].to_numpy(), "cut", np.where(aside, phase, "counted"))
            frames.append(pd.DataFrame({"step": rows["step"], "started_at": rows["started_at"], "tokens": tokens,
                                        "part": part}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        {"step": [], "started_at": [], "tokens": [], "part": []})


def _split(spend: pd.DataFrame) -> dict[str, int]:
    by_part = spend.groupby("part")["tokens"].sum()
    return {part: int(by_part.get(part, 0)) for part in SPEND_PARTS}


def _trial_spend(spend: pd.DataFrame, probes: list[Probe], i: int) -> pd.DataFrame:
    """Probe `i`'s share of its step's spend: all of it, or where trials share the step (`_trial_rows`), what was
    sent from this trial's start to the next one's (the step's warm-up goes to the first)."""
    p = probes[i]
    rows = spend[spend["step"].eq(p.step)]
    same = [q for q in probes if q.step == p.step and q.run_id == p.run_id]
    if len(same) < 2:
        return rows
    k = next(j for j, q in enumerate(same) if q is p)
    since = same[k].started_at if k else -math.inf
    until = same[k + 1].started_at if k + 1 < len(same) else math.inf
    return rows[(rows["started_at"] >= since) & (rows["started_at"] < until)]


def _why(rows: pd.DataFrame, slo: Slo) -> str:
    """Why the records' count of a probe differs from the run's: requests its first token decided in flight
    whose records say otherwise."""
    if "judged_in_flight" not in rows or slo.ttft_s is None:
        return ""
    how = rows["judged_in_flight"]
    read_late = int((how.eq("late") & (rows["ttft_s"].astype(float) <= slo.ttft_s)).sum())
    failed = int((how.eq("on_time") & rows["status"].ne("ok")).sum())
    reasons = ([f"{read_late} counted late had their first token in time by its arrival stamp (read late: the "
                "load generator lagged)"] if read_late else []) + \
              ([f"{failed} counted at a first token in time failed later"] if failed else [])
    return f": {'; '.join(reasons)}" if reasons else ""


def _binding_detail(rows: pd.DataFrame, binding: str | None, slo: Slo) -> str:
    """`TTFT p90 1.1 s > 0.5 s`: the binding term's value at the target share (what the SLO asks of it), over
    the requests the verdict counted; `≥` when some of them were cut still waiting for their first token
    (their wait until the cut is a lower bound)."""
    if binding is None:
        return "no SLO term decided it"
    if binding == "errors":
        n = len(rows)
        errors = int(rows["status"].ne("ok").sum()) if n else 0
        return f"load errors {errors} of {n} requests > {slo.max_error_rate:.0%}"
    limit = slo.thresholds.get(binding)
    ok = rows[rows["status"].eq("ok")] if len(rows) else rows
    finished = ok[~ok["in_flight"].astype(bool)] if len(ok) else ok
    values = finished[COLUMN[binding]].dropna().to_numpy(dtype=float) if len(finished) else np.array([])
    censored = np.array([])
    if binding == "ttft" and limit is not None and len(ok):
        cut = ok[ok["in_flight"].astype(bool)]
        waited = _waited(cut)
        # counted as the run counted them: a first token (in time or late), or a wait past the limit
        values = np.concatenate([values, cut["ttft_s"].dropna().to_numpy(dtype=float)])
        censored = waited[cut["ttft_s"].isna() & (waited > limit)].to_numpy(dtype=float)
    pct = round(100 * slo.target)
    every = np.concatenate([values, censored])
    if not len(every) or limit is None:
        return f"{LABEL[binding]} over {limit:g} s" if limit is not None else LABEL[binding]
    bound = "≥ " if len(censored) else ""
    value = float(np.percentile(every, pct))
    if value <= limit and not bound:  # the term held where its values are known: the failed requests missed
        errors = int(rows["status"].ne("ok").sum())
        return (f"{errors} of {len(rows)} requests failed, each a miss; {LABEL[binding]} p{pct} of the rest "
                f"{value:.3g} s within {limit:g} s")
    return f"{LABEL[binding]} p{pct} {bound}{value:.3g} s > {limit:g} s"


def search_summary(run: Run, slo: Slo, percentiles: Sequence[float] = PERCENTILES) -> SearchSummary | None:
    """The `search` block of a searched run (None for any other run); each probe of this run with the
    `percentiles` of its own requests' latencies (censoring-aware, `steps.latency_stats`)."""
    path = Path(run.run_dir) / SEARCH_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    search = Search.from_dict(data)
    over = search.over
    run_id = run.manifest.get("run_id")
    df = run.df
    probes: list[ProbeRow] = []
    details: dict[float, str] = {}
    spend = _spend(run)
    earlier = 0  # tokens of the probes an earlier run (`--resume`) decided, as that run counted them
    for i, p in enumerate(search.probes):
        entry: dict[str, Any] = dict(_probe_entry(p, over))
        entry["this_run"] = not p.run_id or p.run_id == run_id
        if entry["this_run"] and "step" in df:
            rows = _trial_rows(df[df["step"].eq(p.step)], slo, search.probes, i)
            ev = _recount(rows, slo)
            ci = wilson_interval(ev.met, ev.judged)
            split = _split(_trial_spend(spend, search.probes, i))
            entry.update(n=ev.judged, attainment=ev.attainment, ci=list(ci) if ci else None,
                         goodput_rps=ev.met / p.duration_s if p.duration_s else None,
                         tokens=sum(split.values()), tokens_split=split, **_latency(rows, run.cut, percentiles))
            if p.decided_at and (ev.judged, ev.met) != (p.n, round((p.attainment or 0.0) * p.n)):
                entry["recount"] = (f"the run decided on {p.n} requests ({_share(p.attainment)}); its records "
                                    f"hold {ev.judged} ({_share(ev.attainment)}) judged by then{_why(rows, slo)}")
            details[p.level] = _binding_detail(rows, p.binding, slo)
            if p.verdict == "fail":
                entry["binding_detail"] = details[p.level]
        else:
            earlier += p.tokens
        probes.append(cast(ProbeRow, entry))
    capacity, first_failing = search.capacity, search.first_failing
    upper = search.bounds()[1]  # the lowest level failing for steering: a decided fail or an undecided one below target
    split = {**_split(spend), "earlier_runs": earlier}
    tokens = sum(split.values())
    duration = sum(p.duration_s for p in search.probes)
    out: dict[str, Any] = {
        "over": over, "unit": _unit(over),
        "capacity": _level(capacity, over), "first_failing": _level(first_failing, over),
        "interval": [_level(capacity if capacity is not None else 0.0, over), _level(upper, over)],
        "binding": None, "shape": search.shape(), "probes": probes, "tokens": tokens, "tokens_split": split,
        "duration_s": round(duration, 3), "range": [_level(search.min_level, over), _level(search.max_level, over)],
        "below_range": capacity is None and first_failing is not None and first_failing <= search.min_level,
        "above_range": first_failing is None and capacity is not None and capacity >= search.max_level,
        "stopped": search.stopped, "disagreements": [_level(x, over) for x in search.disagreements],
        "undecided": [_level(p.level, over) for p in search.probes if p.verdict == "undecided" and not p.edge],
        "edge": [_edge(level, probes, over) for level in search.edges],
        "slo": slo.to_dict(), "served": None,
    }
    if first_failing is not None:
        failing = [p for p in search.probes if p.level == first_failing and p.verdict == "fail"]
        out["binding"] = failing[-1].binding if failing else None
        out["binding_detail"] = details.get(first_failing)
        out["served"] = max((p.served for p in search.probes if p.verdict == "fail" and p.served is not None
                             and p.served < p.level), default=None)
    out["verdict"] = verdict_text(out)
    return cast(SearchSummary, out)


def _latency(rows: pd.DataFrame, cut: float, percentiles: Sequence[float]) -> dict[str, Any]:
    """A probe's TTFT, TPOT and e2e percentiles (`ttft_p95_s`...), their `bounds` (lower bounds where streams cut
    reach them) and `ttft_n`... (the finished measurements under each)."""
    stats = latency_stats(rows, cut, percentiles, with_ci=False)
    keys = [pkey(m, q) for m in METRICS for q in percentiles] + [f"{m}_n" for m in METRICS]
    return {**{k: (None if isinstance(stats[k], float) and math.isnan(stats[k]) else stats[k]) for k in keys},
            "bounds": stats["bounds"]}


def after_outage(search: SearchSummary, outage_at: float) -> None:
    """The search as far as the channel served (in place): a probe that failed after the channel went down
    (`outage.at`, unix s) failed on the outage's errors, not on its load, so it decides nothing. When every fail
    of the first failing level came after it, that level is left undecided (`outage_level`), the capacity is a
    lower bound, and the boundary's upper end is the lowest level that failed before the outage, if any."""
    probes = search["probes"]
    late = [p for p in probes if p.get("this_run") and p["verdict"] == "fail" and (p.get("decided_at") or 0) >= outage_at]
    for p in late:
        p["after_outage"] = True
    ff = search["first_failing"]
    if not late or ff is None or any(p["level"] == ff and p["verdict"] == "fail" and not p.get("after_outage")
                                     for p in probes):
        return
    search["outage_level"] = ff
    search["undecided"] = sorted({*search["undecided"], ff})
    above = [p for p in probes if p["verdict"] == "fail" and not p.get("after_outage") and p["level"] > ff]
    first = min(above, key=lambda p: p["level"]) if above else None
    search["first_failing"] = first["level"] if first else None
    search["interval"] = (search["interval"][0], first["level"] if first else None)
    search["binding"] = cast(Any, first["binding"]) if first else None
    search["binding_detail"] = first.get("binding_detail") if first else None
    search["served"] = None  # the streams counted at a failing level say nothing of a level the outage decided
    search["verdict"] = verdict_text(search)


def decided_steps(search: Mapping[str, Any]) -> set[int]:
    """The steps of this run whose probe the search decided (passed or failed) on its evidence."""
    return {p["step"] for p in search["probes"] if p.get("this_run") and p["verdict"] in ("pass", "fail")}


def _probe_entry(p: Probe, over: str) -> ProbeRow:
    return {"level": cast(float, _level(p.level, over)), "verdict": p.verdict, "trial": p.trial, "n": p.n,
            "attainment": p.attainment, "ci": p.ci, "error_rate": p.error_rate, "binding": p.binding,
            "duration_s": p.duration_s, "tokens": p.tokens, "step": p.step, "run_id": p.run_id,
            "confident": p.confident, "early": p.early, "served": p.served, "decided_at": p.decided_at,
            "edge": p.edge, "rephased": p.rephased}


def _edge(level: float, probes: list[ProbeRow], over: str) -> EdgeLevel:
    """A level at the edge: its trials' requests pooled, and their 95% interval."""
    trials = [p for p in probes if p["level"] == _level(level, over) and p["attainment"] is not None]
    n = sum(p["n"] for p in trials)
    met = sum(round((p["attainment"] or 0.0) * p["n"]) for p in trials)
    ci = wilson_interval(met, n)
    return {"level": cast(float, _level(level, over)), "n": n, "attainment": met / n if n else None,
            "ci": list(ci) if ci else None}


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _tokens(n: int) -> str:
    return f"{n / 1000:.0f}k" if n >= 10_000 else f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def verdict_text(s: Mapping[str, Any]) -> str:
    """"capacity 8 users (9 fails: TTFT p90 1.1 s > 0.5 s; boundary in [8, 9]; 7 probes, 3 min, 41k tokens)"."""
    unit = s["unit"]
    cost = f"{len(s['probes'])} probes, {_minutes(s['duration_s'])}, {_tokens(s['tokens'])} tokens"
    split = s.get("tokens_split")
    if split:
        names = {"counted": "counted", "warmup": "warm-up", "cut": "cut", "storm_probe": "storm probes",
                 "earlier_runs": "earlier runs"}
        cost += f" ({', '.join(f'{_tokens(split[k])} {name}' for k, name in names.items() if split.get(k))})"
    cap, ff = s["capacity"], s["first_failing"]
    if s.get("outage_level") is not None:
        head = f"capacity at least {cap} {unit}" if cap is not None else "no capacity found"
        parts: list[str | None] = [f"{s['outage_level']} not decided: the channel went down while it was probed"]
        if ff is not None:
            parts.append(f"{ff} fails: {s.get('binding_detail') or s['binding']}")
        parts.append(f"boundary in [{cap}, {s['interval'][1]}]" if s["interval"][1] is not None else None)
    elif s["below_range"]:
        head = f"capacity below {s['range'][0]} {unit}: the lowest level probed already fails"
        parts = [f"{s['binding_detail']}" if s.get("binding_detail") else None]
    elif cap is None:
        head = "no capacity found"
        parts = []
    elif ff is None:
        head = (f"capacity at least {cap} {unit}: every level up to the range's top passed"
                if s["above_range"] else f"capacity at least {cap} {unit}: no level failed before the search ended")
        parts = [] if s["interval"][1] is None else [f"boundary in [{cap}, {s['interval'][1]}]"]
    else:
        head = f"capacity {cap} {unit}"
        parts = [f"{ff} fails: {s.get('binding_detail') or s['binding']}", f"boundary in [{cap}, {s['interval'][1]}]"]
        if s.get("served") is not None and cap <= s["served"] < ff:  # its slots explain the boundary
            parts.insert(1, f"the channel streamed {s['served']} at once while requests waited")
    edges = [e for e in s.get("edge") or [] if e["ci"] is not None and (cap is None or e["level"] > cap)]
    if edges:
        lo, hi = edges[0]["ci"]
        text = (f"{edges[0]['level']} {unit} is at the edge: {100 * lo:.0f}–{100 * hi:.0f}% against "
                f"{100 * s['slo']['target']:.0f}%")
        parts.insert(0, text + (f" (and {', '.join(str(e['level']) for e in edges[1:])})" if edges[1:] else ""))
    if s["disagreements"]:
        parts.append(f"trials disagreed at {', '.join(map(str, s['disagreements']))}")
    undecided = [x for x in s["undecided"] if x != s.get("outage_level")]
    if undecided:
        parts.append(f"undecided at {', '.join(map(str, undecided))}")
    parts.append(cost)
    text = f"{head} ({'; '.join(p for p in parts if p)})"
    if s["stopped"]:
        text += f"; {s['stopped']}"
    return text


TRIALS = {1: "", 2: ", 2nd trial"}


def probe_text(p: Mapping[str, Any], unit: str, slo: Mapping[str, Any]) -> str:
    """"9 users: fail on TTFT; 5 of 11 met, 45% [21%, 72%]; TTFT p50 0.52 · p95 ≥ 1.1 s; 2.4 s, 2.1k tokens"."""
    trial = p.get("trial", 1)
    head = f"{level_text(p['level'], unit)}{TRIALS.get(trial, f', trial {trial}')}: {p['verdict']}"
    if p["verdict"] == "pass" and not p.get("confident", True):
        head = head.replace(": pass", ": steering pass (not confident)")
    elif p.get("after_outage"):
        head += " after the channel went down (the outage's errors, not evidence of its load)"
    elif p["verdict"] == "fail" and p.get("binding"):
        head += f" on {LABEL.get(p['binding'], p['binding'])}"
    parts = [head]
    if p.get("attainment") is not None:
        ci = p.get("ci")
        parts.append(f"{round(p['attainment'] * p['n'])} of {p['n']} met, {p['attainment']:.0%}"
                     + (f" [{ci[0]:.0%}, {ci[1]:.0%}]" if ci else ""))
    for metric in [m for m in METRICS if slo.get(f"{m}_s") is not None] or ["ttft", "e2e"]:
        values = [(q, p.get(f"{metric}_{q}_s")) for q in ("p50", "p95") if p.get(f"{metric}_{q}_s") is not None]
        if values:
            shown = " · ".join(f"{q} {'≥ ' if f'{metric}_{q}_s' in p.get('bounds', []) else ''}{v:.3g}"
                               for q, v in values)
            parts.append(f"{LABEL.get(metric, metric)} {shown} {'s/token' if metric == 'tpot' else 's'}")
    parts.append(f"{_minutes(p['duration_s'])}, {_tokens(p['tokens'])} tokens")
    return "; ".join(parts)


def compare_capacities(searches: list[tuple[str, SearchSummary | None]]) -> dict[str, Any] | None:
    """Searched runs side by side: each capacity with its interval, and whether the intervals tell them apart.

    The first run is the baseline. Two capacities differ only when their boundary intervals do not
    overlap; otherwise the probes' evidence cannot order them, and the line says so.
    """
    searched = [(label, s) for label, s in searches if s is not None]
    if len(searched) < 2 or len({s["over"] for _, s in searched}) > 1:
        return None
    rows = [{"label": label, "capacity": s["capacity"], "first_failing": s["first_failing"], "interval": s["interval"],
             "unit": s["unit"], "below_range": s["below_range"], "verdict": s["verdict"]} for label, s in searched]
    base_label, base = searched[0]
    lines = []
    for label, s in searched[1:]:
        lines.append(f"{label}: {_capacity_text(s)} against {base_label}'s {_capacity_text(base)}: "
                     f"{_order(base, s)}")
    return {"runs": rows, "headline": lines}


def _capacity_text(s: SearchSummary) -> str:
    lo, hi = s["interval"]
    if s["capacity"] is None:
        return f"capacity below {s['range'][0]} {s['unit']}" if s["below_range"] else "no capacity decided"
    return f"capacity {s['capacity']} {s['unit']} (boundary in [{lo}, {hi if hi is not None else '?'}])"


def _order(base: SearchSummary, other: SearchSummary) -> str:
    """'lower', 'higher' or 'not told apart', from the boundary intervals."""
    b_lo, b_hi = base["interval"]
    o_lo, o_hi = other["interval"]
    if o_hi is not None and o_hi <= b_lo:
        return "lower (the boundary intervals do not overlap)"
    if b_hi is not None and b_hi <= o_lo:
        return "higher (the boundary intervals do not overlap)"
    return "not told apart (the boundary intervals overlap)"
