"""Turn a loaded run into `summary.json`'s dict (no I/O, no plotting).

The fits use successful requests of the *low-load* steps only, so that
queueing under load does not masquerade as prefill or decode cost; which
steps those were, and why, is part of the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tokenload.analysis.breakpoint import find_breakpoint
from tokenload.analysis.diagnosis import diagnose_latency
from tokenload.analysis.fits import MIN_FIT_POINTS, linear_dict, linear_fit, ttft_vs_input
from tokenload.analysis.records import Run
from tokenload.analysis.steps import FORMULA_STEP_TOLERANCE, PERCENTILES, Slo, errors_by_kind, step_table, steps_records

# A step counts as low-load while its median TTFT and TPOT stay within this factor of the lowest-load step's.
LOW_LOAD_RISE = 1.25
# The simple formula "holds" when its per-request MAPE is at most this.
FORMULA_TOLERANCE = 0.10


@dataclass
class Analysis:
    """Everything the plots and the report need besides the summary itself."""

    run: Run
    slo: Slo
    table: pd.DataFrame
    ok: pd.DataFrame
    low_steps: list[int]
    summary: dict[str, Any]


def _r(x: float | None, digits: int = 6) -> float | None:
    if x is None or not np.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def low_load_steps(table: pd.DataFrame, max_users: int | None = None) -> tuple[list[int], str]:
    """Pick the steps whose TTFT is not yet inflated by queueing, and say why."""
    usable = table[table["ok"] > 0].sort_values("active_users")
    if usable.empty:
        return [], "no successful requests"
    if max_users is not None:
        capped = usable[usable["active_users"] <= max_users]
        return [int(s) for s in capped.index], f"steps with at most {max_users} users (--low-load-users)"
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
    users = usable.loc[chosen, "active_users"]
    return chosen, (f"{len(chosen)} of {len(usable)} steps ({users.min()}-{users.max()} users): median TTFT "
                    f"and TPOT within {LOW_LOAD_RISE:g}x of the lowest-load step's ({base_ttft:.3g} s, "
                    f"{base_tpot:.3g} s/token)")


def _percentiles(values: pd.Series) -> dict[str, float | None]:
    arr = values.dropna().to_numpy()
    if arr.size == 0:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": _r(v) for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES))}


def _formula(ok: pd.DataFrame, table: pd.DataFrame) -> dict[str, Any]:
    """SPEC.md `formula`: both forms per request, plus where typical values stop predicting."""
    use = ok[ok["tpot_s"].notna() & (ok["output_tokens"] > 1) & (ok["e2e_s"] > 0)]
    if use.empty:
        return {"mape_simple": None, "mape_exact": None, "holds": False,
                "note": "no successful request with more than one output token"}
    e2e = use["e2e_s"].to_numpy()
    n = use["output_tokens"].to_numpy()
    base = use["ttft_s"].to_numpy()
    tpot = use["tpot_s"].to_numpy()
    simple = base + tpot * n
    exact = simple - tpot
    mape_simple = float(np.mean(np.abs(simple - e2e) / e2e))
    mape_exact = float(np.mean(np.abs(exact - e2e) / e2e))
    by_users = table.dropna(subset=["formula_mape"]).sort_values("active_users")
    broken = by_users[by_users["formula_mape"] > FORMULA_STEP_TOLERANCE]
    return {
        "mape_simple": _r(mape_simple, 4), "mape_exact": _r(mape_exact, 4),
        "holds": bool(mape_simple <= FORMULA_TOLERANCE),
        "tolerance": FORMULA_TOLERANCE,
        "simple_overshoot_p50_s": _r(float(np.median(simple - e2e))),
        "exact_residual_p95_s": _r(float(np.percentile(np.abs(exact - e2e), 95))),
        "typical_values_tolerance": FORMULA_STEP_TOLERANCE,
        "typical_values_break_at_active_users": None if broken.empty else int(broken["active_users"].iloc[0]),
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


def _e2e_drivers(low: pd.DataFrame) -> dict[str, Any]:
    """How much of e2e's variance input length and output length explain (BRIEF.md's claim)."""
    y = low["e2e_s"].to_numpy()
    n_in = low["input_tokens"].to_numpy()
    n_out = low["output_tokens"].to_numpy()
    r_in, r_out = _r2(n_in, y), _r2(n_out, y)
    out: dict[str, Any] = {"r2_input": r_in, "r2_output": r_out, "r2_both": _r2(np.column_stack([n_in, n_out]), y)}
    if r_in is None or r_out is None:
        out["verdict"] = "too few successful requests (or no variation in length) to tell"
    elif r_out > r_in:
        out["verdict"] = f"supported: output length explains {100 * r_out:.0f}% of e2e variance, input {100 * r_in:.0f}%"
    else:
        out["verdict"] = f"not supported here: input length explains {100 * r_in:.0f}% of e2e variance, output {100 * r_out:.0f}%"
    return out


def _e2e_fit(low: pd.DataFrame, ttft_p50: float | None, tpot_p50: float | None) -> dict[str, Any]:
    """SPEC.md `fits.e2e_vs_output`, with the slope set against TPOT and the intercept against TTFT."""
    fit = linear_dict(linear_fit(low["output_tokens"].to_numpy(), low["e2e_s"].to_numpy()))
    if fit is None:
        return {"slope_s_per_token": None, "intercept_s": None, "r2": None, "n": int(len(low)),
                "note": "output length did not vary enough (or too few successful requests) to fit"}
    if tpot_p50 and ttft_p50 is not None:
        fit["tpot_p50_s"] = _r(tpot_p50)
        fit["slope_over_tpot_p50"] = _r(fit["slope_s_per_token"] / tpot_p50, 4)
        fit["ttft_p50_s"] = _r(ttft_p50)
        # e2e = TTFT + TPOT x (N - 1): the exact form predicts intercept = TTFT - TPOT.
        fit["intercept_expected_exact_s"] = _r(ttft_p50 - tpot_p50)
    return fit


def _side(rows: pd.DataFrame, users: float) -> dict[str, float]:
    return {"ttft": float(rows["ttft_s"].median()), "tpot": float(rows["tpot_s"].median()),
            "e2e": float(rows["e2e_s"].median()), "output_tokens": float(rows["output_tokens"].median()),
            "input_tokens": float(rows["input_tokens"].median()), "active_users": float(users)}


def summarize(run: Run, slo: Slo = Slo(), low_load_users: int | None = None) -> Analysis:
    """Compute every number of the report for one run."""
    df = run.df
    ok = run.ok
    problems = list(run.problems)
    if df.empty:
        problems.append("requests.parquet has no rows: the run recorded no requests")
    elif ok.empty:
        problems.append("no request succeeded: latency fits and percentiles need successful requests")

    table = step_table(df, slo, run.ended_at) if len(df) else pd.DataFrame()
    kinds = errors_by_kind(df)
    low_steps, low_reason = low_load_steps(table, low_load_users) if len(df) else ([], "no requests")
    low = ok[ok["step"].isin(low_steps)]
    if len(ok) and low.empty:
        problems.append(f"no low-load step selected ({low_reason}): fits skipped")

    ttft_fit = ttft_vs_input(low["input_tokens"].to_numpy(), low["ttft_s"].to_numpy())
    ttft_fit.update(steps_used=low_steps, steps_used_reason=low_reason)
    ttft_low = float(low["ttft_s"].median()) if len(low) else None
    tpot_low = float(low["tpot_s"].median()) if len(low) else None
    e2e_fit = _e2e_fit(low, ttft_low, tpot_low)
    e2e_fit["steps_used"] = low_steps

    bp = find_breakpoint(table, slo) if len(table) else {
        "breakpoint": None, "breakpoint_note": "no requests: nothing to break", "rules": {}}
    error_counts = {str(k): int(v) for k, v in kinds.sum().items()} if len(kinds) else {}
    share = float(ok["ttft_s"].sum() / ok["e2e_s"].sum()) if len(ok) and ok["e2e_s"].sum() > 0 else None
    top = table[table["ok"] > 0].sort_values("active_users").iloc[-1] if len(ok) else None
    high_rows = ok[ok["step"] == top.name] if top is not None else ok
    diagnosis = diagnose_latency(
        slo=slo, requests=int(len(df)), errors_total=int(df["status"].eq("error").sum()),
        errors_by_kind=error_counts, share_ttft=share,
        low=_side(low, table.loc[low_steps, "active_users"].max()) if len(low) else {},
        high=_side(high_rows, top["active_users"]) if top is not None else {},
        ttft_fit=ttft_fit, breakpoint=bp["breakpoint"])

    finished = df[~df["in_flight"]]
    good = (finished["status"].eq("ok") & (finished["ttft_s"] <= slo.ttft_s) & (finished["e2e_s"] <= slo.e2e_s))
    duration = (run.ended_at - run.started_at) if run.started_at and run.ended_at else None
    summary: dict[str, Any] = {
        "run": {
            "run_id": run.manifest.get("run_id"), "run_dir": str(run.run_dir), "label": run.label,
            "started_at": run.started_at, "ended_at": run.ended_at, "duration_s": _r(duration),
            "requests": int(len(df)), "ok": int(len(ok)), "errors": int(df["status"].eq("error").sum()),
            "in_flight": int(df["in_flight"].sum()),
            "models": sorted(str(m) for m in df["model"].dropna().unique()),
            "channel": run.manifest.get("channel"), "scenario": (run.manifest.get("scenario") or {}).get("name"),
            "scheduler_lag": run.manifest.get("scheduler_lag"),
        },
        "slo": {"ttft_s": slo.ttft_s, "e2e_s": slo.e2e_s, "target": slo.target,
                "attainment": _r(float(good.mean()), 4) if len(finished) else None},
        "fits": {"ttft_vs_input": ttft_fit, "e2e_vs_output": e2e_fit},
        "formula": _formula(ok, table) if len(ok) else {"mape_simple": None, "mape_exact": None, "holds": False,
                                                         "note": "no successful requests"},
        "e2e_drivers": _e2e_drivers(low),
        "latency": {m: _percentiles(ok[f"{m}_s"]) for m in ("ttft", "tpot", "e2e")},
        "steps": steps_records(table, kinds) if len(table) else [],
        "errors_by_kind": error_counts,
        "breakpoint": bp["breakpoint"],
        "breakpoint_note": bp["breakpoint_note"],
        "breakpoint_rules": bp["rules"],
        "diagnosis": diagnosis,
        "problems": problems,
    }
    return Analysis(run=run, slo=slo, table=table, ok=ok, low_steps=low_steps, summary=summary)
