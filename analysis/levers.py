"""The lever table: what each fix a user can try would do on this channel, predicted from the run's own requests.

The baseline is the run's heaviest typical request: its longest prompt and output
level (the largest a sweep or `[design]` chose; of measured lengths, the level of
the median request), its largest model, and its highest load level with enough
finished requests. Each lever changes one of them: halve the prompt (or cut it to
the length that meets the SLO), switch to each smaller model the run measured,
cap max_tokens (at the highest cap that meets the SLO), lower the load (to the
highest level that meets it). A prediction moves the requests along the run's
own models of log TTFT and log TPOT (`attribution.terms`: an effect per level of
each factor plus the interactions the data support; between two measured prompt
levels along the fitted prefill law, between output levels along log tokens),
and rebuilds each request's e2e as TTFT + TPOT x (N - 1), which is its
definition. Each request keeps its residuals, so the spread (and the SLO
attainment) follow from the run's own requests at that load. Intervals: a Poisson
bootstrap of the whole prediction. Rows are ranked by predicted SLO attainment,
then predicted e2e. A lever on factors the run moved together is not predicted:
the row says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import pandas as pd
from rich.table import Table
from rich.text import Text

from tokenload.analysis.attribution import (
    Factor,
    Terms,
    confounded,
    declared_sizes,
    factors,
    fit,
    interval,
    load_levels,
    resamples,
    terms,
    usable,
)
from tokenload.analysis.models import first_model
from tokenload.analysis.report import h, html_table
from tokenload.analysis.summary import Analysis
from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import LeverBaseline, LeverRow, Summary
from tokenload.slo import Slo

BOOTSTRAP = 200
SEED = 3434
# A load level becomes the baseline only with this many finished requests.
MIN_BASELINE_ROWS = 10
# Candidate prompt lengths and output caps tried between the smallest and the baseline's (log-spaced).
GRID = 32
# A prediction's spread comes from at most this many requests of its load level.
POOL = 2000


@dataclass(frozen=True)
class Target:
    """A condition to predict: a level code per factor, the input length and output cap, the load's level code."""

    codes: dict[str, int]
    input_tokens: float
    cap: float | None = None  # max_tokens cap (None: the outputs of the baseline's output level)
    notes: tuple[str, ...] = ()


