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
from dataclasses import dataclass, field, fields
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


@dataclass(frozen=True)
class Observations:
    """One metric's latencies of some requests: times, observed (else censored), cut at a step down, and (TTFT)
    which may hold the client's own delay (left out where the step has exact ones: `usable`)."""

    times: np.ndarray
    events: np.ndarray
    step_down: np.ndarray
    inexact: np.ndarray

    def usable(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(times, observed?, cut at a step down?): the exact TTFTs stand for the step where it has any seen
        (HTTPS has none: then all count)."""
        use = ~self.inexact
        if use.all() or not (use & self.events).any():
            return self.times, self.events, self.step_down
        return self.times[use], self.events[use], self.step_down[use]


def observations(rows: pd.DataFrame, metric: str, cut: float) -> Observations:
    """One metric's observations: finished ok requests observed, cut ones censored when they were cut (the
    step-down flag: while the run went on, `cut_before_end`)."""
    ok = rows["status"].eq("ok").to_numpy()
    open_ = rows["in_flight"].to_numpy()
    value = rows[f"{metric}_s"].to_numpy()
    waited_s = waited(rows, cut)
    early = rows["cut_before_end"].to_numpy(dtype=bool) if "cut_before_end" in rows else np.zeros(len(rows), bool)
    if metric == "tpot":  # a partial stream's TPOT is not a bound on its final TPOT: left out
        use = ok & ~open_ & np.isfinite(value)
        n = int(use.sum())
        return Observations(value[use], np.ones(n, dtype=bool), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool))
    if metric == "ttft":
        seen = np.isfinite(value)
        use = ok & (seen | open_)
        return Observations(np.where(seen, value, waited_s)[use], seen[use], (early & ~seen)[use],
                            inexact_ttft(rows)[use])
    use = ok & (~open_ & np.isfinite(value) | open_)
    return Observations(np.where(open_, waited_s, value)[use], ~open_[use], (early & open_)[use],
                        np.zeros(int(use.sum()), dtype=bool))


def inexact_ttft(rows: pd.DataFrame) -> np.ndarray:
    """Per row: its `ttft_s` may hold the client's own delay (`ttft_exact` False; a run before the column: none)."""
    if "ttft_exact" not in rows:
        return np.zeros(len(rows), dtype=bool)
    return rows["ttft_exact"].eq(False).to_numpy(dtype=bool)


def latency_stats(rows: pd.DataFrame, cut: float, percentiles: Sequence[float], seed: int = 0,
                  with_ci: bool = True) -> dict[str, Any]:
    """Percentiles (censoring-aware), n, lower-bound flags and bootstrap CIs of TTFT, TPOT and e2e."""
    return observation_stats({m: observations(rows, m, cut) for m in METRICS}, percentiles, seed, with_ci)


def observation_stats(observed: dict[str, Observations], percentiles: Sequence[float], seed: int = 0,
                      with_ci: bool = True) -> dict[str, Any]:
    """`latency_stats` from each metric's observations, however they were gathered (at once or a chunk at a time)."""
    out: dict[str, Any] = {"bounds": [], "ci": {}}
    for m_index, metric in enumerate(METRICS):
        if metric not in observed:
            continue
        times, events, step_down = observed[metric].usable()
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
    table = warmed_up(windows, options)
    measured = measured_rows(df, table)
    stats = {cast(int, step): latency_stats(rows, cut, options.percentiles, seed=cast(int, step))
             for step, rows in measured.groupby("step", sort=True)}
    active = df.groupby("step", sort=True)["active_users"].max()
    table = finish_steps(table, step_sums(df, table, slo, cut, options, aside), stats, active, options)
    return shape_steps(table, measured)


def warmed_up(windows: pd.DataFrame, options: StepOptions) -> pd.DataFrame:
    """The step windows, each one's latency statistics starting after its warm-up."""
    table = windows.copy()
    table["start"] = table["start"] + (options.warmup_s or 0.0)
    table["duration_s"] = (table["end"] - table["start"]).where(lambda d: d > 0)
    return table


