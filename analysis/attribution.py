"""Which factor moves the latency: TTFT, TPOT and e2e over input length, output length, model size and load.

For each metric, one least-squares model of the log latency of the run's own
finished requests: an effect per level of every factor that varied, plus the
pairwise interactions the data support (every pair of their levels seen at least
`MIN_CELL` times). A factor's share of the variance is its R² gain averaged over
every order the factors can enter in (Lindeman, Merenda and Gold), with a 95%
interval from a Poisson bootstrap of the requests: on the log scale a share is
about relative changes, which is what a lever changes. Factors that moved
together (a lockstep sweep, a model that changed with load) cannot be told apart:
they are named and share one entry, and no claim is judged from them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.analysis.fits import MIN_FIT_POINTS
from tokenload.analysis.report import h, html_table
from tokenload.analysis.summary import Analysis
from tokenload.contracts.manifest import Manifest
from tokenload.contracts.summary import Attribution, MetricShares, Summary
from tokenload.modelsize import model_size

# A factor with more distinct values than this is cut into QUANTILE_BINS bins of equal counts.
MAX_LEVELS = 12
QUANTILE_BINS = 4
# Two factors whose levels go together this closely (Cramér's V) cannot be told apart.
CONFOUNDED = 0.9
# An interaction is fitted when every pair of the two factors' levels has at least this many requests.
MIN_CELL = 3
BOOTSTRAP = 100
SEED = 34
BOOT_ROWS = 20_000
FACTORS: dict[str, str] = {"input": "input length", "output": "output length", "model": "model size", "load": "load"}
METRICS = ("ttft", "tpot", "e2e")


@dataclass
class Factor:
    """One factor of the run: a level code per request, and each level's value (tokens, billions, users)."""

    name: str
    label: str
    codes: np.ndarray
    values: np.ndarray
    names: list[str]
    binned: bool = False  # levels are quantile bins of a measured count, not values the run chose

    @property
    def varied(self) -> bool:
        return len(self.values) > 1


def _levels(keys: pd.Series, numeric: pd.Series) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Codes by the distinct `keys` (sorted), each level's value the median of `numeric` in it."""
    uniques = np.sort(keys.unique())
    codes = np.searchsorted(uniques, keys.to_numpy())
    values = np.array([float(np.median(numeric.to_numpy()[codes == i])) for i in range(len(uniques))])
    return codes, values, [f"{u:g}" if isinstance(u, (int, float, np.number)) else str(u) for u in uniques]


def _token_factor(name: str, ok: pd.DataFrame, planned: str, measured: str) -> Factor:
    """Levels by the planned column (a sweep or design), else the measured counts, cut in quantile bins when many."""
    count = ok[measured].astype(float)
    for column in ((measured, planned) if name == "output" else (planned, measured)):
        # a planned column that did not vary says nothing of lengths that did (answers that stopped early)
        levels = ok[column].nunique() if column in ok and ok[column].notna().all() else 0
        if 0 < levels <= MAX_LEVELS and (levels > 1 or column == measured or count.nunique() <= 1):
            codes, values, names = _levels(ok[column].astype(float), count)
            return Factor(name, FACTORS[name], codes, values, names)
    edges = np.unique(np.quantile(count, np.linspace(0, 1, QUANTILE_BINS + 1)[1:-1]))
    codes = np.searchsorted(edges, count.to_numpy(), side="right")
    values = np.array([float(np.median(count.to_numpy()[codes == i])) for i in range(len(edges) + 1)])
    present = np.unique(codes)
    codes = np.searchsorted(present, codes)
    return Factor(name, FACTORS[name], codes, values[present], [f"~{v:.0f}" for v in values[present]], binned=True)


def factors(ok: pd.DataFrame, load_levels: pd.Series, declared: dict[str, float] | None = None) -> dict[str, Factor]:
    """The four factors of the finished requests `ok`; `load_levels` maps step -> load level."""
    out = {"input": _token_factor("input", ok, "prompt_tokens_target", "input_tokens"),
           "output": _token_factor("output", ok, "max_tokens", "output_tokens")}
    models = ok["model"].astype(str).to_numpy()
    names = sorted(set(models))
    out["model"] = Factor("model", FACTORS["model"], np.searchsorted(names, models),
                          np.array([model_size(m, declared) or math.nan for m in names]), names)
    load = ok["step"].map(load_levels).astype(float)
    codes, values, names = _levels(load, load)
    out["load"] = Factor("load", FACTORS["load"], codes, values, names)
    return out


