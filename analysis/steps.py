"""Per-load-step statistics, all from raw records (never Locust's rounded histogram).

Latency belongs to the step a request *started* in (the load it was sent
into); throughput belongs to the window in which it happened (see
`windows.by_time`). Requests started in a step's first `warmup_s` seconds
(scenario `[load] step_warmup_s`, `analyze --warmup`) are left out of its latency
statistics: a closed-loop step that just doubled its users, or an open-loop step
that just raised its rate, is still filling queues.

Every percentile treats a request tokenload cut open (at a step down or the
run's end) as right-censored (`stats.km_quantiles`): its latency is at least
as long as it had waited when it was cut (`cut_at`). Where censoring reaches a
percentile the value is a lower bound and `bounds` says so; `n` and bootstrap
intervals (`ci`) sit beside each statistic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast, get_type_hints

import numpy as np
import pandas as pd

from tokenload.analysis.fits import grouped_linear, planned_ttft
from tokenload.analysis.stats import Quantile, bootstrap_ci, km_quantiles
from tokenload.analysis.windows import by_time
from tokenload.contracts.summary import StepRow
from tokenload.errors import error_class
from tokenload.search.evidence import wilson_interval
from tokenload.slo import COLUMN as SLO_COLUMNS
from tokenload.slo import Slo, judged

PERCENTILES: tuple[float, ...] = (50, 95, 99)
# Percentiles that get a bootstrap interval (`ci`) per step.
CI_PERCENTILES: tuple[float, ...] = (50, 95)
METRICS: tuple[str, ...] = ("ttft", "tpot", "e2e")
# Per step, the formula with the step's typical TTFT and TPOT must land within this MAPE.
FORMULA_STEP_TOLERANCE = 0.20
# A step with fewer finished requests than this cannot decide a breakpoint or knee.
MIN_STEP_REQUESTS = 20
# A step's window rates (tokens/s, requests/s) are a steady state once it lasted this many median requests.
STEADY_REQUESTS = 5
# Goodput criteria (vLLM's `--goodput`): metric -> record column it bounds.
GOODPUT_COLUMNS: dict[str, str] = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_max_s", "e2e": "e2e_s"}


@dataclass(frozen=True)
class StepOptions:
    """How steps are summarised: which percentiles, how much warm-up, what counts as good."""

    percentiles: tuple[float, ...] = PERCENTILES
    # None: the scenario's `[load] step_warmup_s` (resolved by the pipeline before any step is summarised).
    warmup_s: float | None = None
    # metric ("ttft", "tpot", "itl", "e2e") -> bound in seconds; empty means the SLO decides goodput.
    goodput: dict[str, float] = field(default_factory=dict)
    min_requests: int = MIN_STEP_REQUESTS


DEFAULT_OPTIONS = StepOptions()


def pkey(metric: str, p: float) -> str:
    """`ttft_p95_s`, `e2e_p99.9_s`: the summary key of a percentile."""
    return f"{metric}_p{p:g}_s"


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else round(float(value), 6)
    if isinstance(value, np.integer):
        return int(value)
    return value


def waited(rows: pd.DataFrame, cut: float) -> np.ndarray:
    """How long each request had waited when it was cut: until its own `cut_at`, else (none recorded) `cut`."""
    at = rows["cut_at"].to_numpy(dtype=np.float64) if "cut_at" in rows else np.full(len(rows), cut)
    return np.where(np.isfinite(at), at, cut) - rows["started_at"].to_numpy(dtype=np.float64)


def observations(rows: pd.DataFrame, metric: str, cut: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, observed?, cut at a step down?) of one metric: finished ok requests observed, cut ones censored
    when they were cut (the last flag: while the run went on, `cut_before_end`)."""
    ok = rows["status"].eq("ok").to_numpy()
    open_ = rows["in_flight"].to_numpy()
    value = rows[f"{metric}_s"].to_numpy()
    waited_s = waited(rows, cut)
    early = rows["cut_before_end"].to_numpy(dtype=bool) if "cut_before_end" in rows else np.zeros(len(rows), bool)
    if metric == "tpot":  # a partial stream's TPOT is not a bound on its final TPOT: left out
        use = ok & ~open_ & np.isfinite(value)
        return value[use], np.ones(int(use.sum()), dtype=bool), np.zeros(int(use.sum()), dtype=bool)
    if metric == "ttft":
        seen = np.isfinite(value)
        use = ok & (seen | open_)
        inexact = inexact_ttft(rows)
        if (use & seen & ~inexact).any():  # the exact ones stand for the step; with none (HTTPS) all count
            use &= ~inexact
        return np.where(seen, value, waited_s)[use], seen[use], (early & ~seen)[use]
    use = ok & (~open_ & np.isfinite(value) | open_)
    return np.where(open_, waited_s, value)[use], ~open_[use], (early & open_)[use]