@dataclass
class Model:
    """What a prediction needs of the run: the factors, the design, the log latencies, the prefill law."""

    rows: pd.DataFrame
    found: dict[str, Factor]
    terms: Terms
    log_ttft: np.ndarray
    log_tpot: np.ndarray
    outputs: np.ndarray
    itl_ratio: np.ndarray
    law: Callable[[float, str], float]
    slo: Slo
    together: set[str] = field(default_factory=set)
    sampled: np.ndarray = field(default_factory=lambda: np.ones(0, dtype=bool))
    _fit: dict[str, tuple[np.ndarray, np.ndarray]] | None = None

    def x(self, target: Target) -> np.ndarray | None:
        """The design row of `target`: between two prompt levels the rows mixed along the prefill law, between two
        output levels (a cap) along log tokens; beyond the levels measured, the nearest level's."""
        model = self.found["model"].names[target.codes["model"]]
        inputs = self._between("input", target.input_tokens, lambda n: math.log(self.law(n, model)))
        outputs = ([(target.codes["output"], 1.0)] if target.cap is None
                   else self._between("output", target.cap, lambda n: math.log(max(n, 1.0))))
        total = np.zeros(self.terms.cells.shape[1])
        for code_in, share_in in inputs:
            for code_out, share_out in outputs:
                row = self._row({**target.codes, "input": code_in, "output": code_out})
                if row is None:
                    return None
                total += share_in * share_out * row
        return total

    def _between(self, name: str, value: float, scale: Callable[[float], float]) -> list[tuple[int, float]]:
        """The two levels of a factor around `value` with their shares (along `scale`), or the nearest one."""
        values = self.found[name].values
        if len(values) < 2 or value <= values[0]:
            return [(0, 1.0)]
        if value >= values[-1]:
            return [(len(values) - 1, 1.0)]
        lo = int(np.searchsorted(values, value, side="right")) - 1
        a, b, v = scale(float(values[lo])), scale(float(values[lo + 1])), scale(value)
        share = (v - a) / (b - a) if b != a else 0.0
        return [(lo, 1.0 - share), (lo + 1, share)]

    def _row(self, codes: dict[str, int]) -> np.ndarray | None:
        varied = {name: code for name, code in codes.items() if self.found[name].varied}
        return self.terms.row(varied)

    def fitted(self, w: np.ndarray | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Coefficients and residuals of log TTFT and log TPOT, fitted with request weights `w` (None: the run's
        own fit, kept)."""
        if w is None and self._fit is not None:
            return self._fit
        out = {}
        for name, y in (("ttft", self.log_ttft), ("tpot", self.log_tpot)):
            beta = fit(self.terms, y, w)
            out[name] = (beta, y - (self.terms.cells @ beta)[self.terms.cell])
        if w is None:
            self._fit = out
        return out

    def pool(self, target: Target) -> np.ndarray:
        """The requests whose residuals stand for the target's spread: those at its load level (a seeded sample of
        POOL of them on a large run)."""
        return (self.found["load"].codes == target.codes["load"]) & self.sampled

    def outputs_of(self, target: Target, rows: np.ndarray) -> np.ndarray:
        """Output tokens of the target's requests: its output level's, capped."""
        at_level = self.found["output"].codes == target.codes["output"]
        n = self.outputs[at_level] if at_level.any() else self.outputs
        n = np.resize(n, int(rows.sum())) if rows.any() else n
        return np.minimum(n, target.cap) if target.cap is not None else n


def _meets(slo: Slo, ttft: np.ndarray, tpot: np.ndarray, e2e: np.ndarray, itl: np.ndarray) -> np.ndarray:
    ok = np.ones(len(ttft), dtype=bool)
    for limit, values in ((slo.ttft_s, ttft), (slo.tpot_s, tpot), (slo.e2e_s, e2e), (slo.itl_s, itl)):
        if limit is not None:
            ok &= ~(values > limit)
    return ok


def predict(m: Model, target: Target, w: np.ndarray | None = None,
            fitted: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> dict[str, float] | None:
    """Medians of TTFT, TPOT, e2e, the median output length and SLO attainment at `target` (weights `w` and the
    models `fitted` with them: a bootstrap replicate)."""
    x = m.x(target)
    if x is None:
        return None
    weights = np.ones(len(m.log_ttft)) if w is None else w
    pool = m.pool(target) & (weights > 0)
    if not pool.any():
        return None
    reps = weights[pool].astype(int)
    values: dict[str, np.ndarray] = {}
    for name, (beta, resid) in (fitted or m.fitted(w)).items():
        values[name] = np.repeat(np.exp(x @ beta + resid[pool]), reps)
    n = np.repeat(m.outputs_of(target, pool), reps)
    itl = values["tpot"] * np.repeat(m.itl_ratio[pool], reps)
    e2e = values["ttft"] + values["tpot"] * np.maximum(n - 1, 0)
    meets = _meets(m.slo, values["ttft"], values["tpot"], e2e, itl)
    if not np.isfinite(e2e).all():
        return None
    return {"ttft_s": float(np.median(values["ttft"])), "tpot_s": float(np.median(values["tpot"])),
            "e2e_s": float(np.median(e2e)), "output_tokens": float(np.median(n)), "attainment": float(meets.mean())}


def with_intervals(m: Model, targets: list[Target]) -> list[dict[str, Any] | None]:
    """Each target's prediction with its 95% Poisson-bootstrap interval per value (one refit per resample, shared
    by every target, so the levers' intervals are comparable); every target after the first (the baseline) also
    gets `vs_today`: its medians over the baseline's and its attainment minus the baseline's, with intervals from
    the same resamples (a change is known better than either value it joins)."""
    points = [predict(m, t) for t in targets]
    draws: list[list[dict[str, float] | None]] = [[] for _ in targets]
    weights, shrink = resamples(len(m.log_ttft), BOOTSTRAP, SEED)
    for w in weights:
        fitted = m.fitted(w)
        for i, t in enumerate(targets):
            draws[i].append(predict(m, t, w, fitted) if points[i] is not None else None)
    out: list[dict[str, Any] | None] = []
    for i, (point, got) in enumerate(zip(points, draws)):
        kept = [d for d in got if d is not None]
        if point is None or not kept:
            out.append(None)
            continue
        ci = {k: interval(point[k], [d[k] for d in kept], shrink, (0.0, 1.0) if k == "attainment" else (0.0, math.inf))
              for k in ("ttft_s", "tpot_s", "e2e_s", "attainment")}
        row: dict[str, Any] = {**{k: round(v, 6) for k, v in point.items()}, "ci": ci}
        base = points[0]
        if i and base is not None:
            pairs = [(d, b) for d, b in zip(got, draws[0]) if d is not None and b is not None]
            row["vs_today"] = {k: {"ratio": round(point[k] / base[k], 4),
                                   "ci": [round(v, 4) for v in interval(point[k] / base[k],
                                                                        [d[k] / b[k] for d, b in pairs], shrink)]}
                               for k in ("ttft_s", "tpot_s", "e2e_s")}
            row["vs_today"]["attainment"] = {
                "change": round(point["attainment"] - base["attainment"], 4),
                "ci": [round(v, 4) for v in interval(point["attainment"] - base["attainment"],
                                                     [d["attainment"] - b["attainment"] for d, b in pairs], shrink)]}
        out.append(row)
    return out


def _top(f: Factor) -> int:
    """The baseline's level of a length: the largest level chosen, or the level of the median measured one."""
    return int(np.median(f.codes)) if f.binned else len(f.values) - 1