def declared_sizes(manifest: Manifest) -> dict[str, float]:
    """`[channel] model_sizes` of the run's resolved scenario."""
    sizes = ((manifest.get("scenario") or {}).get("channel") or {}).get("model_sizes") or {}
    return {str(k): float(v) for k, v in sizes.items() if isinstance(v, (int, float))}


def load_levels(analysis: Analysis) -> pd.Series:
    """Step -> its load level (users or requests/s)."""
    return analysis.table["load_level"] if len(analysis.table) else pd.Series(dtype=float)


def cramers_v(a: np.ndarray, b: np.ndarray) -> float:
    """Association of two level codes, 0 (independent) to 1 (each level of one comes with one level of the other)."""
    table = pd.crosstab(a, b).to_numpy(dtype=float)
    n = table.sum()
    k = min(table.shape) - 1
    if k == 0 or n == 0:
        return 0.0
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / n
    chi2 = float(((table - expected) ** 2 / expected).sum())
    return math.sqrt(chi2 / (n * k))


def _log_r(a: Factor, b: Factor) -> float | None:
    """Pearson r of the two factors' log values per request, when both have values."""
    x, y = a.values[a.codes], b.values[b.codes]
    if not (np.isfinite(x).all() and np.isfinite(y).all() and (x > 0).all() and (y > 0).all()):
        return None
    x, y = np.log(x), np.log(y)
    if x.std() == 0 or y.std() == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


@dataclass
class Confounding:
    """Two factors that moved together, and how closely."""

    first: str
    second: str
    v: float
    r: float | None

    def sentence(self, metric: str) -> str:
        a, b = FACTORS[self.first], FACTORS[self.second]
        how = f"r = {self.r:.2f}" if self.r is not None and abs(self.r) >= CONFOUNDED else f"Cramér's V = {self.v:.2f}"
        return (f"{a} and {b} moved together ({how}): which drives {metric} cannot be told from this run; "
                "use [design] (docs/scenarios.md)")


def confounded(found: dict[str, Factor]) -> list[Confounding]:
    varied = [f for f in found.values() if f.varied]
    out = []
    for a, b in itertools.combinations(varied, 2):
        v = cramers_v(a.codes, b.codes)
        if v >= CONFOUNDED:
            out.append(Confounding(a.name, b.name, v, _log_r(a, b)))
    return out


@dataclass
class Terms:
    """The columns of a log-latency model: the intercept, each factor's levels, the supported interactions."""

    groups: list[str]  # the groups (factors, or merged confounded factors) the shares are about
    columns: dict[tuple[str, ...], list[int]] = field(default_factory=dict)  # term -> its columns of X
    cells: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # X's distinct rows
    cell: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # each request's row of `cells`
    levels: dict[str, int] = field(default_factory=dict)  # group -> number of levels
    joint: dict[str, dict[tuple[int, int], int]] = field(default_factory=dict)  # merged group -> its levels' codes

    def subset(self, chosen: Sequence[str]) -> list[int]:
        """Columns of the model with the groups `chosen`: the intercept, their effects, their interactions."""
        cols = [0]
        for term, c in self.columns.items():
            if set(term) <= set(chosen):
                cols += c
        return cols

    def row(self, codes: dict[str, int]) -> np.ndarray | None:
        """The design row of one combination of the factors' level codes; None for a combination of confounded
        factors the run never sent (it cannot say what that costs)."""
        group_codes = dict(codes)
        for name, table in self.joint.items():
            a, b = name.split("+")
            if (codes[a], codes[b]) not in table:
                return None
            group_codes[name] = table[(codes[a], codes[b])]
        x = np.zeros(self.cells.shape[1])
        x[0] = 1.0
        for term, cols in self.columns.items():
            at = [group_codes[g] - 1 for g in term]
            if min(at) < 0:
                continue
            x[cols[at[0] if len(at) == 1 else at[0] * (self.levels[term[1]] - 1) + at[1]]] = 1.0
        return x


def _dummies(codes: np.ndarray, levels: int) -> np.ndarray:
    """One column per level but the first (the intercept stands for it)."""
    return (codes[:, None] == np.arange(1, levels)[None, :]).astype(float)