# The per-step columns of `step_sums`: each adds up over any split of the records.
SUM_COLUMNS: tuple[str, ...] = (
    "requests", "errors", "load_errors", "input_errors", "config_errors", "censored", "open_at_step_end", "measured",
    "ok", "output_tokens", "new_connections", "reconnects", "ttft_upper_bounds", "ttft_inexact", "slo_met", "slo_n",
    "good_met", "good_n", "output_tokens_window", "input_tokens_window", "completions_window",
    "good_completions_window", "busy_s", "in_window",
)


def step_sums(df: pd.DataFrame, table: pd.DataFrame, slo: Slo, cut: float, options: StepOptions = DEFAULT_OPTIONS,
              aside: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per step of `table` (`warmed_up` windows), the SUM_COLUMNS of `df`'s records: counts, tokens, the requests
    that met the SLO and those judged, what each window served; a run's are the sum of its parts'."""
    out = pd.DataFrame(index=table.index)
    out["requests"] = df.groupby("step", sort=True).size()
    out["errors"] = df["status"].eq("error").groupby(df["step"]).sum()
    kinds = df["error_kind"].astype("object")
    classes = kinds.map({k: error_class(str(k)) for k in kinds.dropna().unique()})
    for name in ("load", "input", "config"):
        out[f"{name}_errors"] = classes.eq(name).groupby(df["step"]).sum()
    out["censored"] = df["in_flight"].groupby(df["step"]).sum()
    step_end = table["end"].reindex(df["step"]).to_numpy()
    open_at_end = df["in_flight"].to_numpy() | (df["finished_at"].to_numpy() > step_end)
    out["open_at_step_end"] = pd.Series(open_at_end, index=df.index).groupby(df["step"]).sum()
    measured = measured_rows(df, table)
    out["measured"] = measured.groupby("step").size()
    done_ok = measured[measured["status"].eq("ok") & ~measured["in_flight"]]
    ok_group = done_ok.groupby("step", sort=True)
    out["ok"] = ok_group.size()
    out["output_tokens"] = ok_group["output_tokens"].sum()
    if "connect_s" in measured:
        out["new_connections"] = measured[measured["connect_s"].gt(0)].groupby("step", sort=True).size()
        out["reconnects"] = pd.to_numeric(measured["reconnects"], errors="coerce").groupby(measured["step"]).sum()
    if "first_read_tokens" in measured:
        # First tokens read with later ones carry the newest one's arrival: their TTFT is an upper bound.
        bound = pd.to_numeric(measured["first_read_tokens"], errors="coerce").gt(1)
        out["ttft_upper_bounds"] = bound.groupby(measured["step"]).sum()
    if "ttft_exact" in measured:
        # First tokens whose TTFT may hold the client's delay: left out of the percentiles where exact ones exist.
        out["ttft_inexact"] = pd.Series(inexact_ttft(measured), index=measured.index).groupby(measured["step"]).sum()
    meets, known = meets_slo(measured, slo, cut)
    out["slo_met"], out["slo_n"] = _judged(meets, known, measured["step"])
    good, known_good = meets_slo(measured, slo, cut, options.goodput) if options.goodput else (meets, known)
    out["good_met"], out["good_n"] = _judged(good, known_good, measured["step"])
    good_all, _ = meets_slo(df, slo, cut, options.goodput)
    if aside is not None and len(aside):  # served, never good: they are judged by no criterion
        served = pd.concat([df, aside[df.columns.intersection(aside.columns)]], ignore_index=True)
        timed = by_time(served, table, cut, np.concatenate([good_all, np.zeros(len(aside), dtype=bool)]))
    else:
        timed = by_time(df, table, cut, good_all)
    out = out.join(timed)
    starts = df["started_at"].to_numpy()
    warm_start = table["start"].reindex(df["step"]).to_numpy()
    out["in_window"] = pd.Series((starts >= warm_start) & (starts < step_end), index=df.index).groupby(df["step"]).sum()
    return out


def _judged(meets: np.ndarray, known: np.ndarray, steps: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Per step: the judged requests that met the criteria, and those judged."""
    good = pd.Series(meets & known, index=steps.index).groupby(steps).sum()
    return good, pd.Series(known, index=steps.index).groupby(steps).sum()


def finish_steps(table: pd.DataFrame, sums: pd.DataFrame, stats: dict[int, dict[str, Any]], active_users: pd.Series,
                 options: StepOptions) -> pd.DataFrame:
    """The step table from its windows (`warmed_up`), `step_sums`, each step's `latency_stats` and its most users."""
    table = table.copy()
    table["active_users"] = active_users
    for key in ("requests", "errors", "load_errors", "input_errors", "config_errors"):
        table[key] = sums[key]
    table["error_rate"] = table["errors"] / table["requests"]
    table["load_error_rate"] = table["load_errors"] / table["requests"]
    table["censored"] = sums["censored"]
    table["open_at_step_end"] = sums["open_at_step_end"]
    table["warmup_excluded"] = table["requests"] - sums["measured"].reindex(table.index).fillna(0)
    keys = [pkey(m, p) for m in METRICS for p in options.percentiles] + [f"{m}_{k}" for m in METRICS
                                                                         for k in ("n", "censored")]
    for key in keys:
        table[key] = pd.Series({s: v[key] for s, v in stats.items()}, dtype=float)
    table["bounds"] = pd.Series({s: v["bounds"] for s, v in stats.items()}, dtype=object)
    table["ci"] = pd.Series({s: v["ci"] for s, v in stats.items()}, dtype=object)
    table["ok"] = sums["ok"]
    table["output_tokens"] = sums["output_tokens"]
    for key in ("new_connections", "reconnects", "ttft_upper_bounds", "ttft_inexact"):
        if key in sums:
            table[key] = sums[key]
    table["slo_attainment"] = sums["slo_met"] / sums["slo_n"].where(sums["slo_n"] > 0)
    table["slo_n"] = sums["slo_n"]
    table["goodput_share"] = sums["good_met"] / sums["good_n"].where(sums["good_n"] > 0)
    width = table["end"] - table["start"]
    table["output_tokens_window"] = sums["output_tokens_window"]
    table["input_tokens_window"] = sums["input_tokens_window"]
    table["completions_window"] = sums["completions_window"]
    table["good_completions_window"] = sums["good_completions_window"]
    table["achieved_concurrency"] = (sums["busy_s"] / width).where(width > 0)
    duration = table["duration_s"]
    table["output_tok_s"] = table["output_tokens_window"] / duration
    table["input_tok_s"] = table["input_tokens_window"] / duration
    table["total_tok_s"] = table["output_tok_s"] + table["input_tok_s"]
    table["rps"] = table["completions_window"] / duration
    table["achieved_rate"] = sums["in_window"] / duration
    table["goodput_rps"] = table["good_completions_window"] / duration
    table["slo_ci"] = pd.Series({step: wilson_interval(round(att * n), int(n)) if n and pd.notna(att) else None
                                 for step, att, n in zip(table.index, table["slo_attainment"],
                                                         table["slo_n"].fillna(0))}, dtype=object)
    table["decided"] = (table["ok"].fillna(0) + table["errors"].fillna(0)) >= options.min_requests
    # A window a few requests long holds the level's start (users ramping, the previous level's streams ending):
    # its rates are a count over that transient, not a rate the channel sustains at the level.
    table["steady"] = table["duration_s"] >= STEADY_REQUESTS * table["e2e_p50_s"]
    fillable = ["requests", "slo_n", "errors", "load_errors", "input_errors", "config_errors", "censored",
                "open_at_step_end", "warmup_excluded", "ok", "output_tokens", "completions_window"]
    table[fillable] = table[fillable].fillna(0).astype(np.int64)
    return table.sort_values(["load_level", "start"])


def shape_steps(table: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """The step table plus what its requests looked like: median token counts and gaps, connection set-up, the
    client's send lag, the formula test with the step's typical values, the TTFT-vs-input slope."""
    table = table.copy()
    done_ok = measured[measured["status"].eq("ok") & ~measured["in_flight"]]
    ok_group = done_ok.groupby("step", sort=True)
    table["input_tokens_p50"] = ok_group["input_tokens"].median()
    table["output_tokens_p50"] = ok_group["output_tokens"].median()
    table["itl_p50_s"] = ok_group["itl_p50_s"].median()
    table["itl_p99_s"] = ok_group["itl_p99_s"].median()
    if "connect_s" in measured:
        # Setup time is kept out of TTFT (t0 is taken on a ready connection): shown here on its own,
        # over the requests that opened a new connection.
        fresh = measured[measured["connect_s"].gt(0)].groupby("step", sort=True)["connect_s"]
        table["connect_p50_s"] = fresh.median()
        table["connect_p95_s"] = fresh.quantile(0.95)
    if "send_lag_s" in measured:
        # The client's own wait before each request was out (t0): kept out of TTFT, reported here.
        table["send_lag_p99_s"] = measured.groupby("step", sort=True)["send_lag_s"].quantile(0.99)
    table["formula_mape"] = _step_formula_mape(done_ok, table)
    ttft_fits = grouped_linear(done_ok["step"].to_numpy(), done_ok["input_tokens"].to_numpy(),
                               done_ok["ttft_s"].to_numpy())
    table["ttft_slope_s_per_token"] = pd.Series({k: v[0] for k, v in ttft_fits.items()}, dtype=float)
    return table


def measured_rows(df: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """Records that count towards their step's latency statistics: those started after its warm-up."""
    return df[df["started_at"].to_numpy() >= table["start"].reindex(df["step"]).to_numpy()]


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


@dataclass
class RunCounts:
    """What a run's records add up to; a run's are the sum of its parts' (`add`)."""

    requests: int = 0
    ok: int = 0  # finished successes
    errors: int = 0
    in_flight: int = 0
    cut_step_down: int = 0
    truncated: int = 0
    slo_met: int = 0  # over every judged request (`meets_slo`)
    slo_judged: int = 0
    ttft_s: float = 0.0  # summed over the finished successes: the share of e2e spent before the first token
    e2e_s: float = 0.0
    models: set[str] = field(default_factory=set)
    kinds: pd.DataFrame = field(default_factory=pd.DataFrame)  # step x error kind (`errors_by_kind`)

    @classmethod
    def of(cls, df: pd.DataFrame, slo: Slo, cut: float) -> RunCounts:
        done = df["status"].eq("ok").to_numpy() & ~df["in_flight"].to_numpy()
        ok = df[done]
        meets, known = meets_slo(df, slo, cut) if len(df) else (np.zeros(0, bool), np.zeros(0, bool))
        return cls(requests=len(df), ok=len(ok), errors=int(df["status"].eq("error").sum()),
                   in_flight=int(df["in_flight"].sum()),
                   cut_step_down=int(df["cut_before_end"].sum()) if "cut_before_end" in df else 0,
                   truncated=int(df["truncated"].fillna(False).astype(bool).sum()) if "truncated" in df else 0,
                   slo_met=int((meets & known).sum()), slo_judged=int(known.sum()), ttft_s=float(ok["ttft_s"].sum()),
                   e2e_s=float(ok["e2e_s"].sum()), models={str(m) for m in df["model"].dropna().unique()},
                   kinds=errors_by_kind(df).rename(columns=str))

    def add(self, other: RunCounts) -> RunCounts:
        if not len(other.kinds) or not len(self.kinds):
            kinds = self.kinds if len(self.kinds) else other.kinds
        else:
            kinds = self.kinds.add(other.kinds, fill_value=0).fillna(0).astype(np.int64)
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)[:-2]}  # the numbers
        return RunCounts(**summed, models=self.models | other.models, kinds=kinds)


def errors_by_kind(df: pd.DataFrame) -> pd.DataFrame:
    """Step x error_kind counts."""
    errs = df[df["status"].eq("error")]
    if errs.empty:
        return pd.DataFrame()
    return errs.groupby(["step", "error_kind"], observed=True).size().unstack(fill_value=0)