def inexact_ttft(rows: pd.DataFrame) -> np.ndarray:
    """Per row: its `ttft_s` may hold the client's own delay (`ttft_exact` False; a run before the column: none)."""
    if "ttft_exact" not in rows:
        return np.zeros(len(rows), dtype=bool)
    return rows["ttft_exact"].eq(False).to_numpy(dtype=bool)


def latency_stats(rows: pd.DataFrame, cut: float, percentiles: Sequence[float], seed: int = 0,
                  with_ci: bool = True) -> dict[str, Any]:
    """Percentiles (censoring-aware), n, lower-bound flags and bootstrap CIs of TTFT, TPOT and e2e."""
    out: dict[str, Any] = {"bounds": [], "ci": {}}
    for m_index, metric in enumerate(METRICS):
        times, events, step_down = observations(rows, metric, cut)
        out[f"{metric}_n"] = int(events.sum())
        out[f"{metric}_censored"] = int((~events).sum())
        out[f"{metric}_censored_step_down"] = int(step_down.sum())
        qs: list[Quantile] = km_quantiles(times, events, [p / 100 for p in percentiles]) if times.size else [
            Quantile(np.nan) for _ in percentiles]
        for p, q in zip(percentiles, qs):
            out[pkey(metric, p)] = q.value
            if q.bound and np.isfinite(q.value):
                out["bounds"].append(pkey(metric, p))
        if with_ci:
            for p in CI_PERCENTILES:
                ci = bootstrap_ci(times, events, p / 100, seed=seed * 31 + m_index * 7 + int(p))
                out["ci"][pkey(metric, p)] = None if ci is None else [round(ci[0], 6), round(ci[1], 6)]
    return out