def terms(found: dict[str, Factor], merged: list[Confounding]) -> Terms:
    """The model's design matrix; confounded factors enter as one group with their joint levels."""
    codes: dict[str, np.ndarray] = {f.name: f.codes for f in found.values() if f.varied}
    joint: dict[str, dict[tuple[int, int], int]] = {}
    for pair in merged:
        if pair.first in codes and pair.second in codes:
            both = np.column_stack([codes.pop(pair.first), codes.pop(pair.second)])
            pairs, together = np.unique(both, axis=0, return_inverse=True)
            name = f"{pair.first}+{pair.second}"
            codes[name] = together.ravel()
            joint[name] = {(int(p[0]), int(p[1])): i for i, p in enumerate(pairs)}
    # X has one distinct row per combination of levels: built for those rows only, each request pointing at its own
    key = np.zeros(len(next(iter(found.values())).codes), dtype=np.int64)
    for c in codes.values():
        key = key * (int(c.max()) + 1) + c
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    at = {name: c[first] for name, c in codes.items()}
    n = len(first)
    blocks = [np.ones((n, 1))]
    out = Terms(groups=list(codes), levels={g: int(c.max()) + 1 for g, c in codes.items()}, joint=joint)
    width = 1
    for name, c in at.items():
        block = _dummies(c, out.levels[name])
        out.columns[(name,)] = list(range(width, width + block.shape[1]))
        width += block.shape[1]
        blocks.append(block)
    for first_group, second_group in itertools.combinations(codes, 2):
        cells = pd.crosstab(codes[first_group], codes[second_group]).to_numpy()
        if cells.min() < MIN_CELL:
            continue
        da, db = (_dummies(at[g], out.levels[g]) for g in (first_group, second_group))
        block = (da[:, :, None] * db[:, None, :]).reshape(n, -1)
        out.columns[(first_group, second_group)] = list(range(width, width + block.shape[1]))
        width += block.shape[1]
        blocks.append(block)
    out.cells, out.cell = np.hstack(blocks), inverse.ravel()
    return out