def build(analysis: Analysis) -> tuple[Model, Target] | str:
    """The run's model and its baseline, or why there is none."""
    rows = usable(analysis.ok)
    if len(rows) < 2 * MIN_BASELINE_ROWS:
        return f"too few finished requests ({len(rows)}) to predict a lever"
    sizes = declared_sizes(analysis.run.manifest)
    found = factors(rows, load_levels(analysis), sizes)
    together = confounded(found)
    t = terms(found, together)
    law = prefill_law(analysis)
    load = found["load"]
    counts = np.bincount(load.codes, minlength=len(load.values))
    enough = [i for i, c in enumerate(counts) if c >= MIN_BASELINE_ROWS]
    model = found["model"]
    sized = [(v if np.isfinite(v) else -1.0, i) for i, v in enumerate(model.values)]
    first = first_model(analysis.run.manifest, model.names)
    base_model = max(sized)[1] if max(sized)[0] >= 0 else model.names.index(first)
    codes = {"input": _top(found["input"]), "output": _top(found["output"]),
             "model": base_model, "load": enough[-1] if enough else int(np.argmax(counts))}
    tpot = rows["tpot_s"].to_numpy(float)
    itl = rows["itl_p99_s"].to_numpy(float) if "itl_p99_s" in rows else np.full(len(rows), np.nan)
    m = Model(rows=rows, found=found, terms=t, log_ttft=np.log(rows["ttft_s"].to_numpy(float)),
              log_tpot=np.log(tpot), outputs=rows["output_tokens"].to_numpy(float),
              itl_ratio=np.where(np.isfinite(itl), itl / tpot, 1.0), law=law, slo=analysis.slo,
              together={name for c in together for name in (c.first, c.second)},
              sampled=_sample(load.codes, POOL))
    return m, Target(codes, float(found["input"].values[codes["input"]]))


def _sample(groups: np.ndarray, most: int) -> np.ndarray:
    """At most `most` rows of each group, a seeded random choice (all of a smaller group)."""
    keep = np.zeros(len(groups), dtype=bool)
    rng = np.random.default_rng(SEED)
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        keep[rows if len(rows) <= most else rng.choice(rows, most, replace=False)] = True
    return keep