def meets_slo(rows: pd.DataFrame, slo: Slo, cut: float,
              goodput: dict[str, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(meets, known) per request: the SLO (or the goodput criteria) met; and whether that is decided.

    Judged are successes and load errors (`tokenload.slo.judged`); a configuration or
    input error (auth, model, base URL, bad request, context_length) is not known
    either way, so it counts on neither side. A threshold a finished request has no
    value for (the TPOT of a one-token answer) is not missed. A request cut open (a
    step down, the run's end) is known to miss once it had waited past a bound when
    it was cut (no first token after the TTFT bound, not done after the e2e bound);
    otherwise it is unknown.
    """
    ok = rows["status"].eq("ok").to_numpy()
    open_ = rows["in_flight"].to_numpy()
    waited_s = waited(rows, cut)
    kinds = rows["error_kind"].astype("object")
    load_failure = kinds.map({k: judged("error", str(k)) for k in kinds.dropna().unique()})
    counted = ok | load_failure.eq(True).to_numpy()
    bounds, columns = (goodput, GOODPUT_COLUMNS) if goodput else (slo.thresholds, SLO_COLUMNS)
    meets = ok & ~open_
    failed_open = np.zeros(len(rows), dtype=bool)
    for metric, limit in bounds.items():
        value = rows[columns[metric]].to_numpy(dtype=np.float64)
        meets &= ~(value > limit)  # NaN (not measured) is not a miss
        if metric == "ttft":
            failed_open |= open_ & ~np.isfinite(rows["ttft_s"].to_numpy(dtype=np.float64)) & (waited_s > limit)
        elif metric == "e2e":
            failed_open |= open_ & (waited_s > limit)
    known = (~open_ & counted) | failed_open
    return meets, known


def step_table(df: pd.DataFrame, slo: Slo, windows: pd.DataFrame, cut: float,
               options: StepOptions = DEFAULT_OPTIONS, aside: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per step with the contract's `steps[]` columns and the extras (CIs, censoring, windows ...).

    `aside`: the rows in no statistic (warm-up, such as a search's new users' first requests, and storm probes):
    the channel served them, so the window's throughput and concurrency count them.
    """
    table = windows.copy()
    table["start"] = table["start"] + (options.warmup_s or 0.0)
    table["duration_s"] = (table["end"] - table["start"]).where(lambda d: d > 0)
    grouped = df.groupby("step", sort=True)
    table["active_users"] = grouped["active_users"].max()
    table["requests"] = grouped.size()
    is_error = df["status"].eq("error")
    table["errors"] = is_error.groupby(df["step"]).sum()
    kinds = df["error_kind"].astype("object")
    classes = kinds.map({k: error_class(str(k)) for k in kinds.dropna().unique()})
    for name in ("load", "input", "config"):
        table[f"{name}_errors"] = classes.eq(name).groupby(df["step"]).sum()
    table["error_rate"] = table["errors"] / table["requests"]
    table["load_error_rate"] = table["load_errors"] / table["requests"]
    table["censored"] = df["in_flight"].groupby(df["step"]).sum()
    step_end = table["end"].reindex(df["step"]).to_numpy()
    open_at_end = df["in_flight"].to_numpy() | (df["finished_at"].to_numpy() > step_end)
    table["open_at_step_end"] = pd.Series(open_at_end, index=df.index).groupby(df["step"]).sum()

    warm_start = table["start"].reindex(df["step"]).to_numpy()
    measured = measured_rows(df, table)
    table["warmup_excluded"] = table["requests"] - measured.groupby("step").size().reindex(table.index).fillna(0)
    stats = {cast(int, step): latency_stats(rows, cut, options.percentiles, seed=cast(int, step))
             for step, rows in measured.groupby("step", sort=True)}
    keys = [pkey(m, p) for m in METRICS for p in options.percentiles] + [f"{m}_{k}" for m in METRICS
                                                                         for k in ("n", "censored")]
    for key in keys:
        table[key] = pd.Series({s: v[key] for s, v in stats.items()}, dtype=float)
    table["bounds"] = pd.Series({s: v["bounds"] for s, v in stats.items()}, dtype=object)
    table["ci"] = pd.Series({s: v["ci"] for s, v in stats.items()}, dtype=object)

    done_ok = measured[measured["status"].eq("ok") & ~measured["in_flight"]]
    ok_group = done_ok.groupby("step", sort=True)
    table["ok"] = ok_group.size()
    table["output_tokens"] = ok_group["output_tokens"].sum()
    table["input_tokens_p50"] = ok_group["input_tokens"].median()
    table["output_tokens_p50"] = ok_group["output_tokens"].median()
    table["itl_p50_s"] = ok_group["itl_p50_s"].median()
    table["itl_p99_s"] = ok_group["itl_p99_s"].median()
    if "connect_s" in measured:
        # Setup time is kept out of TTFT (t0 is taken on a ready connection): shown here on its own,
        # over the requests that opened a new connection.
        fresh = measured[measured["connect_s"].gt(0)].groupby("step", sort=True)["connect_s"]
        table["new_connections"] = fresh.size()
        table["connect_p50_s"] = fresh.median()
        table["connect_p95_s"] = fresh.quantile(0.95)
        table["reconnects"] = pd.to_numeric(measured["reconnects"], errors="coerce").groupby(measured["step"]).sum()
    if "send_lag_s" in measured:
        # The client's own wait before each request was out (t0): kept out of TTFT, reported here.
        table["send_lag_p99_s"] = measured.groupby("step", sort=True)["send_lag_s"].quantile(0.99)
    if "first_read_tokens" in measured:
        # First tokens read with later ones carry the newest one's arrival: their TTFT is an upper bound.
        bound = pd.to_numeric(measured["first_read_tokens"], errors="coerce").gt(1)
        table["ttft_upper_bounds"] = bound.groupby(measured["step"]).sum()
    if "ttft_exact" in measured:
        # First tokens whose TTFT may hold the client's delay: left out of the percentiles where exact ones exist.
        table["ttft_inexact"] = pd.Series(inexact_ttft(measured), index=measured.index).groupby(measured["step"]).sum()

    meets, known = meets_slo(measured, slo, cut)
    table["slo_attainment"] = _share(meets, known, measured["step"])
    table["slo_n"] = pd.Series(known, index=measured.index).groupby(measured["step"]).sum()
    good, known_good = meets_slo(measured, slo, cut, options.goodput) if options.goodput else (meets, known)
    table["goodput_share"] = _share(good, known_good, measured["step"])

    good_all, _ = meets_slo(df, slo, cut, options.goodput)
    if aside is not None and len(aside):  # served, never good: they are judged by no criterion
        served = pd.concat([df, aside[df.columns.intersection(aside.columns)]], ignore_index=True)
        timed = by_time(served, table, cut, np.concatenate([good_all, np.zeros(len(aside), dtype=bool)]))
    else:
        timed = by_time(df, table, cut, good_all)
    table = table.join(timed)
    duration = table["duration_s"]
    table["output_tok_s"] = table["output_tokens_window"] / duration
    table["input_tok_s"] = table["input_tokens_window"] / duration
    table["total_tok_s"] = table["output_tok_s"] + table["input_tok_s"]
    table["rps"] = table["completions_window"] / duration
    starts = df["started_at"].to_numpy()
    in_window = pd.Series((starts >= warm_start) & (starts < step_end), index=df.index).groupby(df["step"]).sum()
    table["achieved_rate"] = in_window / duration
    table["goodput_rps"] = table["good_completions_window"] / duration

    table["formula_mape"] = _step_formula_mape(done_ok, table)
    ttft_fits = grouped_linear(done_ok["step"].to_numpy(), done_ok["input_tokens"].to_numpy(),
                               done_ok["ttft_s"].to_numpy())
    table["ttft_slope_s_per_token"] = pd.Series({k: v[0] for k, v in ttft_fits.items()}, dtype=float)
    table["slo_ci"] = pd.Series({step: wilson_interval(round(att * n), int(n)) if n and pd.notna(att) else None
                                 for step, att, n in zip(table.index, table["slo_attainment"],
                                                         table["slo_n"].fillna(0))}, dtype=object)
    table["decided"] = (table["ok"].fillna(0) + table["errors"].fillna(0)) >= options.min_requests
    # A window a few requests long holds the level's start (users ramping, the previous level's streams ending):
    # its rates are a count over that transient, not a rate the channel sustains at the level.
    table["steady"] = table["duration_s"] >= STEADY_REQUESTS * table["e2e_p50_s"]
    fillable = ["requests", "slo_n", "errors", "load_errors", "input_errors", "config_errors", "censored", "open_at_step_end",
                "warmup_excluded", "ok", "output_tokens", "completions_window"]
    table[fillable] = table[fillable].fillna(0).astype(np.int64)
    return table.sort_values(["load_level", "start"])


def measured_rows(df: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """Records that count towards their step's latency statistics: those started after its warm-up."""
    return df[df["started_at"].to_numpy() >= table["start"].reindex(df["step"]).to_numpy()]


def _share(meets: np.ndarray, known: np.ndarray, steps: pd.Series) -> pd.Series:
    good = pd.Series(meets & known, index=steps.index).groupby(steps).sum()
    decided = pd.Series(known, index=steps.index).groupby(steps).sum()
    return good / decided.where(decided > 0)


def _step_formula_mape(ok: pd.DataFrame, table: pd.DataFrame) -> pd.Series:
    """MAPE of e2e predicted from the step's *typical* TTFT and TPOT (exact N - 1 form); TTFT from each request's
    own input length where lengths vary within the step (`planned_ttft`), NaN where that cannot be fitted.

    Per request the exact form is an identity of the definitions; what users do
    is plan with typical values, and that stops working once TPOT or queueing
    varies a lot inside a step, which is what this number shows.
    """
    steps = ok["step"].to_numpy()
    ttft, _ = planned_ttft(steps, ok["input_tokens"].to_numpy(dtype=float, na_value=np.nan), ok["ttft_s"].to_numpy(),
                           table["ttft_p50_s"].to_dict())
    tpot = table["tpot_p50_s"].reindex(steps).to_numpy()
    predicted = ttft + tpot * np.maximum(ok["output_tokens"].to_numpy() - 1, 0)
    measured = ok["e2e_s"].to_numpy()
    err = pd.Series(np.abs(predicted - measured) / measured, index=ok.index)
    err = err[np.isfinite(err.to_numpy()) & (measured > 0)]
    return err.groupby(ok.loc[err.index, "step"]).mean()


# The contract's keys first, then the extras: `StepRow`'s, in its order (the lists and dicts are built on their own).
STEP_KEYS: tuple[str, ...] = tuple(k for k in get_type_hints(StepRow) if k not in ("bounds", "ci", "errors_by_kind",
                                                                                  "server"))
INT_KEYS: frozenset[str] = frozenset(k for k, hint in get_type_hints(StepRow).items() if hint is int and k != "step")


def step_keys(percentiles: Sequence[float]) -> list[str]:
    """STEP_KEYS plus every requested percentile key not already among them."""
    extra = [pkey(m, p) for m in METRICS for p in percentiles]
    return [*STEP_KEYS, *(k for k in extra if k not in STEP_KEYS)]


def steps_records(table: pd.DataFrame, errors_by_kind: pd.DataFrame,
                  percentiles: Sequence[float] = PERCENTILES) -> list[StepRow]:
    """`summary.json` `steps[]`: the contract's keys first, then extras incl. errors by kind, CIs and bounds."""
    rows: list[StepRow] = []
    for index, row in table.iterrows():
        step = cast(int, index)
        record: dict[str, Any] = {"step": int(step)}
        for key in step_keys(percentiles)[1:]:
            value = row.get(key, np.nan)
            if key in INT_KEYS:
                record[key] = int(value) if pd.notna(value) else 0
            elif key in ("load_unit",):
                record[key] = str(value)
            elif key in ("decided", "steady"):
                record[key] = bool(value)
            elif key == "slo_ci":
                record[key] = list(value) if isinstance(value, tuple) else None
            else:
                record[key] = _nan_to_none(value)
        record["bounds"] = list(row["bounds"]) if isinstance(row["bounds"], list) else []
        record["ci"] = row["ci"] if isinstance(row["ci"], dict) else {}
        if step in errors_by_kind.index:
            kinds = errors_by_kind.loc[step]
            record["errors_by_kind"] = {str(k): int(v) for k, v in kinds.items() if v}
        else:
            record["errors_by_kind"] = {}
        rows.append(cast(StepRow, record))
    return rows


def errors_by_kind(df: pd.DataFrame) -> pd.DataFrame:
    """Step x error_kind counts."""
    errs = df[df["status"].eq("error")]
    if errs.empty:
        return pd.DataFrame()
    return errs.groupby(["step", "error_kind"], observed=True).size().unstack(fill_value=0)