def _solve(g: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The least-squares coefficients from the normal equations; a resample that left a level (or a pair of levels)
    out leaves them singular, and then the minimum-norm solution stands (solve would return huge coefficients)."""
    try:
        beta = np.linalg.solve(g, b)
        if np.allclose(g @ beta, b, rtol=1e-8, atol=1e-10 * max(1.0, float(np.abs(b).max(initial=0.0)))):
            return beta
    except np.linalg.LinAlgError:
        pass
    return np.linalg.lstsq(g, b, rcond=None)[0]


def normal_equations(t: Terms, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float, float]:
    """X'WX, X'Wy, y'Wy, the weights' sum and the weighted sum of y. A request's row of X is its cell's (levels
    only), so the sums run over the cells: a million requests cost what their few dozen cells cost."""
    k = len(t.cells)
    sw = np.bincount(t.cell, w, k)
    swy = np.bincount(t.cell, w * y, k)
    yy = float((w * y * y).sum())  # not w @ (y * y): a BLAS dot of a long vector waited 14 ms on a busy machine
    return t.cells.T @ (t.cells * sw[:, None]), t.cells.T @ swy, yy, float(sw.sum()), float(swy.sum())


def r2_by_subset(t: Terms, y: np.ndarray, w: np.ndarray) -> dict[frozenset[str], float]:
    """R² of the model of every subset of the groups, fitted with request weights `w`."""
    g, b, yy, total, sy = normal_equations(t, y, w)
    sst = yy - sy * sy / total
    out: dict[frozenset[str], float] = {}
    for k in range(len(t.groups) + 1):
        for chosen in itertools.combinations(t.groups, k):
            cols = t.subset(chosen)
            beta = _solve(g[np.ix_(cols, cols)], b[cols])
            sse = yy - 2 * float(beta @ b[cols]) + float(beta @ g[np.ix_(cols, cols)] @ beta)
            out[frozenset(chosen)] = 1.0 - sse / sst if sst > 0 else 0.0
    return out


def lmg(r2: dict[frozenset[str], float], groups: Sequence[str]) -> dict[str, float]:
    """Each group's R² gain averaged over every order of entry: the shares add up to the full model's R²."""
    p = len(groups)
    out = {}
    for j in groups:
        others = [g for g in groups if g != j]
        share = 0.0
        for k in range(p):
            weight = math.factorial(k) * math.factorial(p - k - 1) / math.factorial(p)
            for chosen in itertools.combinations(others, k):
                s = frozenset(chosen)
                share += weight * (r2[s | {j}] - r2[s])
        out[j] = share
    return out


def fit(t: Terms, y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Coefficients of the full model (weighted least squares)."""
    g, b, *_ = normal_equations(t, y, np.ones(len(y)) if w is None else w)
    return _solve(g, b)


def metric_values(ok: pd.DataFrame, metric: str) -> np.ndarray:
    return ok[f"{metric}_s"].to_numpy(dtype=float)


def usable(ok: pd.DataFrame) -> pd.DataFrame:
    """Finished requests with a positive TTFT, TPOT and e2e (TPOT needs two tokens)."""
    keep = np.ones(len(ok), dtype=bool)
    for metric in METRICS:
        v = metric_values(ok, metric)
        keep &= np.isfinite(v) & (v > 0)
    return ok[keep]


def _pct(x: float) -> str:
    return f"{100 * max(x, 0.0):.0f}%"


def shares(t: Terms, y: np.ndarray, seed: int) -> dict[str, Any]:
    """R² of the full model and each group's share, each with its 95% bootstrap interval."""
    n = len(y)
    point_r2 = r2_by_subset(t, y, np.ones(n))
    point = lmg(point_r2, t.groups)
    draws: dict[str, list[float]] = {g: [] for g in [*t.groups, "r2"]}
    weights, shrink = resamples(n, BOOTSTRAP, seed)
    for w in weights:
        r2 = r2_by_subset(t, y, w)
        for g, v in lmg(r2, t.groups).items():
            draws[g].append(v)
        draws["r2"].append(r2[frozenset(t.groups)])

    full = point_r2[frozenset(t.groups)]
    return {"r2": round(full, 4), "r2_ci": interval(full, draws["r2"], shrink, (0.0, 1.0)),
            "shares": {g: {"share": round(point[g], 4), "ci": interval(point[g], draws[g], shrink, (0.0, 1.0))}
                       for g in t.groups},
            "_draws": draws, "_shrink": shrink}


def resamples(n: int, count: int, seed: int) -> tuple[Iterator[np.ndarray], float]:
    """`count` Poisson-bootstrap weight vectors over n requests, and the factor to scale their spread by.

    Above BOOT_ROWS requests the resamples are of a seeded subsample of BOOT_ROWS and their spread is scaled by
    sqrt(BOOT_ROWS / n) (the m-out-of-n bootstrap): a million requests' intervals in the time of 20,000's."""
    rng = np.random.default_rng(seed)
    if n <= BOOT_ROWS:
        return (rng.poisson(1.0, n).astype(float) for _ in range(count)), 1.0
    rows = rng.choice(n, BOOT_ROWS, replace=False)

    def subsampled() -> Iterator[np.ndarray]:
        for _ in range(count):
            w = np.zeros(n)
            w[rows] = rng.poisson(1.0, BOOT_ROWS)
            yield w

    return subsampled(), math.sqrt(BOOT_ROWS / n)


def interval(point: float, draws: Sequence[float], shrink: float = 1.0,
             within: tuple[float, float] | None = None) -> list[float]:
    """The 95% percentile interval of the resamples about their median, moved to the estimate, scaled by `shrink`
    (`resamples`) and kept `within` bounds.

    Moved, because a resample repeats requests and a model takes their noise for signal: a factor that does
    nothing gains a little R² in every resample, and the plain interval of a small share lies wholly above its
    estimate."""
    values = np.asarray(draws, dtype=float)
    values = values[np.isfinite(values)]
    lo, hi = point + (np.quantile(values, [0.025, 0.975]) - float(np.median(values))) * shrink
    if within is not None:
        lo, hi = (min(max(float(v), within[0]), within[1]) for v in (lo, hi))
    return [round(float(lo), 6), round(float(hi), 6)]


def _label(group: str) -> str:
    return " + ".join(FACTORS[g] for g in group.split("+"))


def output_claim(result: dict[str, Any], merged: list[Confounding], found: dict[str, Factor]) -> str:
    """The seed's third claim judged: total latency is driven mainly by output length, much less by input length."""
    for pair in merged:
        if {"input", "output"} & {pair.first, pair.second}:
            return pair.sentence("e2e")
    missing = [FACTORS[f] for f in ("input", "output") if not found[f].varied]
    if missing:
        return f"cannot tell: {' and '.join(missing)} did not vary in this run; use [design] (the levers scenario)"
    s = result["shares"]
    out, inp = s["output"], s["input"]
    draws = result["_draws"]
    lo, hi = interval(out["share"] - inp["share"], np.array(draws["output"]) - np.array(draws["input"]),
                      result["_shrink"])
    said = (f"output length explains {_pct(out['share'])} [{_pct(out['ci'][0])}, {_pct(out['ci'][1])}] of the "
            f"variance of log e2e, input length {_pct(inp['share'])} [{_pct(inp['ci'][0])}, {_pct(inp['ci'][1])}]")
    if lo > 0:
        return f"supported: {said}"
    if hi < 0:
        return f"not supported here: {said}"
    return f"cannot tell: {said} (their intervals overlap)"


def attribute(ok: pd.DataFrame, load_levels: pd.Series, declared: dict[str, float] | None = None) -> Attribution:
    """summary.json `attribution`: per metric the model's R², each factor's share with its interval; the claim."""
    rows = usable(ok)
    if len(rows) < 2 * MIN_FIT_POINTS:
        return {"note": f"too few finished requests ({len(rows)}) to attribute the latency", "e2e_verdict": None}
    found = factors(rows, load_levels, declared)
    varied = [f.label for f in found.values() if f.varied]
    steady = [f.label for f in found.values() if not f.varied]
    merged = confounded(found)
    t = terms(found, merged)
    out: dict[str, Any] = {
        "scale": "log",
        "factors": {f.name: {"varied": f.varied, "levels": [float(v) if np.isfinite(v) else None for v in f.values]}
                    for f in found.values()},
        "did_not_vary": steady,
        "moved_together": [{"factors": [c.first, c.second], "cramers_v": round(c.v, 3),
                            "r": None if c.r is None else round(c.r, 3)} for c in merged],
        "interactions": [list(k) for k in t.columns if len(k) == 2],
        "n": int(len(rows)),
    }
    if not varied:
        out["note"] = "no factor varied: nothing to attribute"
        out["e2e_verdict"] = "cannot tell: neither input nor output length varied in this run"
        return cast(Attribution, out)
    for i, metric in enumerate(METRICS):
        result = shares(t, np.log(metric_values(rows, metric)), SEED + i)
        out[metric] = {k: v for k, v in result.items() if not k.startswith("_")} | {
            "labels": {g: _label(g) for g in t.groups}}
        if metric == "e2e":
            out["e2e_verdict"] = output_claim(result, merged, found)
    return cast(Attribution, out)


def shares_text(entry: MetricShares) -> str:
    """'output length 71% [66, 75], input length 9% [6, 12], ... (R² 0.97)'."""
    parts = sorted(entry["shares"].items(), key=lambda kv: -kv[1]["share"])
    return ", ".join(f"{entry['labels'][g]} {_pct(v['share'])} [{_pct(v['ci'][0])}, {_pct(v['ci'][1])}]"
                     for g, v in parts) + f" (R² {entry['r2']:.2f})"


def attach(analysis: Analysis) -> None:
    """Add `attribution` to the summary; the verdict on output length (`e2e_drivers`) becomes its judgement."""
    s = analysis.summary
    s["attribution"] = found = attribute(analysis.ok, load_levels(analysis), declared_sizes(analysis.run.manifest))
    verdict = found.get("e2e_verdict")
    varied = found.get("factors", {})
    if verdict and all(f in varied and varied[f]["varied"] for f in ("input", "output")):  # else the sweep's own
        s["e2e_drivers"]["verdict"] = verdict
        s["e2e_drivers"]["basis"] = "attribution: every finished request, over input, output, model size and load"


def attribution_html(summary: Summary) -> str | None:
    """The report's "Which factor" section: each metric's shares with intervals, and what cannot be told."""
    a = summary.get("attribution") or cast(Attribution, {})
    shares = [(m, entry) for m in METRICS if (entry := cast("MetricShares | None", a.get(m)))]
    if not shares:
        return None
    rows = [[m.upper(), shares_text(entry)] for m, entry in shares]
    notes = [f"did not vary: {', '.join(a['did_not_vary'])}"] if a.get("did_not_vary") else []
    notes += [Confounding(p["factors"][0], p["factors"][1], p["cramers_v"], p["r"]).sentence("latency")
              for p in a.get("moved_together", [])]
    return (html_table(["metric", "share of the variance of log latency [95% interval]"], rows, left=2)
            + "".join(f"<p>{h(n)}</p>" for n in notes))