def prefill_law(analysis: Analysis) -> Callable[[float, str], float]:
    """TTFT's shape in input length per model: the run's `prefill_law` (a + b n^k), else proportional to n."""
    law = analysis.summary.get("prefill_law")
    per_model = (law.get("models") or {}) if law else {}
    k = law["exponent"] if law else None

    def shape(n: float, model: str) -> float:
        coef = per_model.get(model)
        if k is None or coef is None or coef["a_s"] + coef["b"] * n ** k <= 0:
            return max(n, 1.0)
        return float(coef["a_s"] + coef["b"] * n ** k)

    return shape


def _cannot(m: Model, lever: str, change: str, factor: str) -> dict[str, Any]:
    partner = next(iter(m.together - {factor}), "another factor")
    return {"lever": lever, "change": change, "ttft_s": None, "tpot_s": None, "e2e_s": None, "attainment": None,
            "ci": None, "meets_slo": None,
            "note": (f"cannot be told from this run: {m.found[factor].label} moved together with "
                     f"{m.found[partner].label if partner in m.found else partner}; use [design]")}


def _best(m: Model, candidates: list[Target]) -> Target | None:
    """The first candidate (the gentlest change) whose predicted attainment meets the target."""
    for c in candidates:
        got = predict(m, c)
        if got is not None and got["attainment"] >= m.slo.target:
            return c
    return None


def _meets_today(m: Model, base: Target) -> bool:
    """The baseline meets the SLO already: a lever shows the margin it adds (halving), no search for a threshold."""
    got = predict(m, base)
    return got is not None and got["attainment"] >= m.slo.target


def _prompt(m: Model, base: Target) -> tuple[str, Target] | None:
    f = m.found["input"]
    if not f.varied or base.input_tokens <= f.values[0]:
        return None
    lengths = np.unique(np.geomspace(f.values[0], base.input_tokens, GRID).round())[::-1][1:]
    cuts = [replace(base, input_tokens=float(n)) for n in lengths]
    half = replace(base, input_tokens=max(base.input_tokens / 2, float(f.values[0])))
    found = None if _meets_today(m, base) else _best(m, cuts)
    if found is None or found.input_tokens <= half.input_tokens:
        return f"halve the prompt ({base.input_tokens:.0f} -> {half.input_tokens:.0f} input tokens)", half
    return (f"cut the prompt from {base.input_tokens:.0f} to {found.input_tokens:.0f} input tokens (the longest that "
            "meets the SLO)", found)


def _cap(m: Model, base: Target) -> tuple[str, Target] | None:
    f = m.found["output"]
    top = float(f.values[base.codes["output"]])
    if top <= 1:
        return None
    caps = np.unique(np.geomspace(1, top, GRID).round())[::-1][1:]
    found = None if _meets_today(m, base) else _best(m, [replace(base, cap=float(c)) for c in caps])
    if found is None:
        half = float(max(1, round(top / 2)))
        return f"halve max_tokens ({top:.0f} -> {half:.0f})", replace(base, cap=half)
    return f"cap max_tokens at {found.cap:.0f} (from {top:.0f}; the highest cap that meets the SLO)", found


def _load(m: Model, base: Target, unit: str) -> tuple[str, Target] | None:
    f = m.found["load"]
    lower = list(range(base.codes["load"]))[::-1]
    if not lower:
        return None
    candidates = [replace(base, codes={**base.codes, "load": code}) for code in lower]
    found = _best(m, candidates)
    chosen = found or candidates[-1]
    level = level_text(float(f.values[chosen.codes["load"]]), unit)
    why = " (the highest level that meets the SLO)" if found else " (the lowest level measured)"
    return f"lower the load from {level_text(float(f.values[base.codes['load']]), unit)} to {level}{why}", chosen


