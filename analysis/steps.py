"""Per-load-step statistics, all from raw records (never Locust's rounded histogram).

One vectorised groupby per quantity so a million-row run stays a few seconds.
A step's duration runs from its first request start to the next step's first
start (the last step ends at the run's end): throughput then counts the time
the step really had, not just the span between its first and last request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.analysis.fits import grouped_linear

# Errors that come from load (the channel pushing back), as opposed to configuration.
LOAD_ERROR_KINDS: frozenset[str] = frozenset({
    "rate_limited", "overloaded", "server_error", "timeout_first_token", "timeout_stall",
    "disconnected", "unknown",
})
PERCENTILES: tuple[int, ...] = (50, 95, 99)
# Per step, the formula with the step's typical TTFT and TPOT must land within this MAPE.
FORMULA_STEP_TOLERANCE = 0.20


@dataclass(frozen=True)
class Slo:
    """Service-level objective: a request meets it when both bounds hold."""

    ttft_s: float = 1.0
    e2e_s: float = 3.0
    target: float = 0.90


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else round(float(value), 6)
    if isinstance(value, np.integer):
        return int(value)
    return value


def step_table(df: pd.DataFrame, slo: Slo, run_end: float | None) -> pd.DataFrame:
    """One row per step with SPEC.md's `steps[]` columns and the extras (p99, goodput, ...)."""
    done = ~df["in_flight"]
    ok_mask = df["status"].eq("ok") & done
    ok = df[ok_mask]
    grouped = df.groupby("step", sort=True)
    table = pd.DataFrame({
        "active_users": grouped["active_users"].max(),
        "requests": grouped.size(),
        "errors": df["status"].eq("error").groupby(df["step"]).sum(),
        "in_flight": df["in_flight"].groupby(df["step"]).sum(),
        "start": grouped["started_at"].min(),
    })
    load_errors = df["error_kind"].isin(list(LOAD_ERROR_KINDS)).groupby(df["step"]).sum()
    table["load_errors"] = load_errors
    table["error_rate"] = table["errors"] / table["requests"]
    table["load_error_rate"] = table["load_errors"] / table["requests"]

    end = float(run_end) if run_end is not None else float(df["finished_at"].max())
    table = table.sort_values("start")
    next_start = table["start"].shift(-1).fillna(max(end, float(table["start"].max())))
    duration = (next_start - table["start"]).where(lambda d: d > 0)
    table["duration_s"] = duration

    ok_group = ok.groupby("step", sort=True)
    for metric in ("ttft", "tpot", "e2e"):
        q = ok_group[f"{metric}_s"].quantile([p / 100 for p in PERCENTILES]).unstack()
        for p in PERCENTILES:
            table[f"{metric}_p{p}_s"] = q[p / 100] if p / 100 in q else np.nan
    table["output_tokens"] = ok_group["output_tokens"].sum()
    table["ok"] = ok_group.size()
    table["input_tokens_p50"] = ok_group["input_tokens"].median()
    table["output_tokens_p50"] = ok_group["output_tokens"].median()

    # SLO: errors fail it; in-flight streams are neither (their latency is unknown).
    meets = ok_mask & (df["ttft_s"] <= slo.ttft_s) & (df["e2e_s"] <= slo.e2e_s)
    good = meets.groupby(df["step"]).sum()
    finished = done.groupby(df["step"]).sum()
    table["slo_attainment"] = good / finished.where(finished > 0)
    table["rps"] = table["requests"] / table["duration_s"]
    table["output_tok_s"] = table["output_tokens"].fillna(0) / table["duration_s"]
    table["goodput_rps"] = good / table["duration_s"]

    table["formula_mape"] = _step_formula_mape(ok, table)
    ttft_fits = grouped_linear(ok["step"].to_numpy(), ok["input_tokens"].to_numpy(), ok["ttft_s"].to_numpy())
    table["ttft_slope_s_per_token"] = pd.Series({k: v[0] for k, v in ttft_fits.items()}, dtype=float)
    fillable = ["requests", "errors", "in_flight", "load_errors", "ok", "output_tokens"]
    table[fillable] = table[fillable].fillna(0).astype(np.int64)
    return table.sort_values(["active_users", "start"])


def _step_formula_mape(ok: pd.DataFrame, table: pd.DataFrame) -> pd.Series:
    """MAPE of e2e predicted from the step's *typical* TTFT and TPOT (exact N - 1 form).

    Per request the exact form is an identity of the definitions; what users do
    is plan with typical values, and that stops working once TPOT or queueing
    varies a lot inside a step, which is what this number shows.
    """
    steps = ok["step"].to_numpy()
    ttft = table["ttft_p50_s"].reindex(steps).to_numpy()
    tpot = table["tpot_p50_s"].reindex(steps).to_numpy()
    predicted = ttft + tpot * np.maximum(ok["output_tokens"].to_numpy() - 1, 0)
    measured = ok["e2e_s"].to_numpy()
    err = pd.Series(np.abs(predicted - measured) / measured, index=ok.index)
    err = err[np.isfinite(err.to_numpy()) & (measured > 0)]
    return err.groupby(ok.loc[err.index, "step"]).mean()


STEP_KEYS: tuple[str, ...] = (
    "step", "active_users", "requests", "errors", "error_rate", "rps", "output_tok_s",
    "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "e2e_p95_s", "slo_attainment",
    "formula_mape",
    # extras
    "ok", "in_flight", "load_errors", "load_error_rate", "duration_s", "goodput_rps",
    "ttft_p99_s", "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "input_tokens_p50",
    "output_tokens_p50", "ttft_slope_s_per_token",
)

INT_KEYS: frozenset[str] = frozenset({"active_users", "requests", "errors", "ok", "in_flight", "load_errors"})


def steps_records(table: pd.DataFrame, errors_by_kind: pd.DataFrame) -> list[dict[str, Any]]:
    """`summary.json` `steps[]`: SPEC.md keys first, then extras incl. errors by kind."""
    rows = []
    for index, row in table.iterrows():
        step = cast(int, index)
        record: dict[str, Any] = {"step": int(step)}
        record.update({k: int(row[k]) if k in INT_KEYS else _nan_to_none(row[k]) for k in STEP_KEYS[1:]})
        if step in errors_by_kind.index:
            kinds = errors_by_kind.loc[step]
            record["errors_by_kind"] = {str(k): int(v) for k, v in kinds.items() if v}
        else:
            record["errors_by_kind"] = {}
        rows.append(record)
    return rows


def errors_by_kind(df: pd.DataFrame) -> pd.DataFrame:
    """Step x error_kind counts."""
    errs = df[df["status"].eq("error")]
    if errs.empty:
        return pd.DataFrame()
    return errs.groupby(["step", "error_kind"], observed=True).size().unstack(fill_value=0)
