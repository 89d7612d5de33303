"""Per model, everywhere: each model's percentiles and fits, their ratios at matched conditions, the size law.

Two models are compared only where both ran under the same conditions: the same
load level, prompt length and output length (a cell); within each cell the
difference of mean log latencies, averaged over the cells with weight
n_a n_b / (n_a + n_b), is the log of their ratio. With two or more model sizes
the same within-cell comparison, regressed on log size, is the exponent k of
latency ∝ size^k. Intervals come from a Poisson bootstrap of the requests.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.analysis.attribution import (
    Factor,
    confounded,
    declared_sizes,
    factors,
    interval,
    load_levels,
    resamples,
    usable,
)
from tokenload.analysis.fits import shared_power_fit, spread_note, ttft_vs_input
from tokenload.analysis.steps import errors_by_kind, latency_stats, pkey, step_table, steps_records
from tokenload.analysis.summary import Analysis, e2e_vs_output, formula_test, least_concurrent
from tokenload.analysis.windows import step_windows
from tokenload.contracts.manifest import Manifest
from tokenload.contracts.summary import ModelEntry, ModelRatio, PrefillLaw, SizeLaw
from tokenload.modelsize import model_size

BOOTSTRAP = 200
PREFILL_BOOTSTRAP = 100
SEED = 2025
# TTFT (at matched input length and load) and TPOT (at matched load); e2e is compared too
LAW_METRICS = ("ttft", "tpot")
RATIO_METRICS = ("ttft", "tpot", "e2e")
# A model's own steps: these keys of summary.json's steps[], from its requests alone.
STEP_KEYS = ("step", "load_level", "load_unit", "active_users", "requests", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s",
             "tpot_p95_s", "e2e_p50_s", "e2e_p95_s", "slo_attainment", "formula_mape", "ci")


def cells(found: dict[str, Factor]) -> np.ndarray:
    """One code per (load, input, output) combination: the conditions two models are matched on."""
    joint = found["load"].codes * 1_000_000 + found["input"].codes * 1000 + found["output"].codes
    return np.unique(joint, return_inverse=True)[1]


def within_cells(y: np.ndarray, x: np.ndarray, cell: np.ndarray, w: np.ndarray) -> float | None:
    """Slope of y on x inside cells (cell fixed effects), by weighted least squares; None when x never varies in a cell."""
    k = int(cell.max()) + 1
    sw = np.bincount(cell, w, k)
    with np.errstate(invalid="ignore", divide="ignore"):
        xm = np.bincount(cell, w * x, k) / sw
        ym = np.bincount(cell, w * y, k) / sw
    dx, dy = x - xm[cell], y - ym[cell]
    sxx = float(np.nansum(w * dx * dx))
    return float(np.nansum(w * dx * dy)) / sxx if sxx > 1e-12 else None


def slope_ci(y: np.ndarray, x: np.ndarray, cell: np.ndarray, seed: int) -> tuple[float, list[float]] | None:
    """The within-cell slope and its 95% Poisson-bootstrap interval."""
    point = within_cells(y, x, cell, np.ones(len(y)))
    if point is None:
        return None
    weights, shrink = resamples(len(y), BOOTSTRAP, seed)
    draws = [d for d in (within_cells(y, x, cell, w) for w in weights) if d is not None]
    return point, interval(point, draws, shrink)


def matched(x: np.ndarray, cell: np.ndarray) -> np.ndarray:
    """Rows in cells where x takes more than one value (the others compare nothing)."""
    k = int(cell.max()) + 1
    lo = np.full(k, np.inf)
    hi = np.full(k, -np.inf)
    np.minimum.at(lo, cell, x)
    np.maximum.at(hi, cell, x)
    return (hi > lo)[cell]


def ratio(rows: pd.DataFrame, found: dict[str, Factor], second: np.ndarray, seed: int) -> dict[str, Any]:
    """TTFT, TPOT and e2e of the rows where `second` is True over the others, at matched cells, with intervals."""
    x = second.astype(float)
    cell = cells(found)
    keep = matched(x, cell)
    out: dict[str, Any] = {"matched_cells": int(len(np.unique(cell[keep]))), "n": int(keep.sum())}
    for i, metric in enumerate(RATIO_METRICS):
        got = slope_ci(np.log(rows[f"{metric}_s"].to_numpy(float))[keep], x[keep],
                       np.unique(cell[keep], return_inverse=True)[1], seed + i) if keep.any() else None
        out[metric] = None if got is None else {"ratio": round(float(np.exp(got[0])), 4),
                                                "ci": [round(float(np.exp(v)), 4) for v in got[1]]}
    return out


def ratio_text(name: str, base: str, r: dict[str, Any]) -> str:
    """'sim-30b vs sim-7b: TTFT x2.50 [2.41, 2.58], TPOT x2.54 [2.50, 2.58], e2e x2.53 [...] (12 matched cells)'."""
    if not r["matched_cells"]:
        return (f"{name} vs {base}: never ran under the same load, prompt and output length: not compared "
                "(use [design])")
    parts = [f"{m.upper()} x{r[m]['ratio']:.2f} [{r[m]['ci'][0]:.2f}, {r[m]['ci'][1]:.2f}]"
             for m in RATIO_METRICS if r.get(m)]
    return f"{name} vs {base}: {', '.join(parts)} ({r['matched_cells']} matched cells, {r['n']} requests)"


def per_model(analysis: Analysis, sizes: dict[str, float]) -> dict[str, ModelEntry]:
    """summary.json `models`: per model n, size, TTFT/TPOT/e2e p50 and p95 with intervals, its own fits."""
    run, df = analysis.run, analysis.run.df
    used = analysis.table.loc[analysis.low_steps] if analysis.low_steps else analysis.table.iloc[0:0]
    in_flight = used["achieved_concurrency"].fillna(used["active_users"]) if len(used) else pd.Series(dtype=float)
    concurrency = float(in_flight.median()) if len(in_flight) else None  # the run's fit's: queueing named alike
    out: dict[str, ModelEntry] = {}
    for i, model in enumerate(sorted(str(m) for m in df["model"].dropna().unique())):
        rows = df[df["model"].astype(str) == model]
        stats = latency_stats(rows, run.cut, (50, 95), seed=100 + i)
        entry: dict[str, Any] = {"n": int(stats["e2e_n"]), "size_b": model_size(model, sizes)}
        for metric in ("ttft", "tpot", "e2e"):
            for p in (50, 95):
                value = stats[pkey(metric, p)]
                entry[pkey(metric, p)] = None if not np.isfinite(value) else round(float(value), 6)
        entry["ci"] = stats["ci"]
        entry["bounds"] = stats["bounds"]
        ok = analysis.ok[analysis.ok["model"].astype(str) == model]
        aside = run.aside[run.aside["model"].astype(str) == model] if len(run.aside) else run.aside
        table = analysis.table if len(df["model"].dropna().unique()) == 1 else step_table(
            rows, analysis.slo, step_windows(rows, run.manifest, run.cut), run.cut, analysis.options, aside=aside)
        entry["steps"] = [{k: cast(dict[str, Any], step)[k] for k in STEP_KEYS}
                          for step in steps_records(table, errors_by_kind(rows))]
        entry["formula"] = formula_test(ok, table) if len(ok) else None
        low = ok[ok["step"].isin(analysis.low_steps)]
        alone, reason = least_concurrent(low, df)
        ttft = ttft_vs_input(alone["input_tokens"].to_numpy(), alone["ttft_s"].to_numpy(), concurrency=concurrency)
        ttft["requests_used"] = reason
        e2e = e2e_vs_output(low, float(low["ttft_s"].median()) if len(low) else None,
                      float(low["tpot_s"].median()) if len(low) else None)
        entry["fits"] = {"ttft_vs_input": ttft, "e2e_vs_output": e2e}
        out[model] = cast(ModelEntry, entry)
    return out


def prefill_law(analysis: Analysis) -> PrefillLaw:
    """summary.json `prefill_law`: TTFT = a + b n^k per model with one exponent k for all of them, fitted on the
    low-load requests that ran alone (`least_concurrent`); k with its 95% bootstrap interval, the first claim
    judged."""
    low = analysis.ok[analysis.ok["step"].isin(analysis.low_steps)]
    alone, reason = least_concurrent(low, analysis.run.df)
    alone = alone[(alone["input_tokens"] > 0) & np.isfinite(alone["ttft_s"].to_numpy(float))]
    x = alone["input_tokens"].to_numpy(float)
    note = spread_note(x, "input length", "levers")
    lengths = len(np.unique(np.round(np.log(x), 1)))  # distinct within 10%
    if note is None and lengths < 3:
        note = f"{lengths} prompt lengths fit any exponent exactly; send 3 or more (the levers scenario sends 4)"
    if note is not None:
        return {"exponent": None, "ci": None, "n": int(len(alone)), "verdict": f"cannot tell: {note}"}
    y = alone["ttft_s"].to_numpy(float)
    names = sorted(set(alone["model"].astype(str)))
    groups = np.searchsorted(names, alone["model"].astype(str).to_numpy())
    k, coefs = shared_power_fit(x, y, groups)
    rng = np.random.default_rng(SEED)
    draws = []
    for _ in range(PREFILL_BOOTSTRAP):
        i = rng.integers(0, len(x), len(x))
        if all((groups[i] == g).sum() >= 3 for g in np.unique(groups)):
            draws.append(shared_power_fit(x[i], y[i], groups[i], near=k)[0])
    lo, hi = (float(v) for v in np.quantile(draws, [0.025, 0.975]))
    law = f"TTFT grows as n^{k:.2f} [{lo:.2f}, {hi:.2f}] with input length"
    scope = f" ({len(names)} models, one exponent)" if len(names) > 1 else ""
    verdict = (f"supported: {law} (< 1){scope}" if hi < 1 else f"contradicted: {law} (> 1){scope}" if lo > 1
               else f"cannot tell: {law}{scope}, an interval that holds 1")
    return {"exponent": round(float(k), 4), "ci": [round(lo, 4), round(hi, 4)], "n": int(len(alone)),
            "requests_used": reason, "models": {n: {"a_s": round(coefs[i][0], 6), "b": float(f"{coefs[i][1]:.6g}")}
                                                for i, n in enumerate(names)},
            "verdict": verdict}


def size_law(rows: pd.DataFrame, found: dict[str, Factor]) -> SizeLaw | None:
    """summary.json `model_size_law`: latency ∝ size^k for TTFT and TPOT at matched conditions (>= 2 sizes)."""
    model = found["model"]
    size = model.values[model.codes]
    known = np.isfinite(size)
    if len(np.unique(size[known])) < 2:
        return None
    out: dict[str, Any] = {"exponent": {}, "ci": {}, "sizes_b": {n: (float(v) if np.isfinite(v) else None)
                                                                  for n, v in zip(model.names, model.values)}}
    together = [c for c in confounded(found) if "model" in (c.first, c.second)]
    cell = cells(found)[known]
    x = np.log(size[known])
    keep = matched(x, cell)
    if together or not keep.any():
        reason = (together[0].sentence("latency").replace("which drives latency", "the model's own effect")
                  if together else "no load level, prompt length and output length ran more than one model size: "
                  "the model's own effect cannot be told from this run; use [design]")
        return cast(SizeLaw, {**out, "exponent": {m: None for m in LAW_METRICS},
                              "ci": {m: None for m in LAW_METRICS}, "verdict": reason})
    cell = np.unique(cell[keep], return_inverse=True)[1]
    for i, metric in enumerate(LAW_METRICS):
        y = np.log(rows[f"{metric}_s"].to_numpy(float))[known][keep]
        got = slope_ci(y, x[keep], cell, SEED + i)
        out["exponent"][metric] = None if got is None else round(got[0], 4)
        out["ci"][metric] = None if got is None else [round(v, 4) for v in got[1]]
    out["matched_cells"] = int(cell.max()) + 1
    out["verdict"] = _law_verdict(out, model)
    return cast(SizeLaw, out)


def _law_verdict(law: dict[str, Any], model: Factor) -> str:
    """'sub-linear: TPOT grows as size^0.63 [0.60, 0.66], TTFT as size^0.62 [...]; a 30B model is 2.5x a 7B one'."""
    k, ci = law["exponent"], law["ci"]
    said = [f"{m.upper()} grows as size^{k[m]:.2f} [{ci[m][0]:.2f}, {ci[m][1]:.2f}]" for m in ("tpot", "ttft")
            if k.get(m) is not None]
    if not said:
        return "cannot tell: too few requests at matched conditions"
    highs = [ci[m][1] for m in LAW_METRICS if ci.get(m)]
    lows = [ci[m][0] for m in LAW_METRICS if ci.get(m)]
    sized = sorted((v, n) for n, v in zip(model.names, model.values) if np.isfinite(v))
    (small, small_name), (big, big_name) = sized[0], sized[-1]
    tpot = k.get("tpot") if k.get("tpot") is not None else k.get("ttft")
    example = (f"; {big_name} ({big:g}B) is {(big / small) ** tpot:.2f}x {small_name} ({small:g}B), "
               f"{big / small:.1f}x in size")
    if max(highs) < 1:
        return f"sub-linear: {', '.join(said)}{example}"
    if min(lows) > 1:
        return f"super-linear: {', '.join(said)}{example}"
    return f"cannot tell whether sub-linear: {', '.join(said)}{example}"


def attach(analysis: Analysis) -> None:
    """Add `models`, `model_size_law` and the model ratios to the summary; the run-level TTFT fit of a run of
    several models becomes the first model's (a line through several models' clouds describes none)."""
    s = analysis.summary
    sizes = declared_sizes(analysis.run.manifest)
    s["models"] = per_model(analysis, sizes)
    s["prefill_law"] = prefill_law(analysis)
    rows = usable(analysis.ok)
    s["model_size_law"] = None
    if len(s["models"]) < 2 or len(rows) < 2:
        return
    found = factors(rows, load_levels(analysis), sizes)
    s["model_size_law"] = size_law(rows, found)
    names = found["model"].names
    base = first_model(analysis.run.manifest, names)
    s["model_ratios"] = []
    for j, other in enumerate(n for n in names if n != base):
        got = ratio(rows, found, rows["model"].astype(str).to_numpy() == other, SEED + 10 * j)
        s["model_ratios"].append(cast(ModelRatio, {"model": other, "baseline": base, **got,
                                                   "headline": ratio_text(other, base, got)}))
    fit = s["models"][base]["fits"]["ttft_vs_input"]
    s["fits"]["ttft_vs_input"] = {**fit, "steps_used": s["fits"]["ttft_vs_input"].get("steps_used", []),
                                  "steps_used_reason": s["fits"]["ttft_vs_input"].get("steps_used_reason", ""),
                                  "of_model": base,
                                  "note": f"{base}'s requests only (the run has {len(names)} models; each one's fit is "
                                          "in models)"}


def first_model(manifest: Manifest, present: list[str]) -> str:
    """The channel's own model (the first of the scenario's list) when it ran, else the first present."""
    listed = ((manifest.get("scenario") or {}).get("channel") or {}).get("models") or []
    return next((m for m in listed if m in present), present[0])



def compare_models(base: Analysis, other: Analysis, label: str) -> dict[str, Any] | None:
    """`other` against `base` at matched load level, prompt and output length, when they ran other models: a
    comparison of two models (two runs, or two models of one run). None when both ran the same models."""
    names = [sorted(str(m) for m in a.ok["model"].unique()) for a in (base, other)]
    if names[0] == names[1] or not all(names):
        return None
    parts, levels = [], {}
    for i, a in enumerate((base, other)):  # steps of the second run renumbered: both runs have a step 1
        rows = usable(a.ok)
        parts.append(rows.assign(step=rows["step"] + 1_000_000 * i, _other=bool(i)))
        levels.update({int(cast(int, step)) + 1_000_000 * i: float(level) for step, level in load_levels(a).items()})
    rows = pd.concat(parts, ignore_index=True)
    if len(rows) < 2:
        return None
    found = factors(rows, pd.Series(levels, dtype=float), declared_sizes(base.run.manifest))
    got = ratio(rows, found, rows["_other"].to_numpy(), SEED)
    name, baseline = " + ".join(names[1]), " + ".join(names[0])
    return {"label": label, "model": name, "baseline": baseline, **got, "headline": ratio_text(name, baseline, got)}