def _models(m: Model, base: Target) -> list[tuple[str, Target]]:
    f = m.found["model"]
    size = f.values[base.codes["model"]]
    out = []
    for code, (name, other) in enumerate(zip(f.names, f.values)):
        if code == base.codes["model"] or (np.isfinite(size) and np.isfinite(other) and other >= size):
            continue
        said = f" ({other:g}B)" if np.isfinite(other) else " (size unknown)"
        out.append((f"switch to {name}{said}", replace(base, codes={**base.codes, "model": code})))
    return out


def arithmetic(p: dict[str, Any]) -> str:
    """The seed's worked form with the predicted medians: 'TTFT 0.62 s + TPOT 0.024 s/token x 127 = 3.7 s'."""
    n = max(p["output_tokens"] - 1, 0)
    return (f"TTFT {p['ttft_s']:.3g} s + TPOT {p['tpot_s']:.3g} s/token x {n:.0f} = "
            f"{p['ttft_s'] + p['tpot_s'] * n:.3g} s")


def describe(m: Model, target: Target, unit: str) -> dict[str, Any]:
    f = m.found
    cap = target.cap if target.cap is not None else float(f["output"].values[target.codes["output"]])
    return {"input_tokens": round(target.input_tokens), "max_tokens": round(cap),
            "model": f["model"].names[target.codes["model"]],
            "load": level_text(float(f["load"].values[target.codes["load"]]), unit)}


def lever_table(analysis: Analysis) -> dict[str, Any]:
    """summary.json `levers` (ranked rows), `lever_baseline` and `lever_verdict`."""
    built = build(analysis)
    if isinstance(built, str):
        return {"levers": [], "lever_baseline": None, "lever_verdict": built}
    m, base = built
    unit = str(analysis.table["load_unit"].iloc[0]) if len(analysis.table) else "users"
    candidates: list[tuple[str, str, tuple[str, Target] | None]] = [
        ("prompt", "input", None if "input" in m.together else _prompt(m, base)),
        ("max_tokens", "output", None if "output" in m.together else _cap(m, base)),
        ("load", "load", None if "load" in m.together else _load(m, base, unit)),
    ]
    candidates += [("model", "model", pair) for pair in ([] if "model" in m.together else _models(m, base))]
    chosen = [(lever, *pair) for lever, factor, pair in candidates if factor not in m.together and pair is not None]
    baseline, *predicted = with_intervals(m, [base, *(target for _, _, target in chosen)])
    if baseline is None:
        return {"levers": [], "lever_baseline": None, "lever_verdict": "the baseline cannot be predicted"}
    rows = [_cannot(m, lever, CHANGES[factor], factor) for lever, factor, _ in candidates if factor in m.together]
    rows += [{"lever": lever, "change": change, **got, "meets_slo": got["attainment"] >= m.slo.target,
              "arithmetic": arithmetic(got), "condition": describe(m, target, unit)}
             for (lever, change, target), got in zip(chosen, predicted) if got is not None]
    rows.sort(key=lambda r: (r["attainment"] is None, -(r["attainment"] or 0), r["e2e_s"] or math.inf))
    return {"levers": rows,
            "lever_baseline": {**baseline, "arithmetic": arithmetic(baseline), "condition": describe(m, base, unit)},
            "lever_verdict": verdict(rows, baseline, m.slo)}


CHANGES = {"input": "shorten the prompt", "output": "cap max_tokens", "load": "lower the load",
           "model": "switch model"}


def verdict(rows: list[dict[str, Any]], baseline: dict[str, Any], slo: Slo) -> str:
    """Which single lever meets the SLO, said with the numbers."""
    def att(r: dict[str, Any]) -> str:
        return f"{100 * r['attainment']:.0f}% [{100 * r['ci']['attainment'][0]:.0f}, {100 * r['ci']['attainment'][1]:.0f}]"

    head = f"today {att(baseline)} of requests meet the SLO ({slo.describe()})"
    if baseline["attainment"] >= slo.target:
        return f"{head}: it is met; the levers show the margin each one adds"
    meeting = [r for r in rows if r.get("meets_slo")]
    if meeting:
        names = "; ".join(f"{r['change']}: {att(r)}" for r in meeting)
        return f"{head}; alone, these meet it: {names}"
    best = next((r for r in rows if r.get("attainment") is not None), None)
    if best is None:
        return f"{head}; no lever could be predicted from this run"
    return f"{head}; no single lever meets it: the best, {best['change']}, reaches {att(best)}"


