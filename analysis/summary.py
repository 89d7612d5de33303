"""Turn a loaded run into `summary.json`'s dict (no I/O, no plotting).

The fits use successful requests of the *low-load* steps only, so that
queueing under load does not masquerade as prefill or decode cost; which
steps those were, and why, is part of the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.analysis import outofcore, server
from tokenload.analysis.breakpoint import auto_stop, auto_stop_relation, breakpoint_text, find_breakpoint
from tokenload.analysis.caching import caching_summary
from tokenload.analysis.diagnosis import diagnose_latency
from tokenload.analysis.fidelity import fidelity_summary
from tokenload.analysis.fits import (
    MIN_FIT_POINTS,
    linear_dict,
    linear_fit,
    planned_ttft,
    spread_note,
    ttft_vs_input,
)
from tokenload.analysis.outage import channel_words, find_outage
from tokenload.analysis.ratelimits import rate_limits
from tokenload.analysis.records import Run, cut_text
from tokenload.analysis.search import after_outage, decided_steps
from tokenload.analysis.steps import (
    DEFAULT_OPTIONS,
    FORMULA_STEP_TOLERANCE,
    METRICS,
    RunCounts,
    StepOptions,
    latency_stats,
    pkey,
    step_table,
    steps_records,
)
from tokenload.analysis.windows import level_text, step_windows
from tokenload.contracts.summary import (
    SUMMARY_VERSION,
    AutoStop,
    Completeness,
    E2eDrivers,
    E2eFit,
    Formula,
    Latency,
    LoadUnit,
    MetricLatency,
    SearchSummary,
    Summary,
)
from tokenload.errors import error_class
from tokenload.slo import DEFAULT as DEFAULT_SLO
from tokenload.slo import Slo, judged

# A step counts as low-load while its median TTFT and TPOT stay within this factor of the lowest-load step's.
LOW_LOAD_RISE = 1.25
# The TTFT fit keeps the least-concurrent low-load requests while they are at least this share of them.
LEAST_CONCURRENT_SHARE = 0.2
# The simple formula "holds" when, with each step's typical TTFT and TPOT, its MAPE is at most this.
FORMULA_TOLERANCE = 0.15


@dataclass
class Analysis:
    """Everything the plots and the report need besides the summary itself."""

    run: Run
    slo: Slo
    table: pd.DataFrame
    ok: pd.DataFrame
    low_steps: list[int]
    summary: Summary
    options: StepOptions = field(default_factory=StepOptions)


def _r(x: float | None, digits: int = 6) -> float | None:
    if x is None or not np.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def low_load_steps(table: pd.DataFrame, max_users: int | None = None) -> tuple[list[int], str]:
    """Pick the steps whose TTFT is not yet inflated by queueing, and say why."""
    usable = table[table["ok"] > 0].sort_values(["load_level", "start"])
    if usable.empty:
        return [], "no successful requests"
    if max_users is not None:
        capped = usable[usable["achieved_concurrency"].fillna(usable["active_users"]) <= max_users]
        return [int(s) for s in capped.index], f"steps with at most {max_users} concurrent requests (--low-load-users)"
    base_ttft, base_tpot = usable["ttft_p50_s"].iloc[0], usable["tpot_p50_s"].iloc[0]
    chosen: list[int] = []
    count = 0
    for step, row in usable.iterrows():
        # NaN TPOT (single-token outputs) compares False: judge such steps by TTFT alone.
        within = (row["ttft_p50_s"] <= LOW_LOAD_RISE * base_ttft
                  and not row["tpot_p50_s"] > LOW_LOAD_RISE * base_tpot)
        if not within and count >= MIN_FIT_POINTS:
            break
        chosen.append(int(step))
        count += int(row["ok"])
    levels = usable.loc[chosen, "load_level"]
    unit = str(usable["load_unit"].iloc[0])
    return chosen, (f"{len(chosen)} of {len(usable)} steps ({levels.min():g}-{level_text(levels.max(), unit)}): median TTFT "
                    f"and TPOT within {LOW_LOAD_RISE:g}x of the lowest-load step's ({base_ttft:.3g} s, "
                    f"{base_tpot:.3g} s/token)")


def _latency(df: pd.DataFrame, cut: float, percentiles: tuple[float, ...]) -> Latency:
    """Whole-run percentiles per metric, censoring-aware: {"p50": .., "n": .., "censored": .., "bounds": [..]}."""
    stats = latency_stats(df, cut, percentiles, with_ci=False) if len(df) else {"bounds": []}
    out = {}
    for metric in METRICS:
        entry: dict[str, Any] = {f"p{p:g}": _r(stats.get(pkey(metric, p), np.nan)) for p in percentiles}
        entry["n"] = int(stats.get(f"{metric}_n", 0))
        entry["censored"] = int(stats.get(f"{metric}_censored", 0))
        entry["censored_step_down"] = int(stats.get(f"{metric}_censored_step_down", 0))
        entry["bounds"] = [f"p{p:g}" for p in percentiles if pkey(metric, p) in stats["bounds"]]
        out[metric] = cast(MetricLatency, entry)
    return cast(Latency, out)


def formula_test(ok: pd.DataFrame, table: pd.DataFrame) -> Formula:
    """The contract's `formula`: both forms with each step's *typical* TTFT and TPOT, a test that can fail.

    With a request's own TTFT and TPOT the exact form is true by the definition of
    TPOT (its error only checks the records: `identity_mape`, expected ~0). What a
    user does is plan with typical values; that works while TTFT and TPOT vary
    little within a load level, and this is what `mape_simple`/`mape_exact` measure.
    """
    use = ok[ok["tpot_s"].notna() & (ok["output_tokens"] > 1) & (ok["e2e_s"] > 0)]
    if use.empty:
        return {"mape_simple": None, "mape_exact": None, "holds": False,
                "note": "no successful request with more than one output token"}
    e2e = use["e2e_s"].to_numpy()
    n = use["output_tokens"].to_numpy()
    steps = use["step"].to_numpy()
    typical_ttft, unjudged = planned_ttft(steps, use["input_tokens"].to_numpy(dtype=float, na_value=np.nan),
                                          use["ttft_s"].to_numpy(), table["ttft_p50_s"].to_dict())
    typical_tpot = table["tpot_p50_s"].reindex(steps).to_numpy()
    simple = typical_ttft + typical_tpot * n
    exact = simple - typical_tpot
    if not np.isfinite(simple).any():
        return {"mape_simple": None, "mape_exact": None, "holds": False, "not_judged_steps": unjudged,
                "note": "cannot judge: input lengths vary within each step and too few requests per step to predict "
                        "TTFT from input length (a step's median TTFT would mix prompt lengths, not test the formula)"}
    mape_simple = float(np.nanmean(np.abs(simple - e2e) / e2e))
    mape_exact = float(np.nanmean(np.abs(exact - e2e) / e2e))
    own = use["ttft_s"].to_numpy() + use["tpot_s"].to_numpy() * (n - 1)
    by_level = table.dropna(subset=["formula_mape"]).sort_values(["load_level", "start"])
    broken = by_level[by_level["formula_mape"] > FORMULA_STEP_TOLERANCE]
    return {
        "mape_simple": _r(mape_simple, 4), "mape_exact": _r(mape_exact, 4),
        "holds": bool(mape_simple <= FORMULA_TOLERANCE),
        "tolerance": FORMULA_TOLERANCE,
        "basis": ("each step's median TPOT, and its median TTFT or, where input lengths vary within the step, "
                  "the TTFT its TTFT-vs-input line predicts at the request's own input length"),
        "not_judged_steps": unjudged,
        "identity_mape": _r(float(np.mean(np.abs(own - e2e) / e2e)), 4),
        "simple_overshoot_p50_s": _r(float(np.nanmedian(simple - exact))),
        "exact_residual_p95_s": _r(float(np.nanpercentile(np.abs(exact - e2e), 95))),
        "typical_values_tolerance": FORMULA_STEP_TOLERANCE,
        "typical_values_break_at_active_users": None if broken.empty else int(broken["active_users"].iloc[0]),
        "typical_values_break_at": None if broken.empty else level_text(broken["load_level"].iloc[0],
                                                                         str(broken["load_unit"].iloc[0])),
        "n": int(len(use)),
    }


def _r2(x: np.ndarray, y: np.ndarray) -> float | None:
    """R^2 of y on the columns of x (with intercept) by least squares."""
    if len(y) < MIN_FIT_POINTS:
        return None
    design = np.column_stack([np.ones(len(y)), x])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    sst = float(((y - y.mean()) ** 2).sum())
    return _r(1.0 - float(resid @ resid) / sst, 4) if sst > 0 else None


def _e2e_drivers(low: pd.DataFrame) -> E2eDrivers:
    """How much of e2e's variance input length and output length explain (the claim: output length drives it)."""
    y = low["e2e_s"].to_numpy()
    n_in = low["input_tokens"].to_numpy()
    n_out = low["output_tokens"].to_numpy()
    r_in, r_out = _r2(n_in, y), _r2(n_out, y)
    out: dict[str, Any] = {"r2_input": r_in, "r2_output": r_out, "r2_both": _r2(np.column_stack([n_in, n_out]), y)}
    flat_out = spread_note(n_out, "output length", "output-sweep")
    if flat_out and spread_note(n_in, "input length", "prompt-sweep"):
        out["verdict"] = "neither input nor output length varied enough in this run to tell"
    elif r_in is None or r_out is None:
        out["verdict"] = "too few successful requests (or no variation in length) to tell"
    elif flat_out:  # a length that did not vary explains nothing, which says nothing about it ("output -0%")
        out["verdict"] = f"cannot tell: {flat_out}; input length explains {_share(r_in)} of e2e variance"
    elif r_out > r_in:
        out["verdict"] = f"supported: output length explains {_share(r_out)} of e2e variance, input {_share(r_in)}"
    else:
        out["verdict"] = f"not supported here: input length explains {_share(r_in)} of e2e variance, output {_share(r_out)}"
    return cast(E2eDrivers, out)