def attach(analysis: Analysis) -> None:
    """Add `levers`, `lever_baseline` and `lever_verdict` to the summary (after `models.attach`)."""
    got = lever_table(analysis)
    s = analysis.summary
    s["levers"] = cast(list[LeverRow], got["levers"])
    s["lever_baseline"] = cast("LeverBaseline | None", got["lever_baseline"])
    s["lever_verdict"] = got["lever_verdict"]


HEADERS = ("rank", "lever", "TTFT p50 s", "TPOT p50 s", "e2e p50 s", "SLO met", "meets the SLO?", "arithmetic")


def table_rows(summary: Summary) -> list[list[str]]:
    """The lever table's rows (baseline first), shared by the terminal and the report."""
    def value(row: LeverBaseline | LeverRow, key: str, pct: bool = False) -> str:
        got = cast(dict[str, Any], row)
        v, ci = got.get(key), (got.get("ci") or {}).get(key)
        if v is None:
            return "n/a"
        if pct:
            return f"{100 * v:.0f}%" + (f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]" if ci else "")
        return f"{v:.3g}" + (f" [{ci[0]:.3g}, {ci[1]:.3g}]" if ci else "")

    base = summary.get("lever_baseline")
    out = []
    if base:
        c = base["condition"]
        out.append(["-", f"today: {c['input_tokens']} input tokens, max_tokens {c['max_tokens']}, {c['model']}, "
                         f"{c['load']}", value(base, "ttft_s"), value(base, "tpot_s"), value(base, "e2e_s"),
                    value(base, "attainment", True), "yes" if base["attainment"] >= summary["slo"]["target"] else "no",
                    base["arithmetic"]])
    for i, row in enumerate(summary.get("levers") or [], 1):
        meets = "n/a" if row.get("meets_slo") is None else "yes" if row["meets_slo"] else "no"
        out.append([str(i), row["change"] + (f" ({row['note']})" if row.get("note") else ""), value(row, "ttft_s"),
                    value(row, "tpot_s"), value(row, "e2e_s"), value(row, "attainment", True), meets,
                    row.get("arithmetic", "")])
    return out


def levers_html(summary: Summary) -> str:
    """The report's first section: the verdict sentence, then the table."""
    return (f"<p>{h(summary.get('lever_verdict') or '')}</p>" + html_table(HEADERS, table_rows(summary), left=2)
            + "<p class='note'>Predicted medians and SLO attainment with 95% intervals, from this run's own requests "
              "(docs/analysis.md#which-lever); each lever changes one thing of the baseline.</p>")


def levers_rich(summary: Summary) -> Table:
    """The lever table for the terminal, printed before the verdict (the intervals are in the report)."""
    table = Table(title=f"which lever: {summary.get('lever_verdict') or ''}", title_justify="left")
    for head in ("#", "lever", "predicted medians", "SLO met"):
        table.add_column(head, overflow="fold")
    for row in table_rows(summary):
        table.add_row(row[0], Text(row[1]), Text(row[7]), Text(row[5].split(" [")[0]),
                      style="green" if row[6] == "yes" else "")
    return table


def off_peak(base_label: str, base: Analysis, label: str, other: Analysis,
             pairs: list[tuple[int, int, tuple[str, float]]]) -> dict[str, Any] | None:
    """The off-peak lever of a comparison (peak vs off-peak, same models): at the highest load level both runs
    measured, what sending in the faster run's window gave, against the slower's. Measured, not predicted."""
    if not pairs:
        return None
    s_base, s_other, (unit, level) = pairs[-1]
    steps = {base_label: (base, base.table.loc[s_base]), label: (other, other.table.loc[s_other])}
    if any(pd.isna(row["e2e_p50_s"]) for _, row in steps.values()):
        return None
    slow, fast = sorted(steps, key=lambda k: -float(steps[k][1]["e2e_p50_s"]))
    row, was = steps[fast][1], steps[slow][1]
    ci = row["ci"] if isinstance(row["ci"], dict) else {}
    slo = steps[fast][0].slo
    out: dict[str, Any] = {
        "lever": "off_peak", "change": f"send at the time of {fast} instead of {slow}",
        "load": level_text(level, unit), "measured": True,
        **{f"{m}_s": float(row[f"{m}_p50_s"]) for m in ("ttft", "tpot", "e2e")},
        "attainment": None if pd.isna(row["slo_attainment"]) else float(row["slo_attainment"]),
        "ci": {**{f"{m}_s": ci.get(f"{m}_p50_s") for m in ("ttft", "tpot", "e2e")},
               "attainment": list(row["slo_ci"]) if isinstance(row["slo_ci"], tuple) else None},
        "today": {f"{m}_s": float(was[f"{m}_p50_s"]) for m in ("ttft", "tpot", "e2e")}
        | {"attainment": None if pd.isna(was["slo_attainment"]) else float(was["slo_attainment"])},
    }
    out["meets_slo"] = out["attainment"] is not None and out["attainment"] >= slo.target

    def said(key: str, name: str) -> str:
        interval_ = out["ci"].get(key)
        within = f" [{interval_[0]:.3g}, {interval_[1]:.3g}]" if interval_ else ""
        return f"{name} {out[key]:.3g} s{within} (was {out['today'][key]:.3g} s)"

    met = ("" if out["attainment"] is None or out["today"]["attainment"] is None else
           f", SLO met by {100 * out['attainment']:.0f}% (was {100 * out['today']['attainment']:.0f}%)")
    out["headline"] = (f"off-peak lever at {out['load']}: {out['change']} gives {said('ttft_s', 'TTFT p50')}, "
                       f"{said('e2e_s', 'e2e p50')}{met}")
    return out


def check_scenario(lever: dict[str, Any], baseline: dict[str, Any], requests: int, max_step_s: float = 600) -> str:
    """The scenario (TOML) that checks a lever: its condition beside the baseline's in one run (a design of the two
    cells at one load, or two load steps), each until about `requests` finished. Side by side, so the change is
    measured against today on the same channel at the same time (a shared machine's speed drifts between runs)."""
    c, b = lever["condition"], baseline["condition"]

    def levels(key: str) -> str:
        return str(sorted({c[key], b[key]}))

    users = sorted({int(c["load"].split()[0]), int(b["load"].split()[0])})
    design = '[design]\nkind = "factorial"\n' if len(users) == 1 else ""  # two load steps: one cell each
    return (f'[channel]\nmodels = {json.dumps(sorted({c["model"], b["model"]}))}\n'
            f"[prompt]\ntokens = {levels('input_tokens')}\n[output]\nmax_tokens = {levels('max_tokens')}\n"
            f"ignore_eos = true\n{design}[load]\nkind = \"steps\"\nusers = {users}\nstep_s = 1\n"
            f"min_requests = {requests * (2 if len(users) == 1 else 1)}\nmax_step_s = {max_step_s:g}\n"
            "[stop]\ndrain_min_s = 5\n")


def condition_rows(records: pd.DataFrame, condition: dict[str, Any]) -> pd.DataFrame:
    """A check run's finished requests of one lever condition (requests.parquet's columns)."""
    return records[(records["prompt_tokens_target"] == condition["input_tokens"])
                   & (records["max_tokens"] == condition["max_tokens"]) & (records["model"] == condition["model"])
                   & (records["active_users"] == int(condition["load"].split()[0])) & (records["status"] == "ok")
                   & ~records["in_flight"].fillna(False).astype(bool)]