def _share(r2: float) -> str:
    """R² as a share of variance explained; a least-squares R² a hair below 0 is 0% (not "-0%")."""
    return f"{100 * max(r2, 0.0):.0f}%"


def e2e_vs_output(low: pd.DataFrame, ttft_p50: float | None, tpot_p50: float | None) -> E2eFit:
    """The contract's `fits.e2e_vs_output`, with the slope set against TPOT and the intercept against TTFT."""
    note = spread_note(low["output_tokens"].to_numpy(), "output length", "output-sweep")
    fit = cast("dict[str, Any] | None", linear_dict(linear_fit(low["output_tokens"].to_numpy(), low["e2e_s"].to_numpy()))
               if note is None else None)
    if fit is None:
        return {"slope_s_per_token": None, "intercept_s": None, "r2": None, "n": int(len(low)),
                "note": note or "output length did not vary enough (or too few successful requests) to fit"}
    y = low["e2e_s"].to_numpy()
    predicted = fit["intercept_s"] + fit["slope_s_per_token"] * low["output_tokens"].to_numpy()
    fit["residual_mape"] = _r(float(np.mean(np.abs(predicted - y) / y)), 4) if (y > 0).all() else None
    if tpot_p50 and ttft_p50 is not None:
        fit["tpot_p50_s"] = _r(tpot_p50)
        fit["slope_over_tpot_p50"] = _r(fit["slope_s_per_token"] / tpot_p50, 4)
        fit["ttft_p50_s"] = _r(ttft_p50)
        # e2e = TTFT + TPOT x (N - 1): the exact form predicts intercept = TTFT - TPOT.
        fit["intercept_expected_exact_s"] = _r(ttft_p50 - tpot_p50)
    return cast(E2eFit, fit)


def _side(rows: pd.DataFrame, step: pd.Series) -> dict[str, Any]:
    return {"ttft": float(rows["ttft_s"].median()), "tpot": float(rows["tpot_s"].median()),
            "e2e": float(rows["e2e_s"].median()), "output_tokens": float(rows["output_tokens"].median()),
            "input_tokens": float(rows["input_tokens"].median()), "active_users": float(step["active_users"]),
            "load": level_text(step["load_level"], str(step["load_unit"]))}


def least_concurrent(low: pd.DataFrame, df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The low-load requests that shared the channel with the fewest others: the prefill law's data.

    Two users slow each other's prefill (the channel batches or queues them), which
    inflates the intercept and flattens the slope; so the TTFT fit keeps the requests
    that started with the fewest others in flight, when there are enough of them.
    """
    if low.empty:
        return low, "no low-load requests"
    starts = np.sort(df["started_at"].to_numpy())
    ends = np.sort(np.where(df["in_flight"].to_numpy(), np.inf, df["finished_at"].to_numpy()))
    t = low["started_at"].to_numpy()
    others = np.searchsorted(starts, t, side="left") - np.searchsorted(ends, t, side="right")
    enough = max(2 * MIN_FIT_POINTS, LEAST_CONCURRENT_SHARE * len(low))
    levels, count = np.unique(others, return_counts=True)
    reached = np.flatnonzero(np.cumsum(count) >= enough)  # one pass: a loop over the levels was quadratic
    if reached.size:
        limit = levels[reached[0]]
        chosen = low[others <= limit]
        return chosen, (f"{len(chosen)} of {len(low)} low-load requests, those that started with at most "
                        f"{int(limit)} other request(s) in flight")
    return low, f"all {len(low)} low-load requests (too few ran alone to fit on those only)"


def _by_class(counts: dict[str, int]) -> dict[str, int]:
    """Error counts per class (config / input / load / client): only load errors measure the channel's limit."""
    out: dict[str, int] = {}
    for kind, n in counts.items():
        cls = error_class(kind) or "load"
        out[cls] = out.get(cls, 0) + n
    return out


def completeness(run: Run, table: pd.DataFrame, counts: RunCounts) -> Completeness:
    """Did the run finish its plan? An interrupted or cut-short run must not read as a clean ramp.

    A run ended by its own live rule (`[stop] breakpoint_*`, its auto-stop) ended as intended:
    it is not `truncated`, and `auto_stop` names the rule. One the error-storm breaker ended
    (`storm`) did not: the note says so with the breaker's words.
    """
    m = run.manifest
    stop = m.get("stop_reason")
    planned = len(m.get("plan") or [])
    ran = len(table)
    censored, step_down = counts.in_flight, counts.cut_step_down
    stopped = auto_stop(m.get("stop"), table)
    interrupted = stop == "interrupted" or bool(m.get("workers_lost")) or bool(m.get("recovered"))
    truncated = bool(planned and ran < planned) and stopped is None
    # The error-storm breaker ended the run: the channel failed, the plan did not complete whatever steps ran.
    storm = isinstance(stop, str) and stop.startswith("error storm")
    notes = []
    if storm and not interrupted:
        notes.append("the error-storm breaker stopped the run" + (f" during step {ran} of {planned}" if planned else "")
                     + f" ({stop})")
    elif interrupted:  # the cause when there is more to say than "interrupted" (it said "interrupted (interrupted)")
        cause = ("a Locust worker was lost" if m.get("workers_lost") else
                 "its records were recovered from the segments" if m.get("recovered") else
                 None if stop in (None, "interrupted") else str(stop))
        notes.append("the run was interrupted" + (f" ({cause})" if cause else "") +
                     (f" during step {ran} of {planned}" if planned else ""))
    elif truncated:
        notes.append(f"the run stopped after step {ran} of {planned} ({stop})")
    if censored:
        notes.append(f"{censored} request(s) cut open ({cut_text(censored, step_down)}): their latencies are "
                     "censored at the moment they were cut (percentiles they reach are lower bounds)")
    return {"stop_reason": stop, "interrupted": interrupted, "truncated": truncated, "storm": storm,
            "steps_planned": planned or None,
            "steps_run": ran, "censored": censored, "censored_step_down": step_down, "note": "; ".join(notes) or None,
            "auto_stop": None if stopped is None else f"{stopped['condition']}, [stop] {stopped['rule']}"}


def _auto_stop(run: Run, table: pd.DataFrame, bp: dict[str, Any], slo: Slo) -> AutoStop | None:
    """summary.json `auto_stop`: the live rule that ended the run, and how it relates to the breakpoint."""
    stopped = auto_stop(run.manifest.get("stop"), table)
    if stopped is None:
        return None
    decided = table[table["decided"]].sort_values(["load_level", "start"]) if len(table) else table
    upto = (level_text(decided["load_level"].iloc[-1], str(decided["load_unit"].iloc[-1]))
            if len(decided) else None)
    found = bp["breakpoint"]
    return cast(AutoStop, {**stopped, "breakpoint": None if found is None else breakpoint_text(found),
                           "verdict": auto_stop_relation(stopped, found, slo, upto)})


def summarize(run: Run, slo: Slo = DEFAULT_SLO, low_load_users: int | None = None,
              options: StepOptions = DEFAULT_OPTIONS, search: SearchSummary | None = None) -> Analysis:
    """Compute every number of the report for one run.

    `search`: a searched run's `search` block (`search.search_summary`). Its probes decide the capacity on
    their own evidence, each at its own load: a step its search decided is decided here too, no step rule
    looks for a breakpoint, and no SLO attainment is pooled over the probes' different loads.
    """
    df = run.df
    ok = run.ok
    cut = run.cut
    problems = list(run.problems)
    if df.empty:
        problems.append("requests.parquet has no rows: the run recorded no requests")
    elif ok.empty:
        problems.append("no request succeeded: latency fits and percentiles need successful requests")

    if run.sample is not None:  # too long to load: its frame is a sample, every record is counted here
        exact = outofcore.step_table(run, slo, options)
        table, counts = exact.table, exact.counts
        problems.append(outofcore.sampled(run.sample)["note"])
    else:
        table = step_table(df, slo, step_windows(df, run.manifest, cut), cut, options,
                           aside=run.aside) if len(df) else pd.DataFrame()
        counts = RunCounts.of(df, slo, cut)
    if search is not None and len(table):
        table["decided"] |= table.index.isin(decided_steps(search))
    kinds = counts.kinds
    low_steps, low_reason = low_load_steps(table, low_load_users) if len(df) else ([], "no requests")
    low = ok[ok["step"].isin(low_steps)]
    if len(ok) and low.empty:
        problems.append(f"no low-load step selected ({low_reason}): fits skipped")

    alone, alone_reason = least_concurrent(low, df)
    used = table.loc[low_steps] if low_steps else table.iloc[0:0]
    in_flight = used["achieved_concurrency"].fillna(used["active_users"]) if len(used) else pd.Series(dtype=float)
    ttft_fit = ttft_vs_input(alone["input_tokens"].to_numpy(), alone["ttft_s"].to_numpy(),
                             concurrency=float(in_flight.median()) if len(in_flight) else None)
    ttft_fit.update({"steps_used": low_steps, "steps_used_reason": low_reason, "requests_used": alone_reason})
    ttft_low = float(low["ttft_s"].median()) if len(low) else None
    tpot_low = float(low["tpot_s"].median()) if len(low) else None
    e2e_fit = e2e_vs_output(low, ttft_low, tpot_low)
    e2e_fit["steps_used"] = low_steps

    complete = completeness(run, table, counts)
    outage = find_outage(df, table, slo, run.started_at, run.run_dir) if len(table) else None
    if search is not None and outage is not None:
        after_outage(search, outage["at"])
    bp: dict[str, Any]
    if search is not None:
        bp = {"breakpoint": None, "rules": {}, "breakpoint_note": "a search: its probes decide the capacity on their "
              "own evidence (search), not held long enough for the step rules"}
    elif len(table):
        bp = find_breakpoint(table, slo, complete=complete, outage=outage)
    else:
        bp = {"breakpoint": None, "breakpoint_note": "no requests: nothing to break", "rules": {}}
    error_counts = {str(k): int(v) for k, v in kinds.sum().items()} if len(kinds) else {}
    share = float(counts.ttft_s / counts.e2e_s) if counts.ok and counts.e2e_s > 0 else None
    top = table[table["ok"] > 0].sort_values(["load_level", "start"]).iloc[-1] if len(ok) else None
    high_rows = ok[ok["step"] == top.name] if top is not None else ok
    diagnosis = diagnose_latency(
        slo=slo, requests=counts.requests, errors_total=counts.errors,
        errors_by_kind=error_counts, share_ttft=share,
        low=_side(low, table.loc[low_steps].iloc[-1]) if len(low) else {},
        high=_side(high_rows, top) if top is not None else {},
        ttft_fit=ttft_fit, breakpoint=bp["breakpoint"], open_requests=counts.in_flight,
        said={kind: message for kind, (_, message) in channel_words(run.run_dir).items()} if error_counts else None)
    if outage is not None:  # the first fix: bring the channel back
        diagnosis["advice"].insert(0, outage["advice"])

    attainment, judged_n = (None, 0)
    if counts.requests and search is None:
        attainment = _r(counts.slo_met / counts.slo_judged, 4) if counts.slo_judged else None
        judged_n = counts.slo_judged
    duration = (run.ended_at - run.started_at) if run.started_at and run.ended_at else None
    summary: Summary = {
        "schema_version": SUMMARY_VERSION,
        "run": {
            "run_id": run.manifest.get("run_id"), "run_dir": str(run.run_dir), "label": run.label,
            "started_at": run.started_at, "ended_at": run.ended_at, "duration_s": _r(duration),
            "requests": counts.requests, "ok": counts.ok, "errors": counts.errors, "in_flight": counts.in_flight,
            "cut_step_down": counts.cut_step_down,
            # answers the server cut for length below the max_tokens asked (its context was full)
            "truncated": counts.truncated,
            "models": sorted(counts.models),
            "channel": run.manifest.get("channel"), "scenario": (run.manifest.get("scenario") or {}).get("name"),
            "scheduler_lag": run.manifest.get("scheduler_lag"),
            "load_unit": cast(LoadUnit, str(table["load_unit"].iloc[0])) if len(table) else None,
            "load_kind": ((run.manifest.get("scenario") or {}).get("load") or {}).get("kind"),
            "completeness": complete,
        },
        "analysis_options": {"percentiles": list(options.percentiles), "warmup_s": options.warmup_s,
                             "goodput_s": options.goodput or None, "min_step_requests": options.min_requests},
        "slo": {**slo.to_dict(), "describe": slo.describe(), "attainment": attainment, "judged": judged_n,
                "not_judged": sum(n for kind, n in error_counts.items() if not judged("error", kind)),
                "per_probe": search is not None},
        "fits": {"ttft_vs_input": ttft_fit, "e2e_vs_output": e2e_fit},
        "formula": formula_test(ok, table) if len(ok) else {"mape_simple": None, "mape_exact": None, "holds": False,
                                                         "note": "no successful requests"},
        "e2e_drivers": _e2e_drivers(low),
        "latency": _latency(df, cut, options.percentiles),
        "steps": steps_records(table, kinds, options.percentiles) if len(table) else [],
        "errors_by_kind": error_counts,
        "errors_by_class": _by_class(error_counts),
        "outage": outage,
        "breakpoint": bp["breakpoint"],
        "breakpoint_note": bp["breakpoint_note"],
        "breakpoint_rules": bp["rules"],
        "breakpoint_undecided": bp.get("undecided", []),
        "auto_stop": _auto_stop(run, table, bp, slo) if len(table) else None,
        "diagnosis": diagnosis,
        "caching": caching_summary(df),
        "fidelity": fidelity_summary(df),
        "rate_limits": rate_limits(run.run_dir, run.ended_at),
        "server_metrics": {},  # server.attach's, below
        "thresholds": [],  # the pipeline's, when thresholds are given
        "problems": problems,
        "search": search,
    }
    if run.sample is not None:
        summary["run"]["sampled"] = outofcore.sampled(run.sample)
    if complete["note"]:
        problems.append(complete["note"])
    server.attach(summary, run, table)
    return Analysis(run=run, slo=slo, table=table, ok=ok, low_steps=low_steps, summary=summary, options=options)
