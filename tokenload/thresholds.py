"""Thresholds: pass/fail gates over summary.json's own numbers, for CI (`ttft.p95 < 1.2`, exit 99 when breached).

A scenario's `[thresholds] checks` and the repeatable `--threshold EXPR` of run, analyze and compare hold
expressions `NAME OP BOUND`, OP one of `<`, `<=`, `>`, `>=`. NAME is a number summary.json holds, in its own
names; the valid ones follow from its types (`tokenload.contracts.summary`):

- `ttft.p95`, `tpot.p50`, `e2e.p99`: the whole run's percentile (`latency`), any percentile;
- `slo_attainment`, `error_rate`, `capacity`: the run's SLO attainment (`slo.attainment`), its error rate
  (`diagnosis.error_rate`: errors other than input errors over all requests), a searched run's capacity;
- a step's number (a key of `steps[]`: `output_tok_s`, `rps`, `goodput_rps`, ...; `ttft.p95` for
  `ttft_p95_s`) at one load level, `steps[users=8].ttft.p95`, `steps[rate=2].error_rate`, `steps[step=3].rps`,
  or without a selector at every step the analysis judged (each one must pass);
- `models["sim-7b"].tpot.p50`: one model's percentile;
- any other number by its path: `formula.mape_simple`, `run.errors`, `fits.ttft_vs_input.r2`.

BOUND is a number (seconds, a share, a count). `tokenload compare` also takes bounds against its baseline:
`ttft.p95 <= +10%` (at every matched load level, from compare's bootstrap intervals of the delta) and
`capacity >= baseline - 1` (`baseline`, `baseline + N`, `baseline - N`).

A number with an interval (a percentile: its 95% bootstrap interval; a share: its 95% Wilson interval) is
breached only when the interval lies beyond the bound, passes when it lies within, and is `inconclusive`
when it straddles the bound: `--inconclusive fail` counts that as a breach (default: it does not).
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

from tokenload.contracts.summary import Latency, StepRow, Summary
from tokenload.errors import ConfigError

Op = Literal["<", "<=", ">", ">="]
Result = Literal["pass", "fail", "inconclusive"]
OPS: tuple[str, ...] = ("<=", ">=", "<", ">")  # longest first, for parsing
# Exit codes of a gated command: every threshold passed / one was breached (k6's code).
PASSED, BREACHED = 0, 99
INCONCLUSIVE_CHOICES = ("pass", "fail")

# Names of the run's own numbers that summary.json keeps under a longer path.
ALIASES: dict[str, tuple[str, ...]] = {
    "slo_attainment": ("slo", "attainment"),
    "error_rate": ("diagnosis", "error_rate"),
    "capacity": ("search", "capacity"),
}
# The numbers that may stop a run early (`abort_on_fail`): the live statistics count them as they come.
LIVE_NAMES = frozenset({"error_rate", "slo_attainment"})
STEP_SELECTORS = ("users", "rate", "step")
_UNIONS = (Union, types.UnionType)

_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_PERCENTILE = re.compile(rf"^([a-z0-9]+)\.p({_NUMBER})$")
_SCOPE = re.compile(r"""^(?:(steps|models)\[([^\]]*)\]\.)?(.+)$""")
_STEP_SELECTOR = re.compile(rf"^\s*({'|'.join(STEP_SELECTORS)})\s*=\s*({_NUMBER})\s*$")
_MODEL_SELECTOR = re.compile(r"""^\s*(["'])(.+)\1\s*$""")
_RELATIVE = re.compile(rf"^([+-]{_NUMBER})\s*%$")
_BASELINE = re.compile(rf"^baseline\s*(?:([+-])\s*({_NUMBER}))?$")


def metrics() -> tuple[str, ...]:
    """The latency metrics summary.json has whole-run percentiles of (`Latency`'s keys)."""
    return tuple(get_type_hints(Latency))


def _options(hint: Any) -> list[Any]:
    """A hint's alternatives without None (`float | None` -> [float]); a list or a map is one alternative."""
    if get_origin(hint) in _UNIONS:
        return [a for a in get_args(hint) if a is not type(None)]
    return [hint]


def _numeric(hint: Any) -> bool:
    return all(a in (int, float) for a in _options(hint))


def run_paths() -> dict[str, tuple[str, ...]]:
    """Every number of summary.json outside its lists and maps, by dotted path (`formula.mape_simple`)."""
    out: dict[str, tuple[str, ...]] = {}

    def walk(typed: Any, path: tuple[str, ...]) -> None:
        for key, hint in get_type_hints(typed).items():
            if _numeric(hint) and key != "schema_version":
                out[".".join((*path, key))] = (*path, key)
            for sub in _options(hint):
                if is_typeddict(sub):
                    walk(sub, (*path, key))

    walk(Summary, ())
    return out


def step_keys() -> tuple[str, ...]:
    """The numbers of a step row (`steps[]`), its latency percentiles as `ttft.p95`."""
    out = []
    for key, hint in get_type_hints(StepRow).items():
        if key != "step" and _numeric(hint):
            found = re.match(rf"^(ttft|tpot|e2e|itl)_p({_NUMBER})_s$", key)
            out.append(f"{found[1]}.p{found[2]}" if found else key)
    return tuple(out)


@dataclass(frozen=True)
class Threshold:
    """One parsed expression: where its number is (`scope`, `selector`), which (`name`), and its bound."""

    expr: str
    name: str  # "ttft.p95", "error_rate", "output_tok_s", "formula.mape_simple"
    op: Op
    scope: Literal["run", "steps", "model"] = "run"
    selector: tuple[str, float] | str | None = None  # ("users", 8.0); a model's name; None: every step
    bound: float | None = None  # an absolute bound
    relative: float | None = None  # compare: +0.10 for "+10%"
    offset: float | None = None  # compare: "baseline - 1" is -1.0
    abort_on_fail: bool = False

    @property
    def percentile(self) -> tuple[str, float] | None:
        """("ttft", 95.0) for a percentile's name."""
        found = _PERCENTILE.match(self.name)
        return (found[1], float(found[2])) if found else None

    @property
    def against_baseline(self) -> bool:
        return self.relative is not None or self.offset is not None

    @property
    def step_key(self) -> str:
        """The name as a key of a step row: `ttft.p95` -> `ttft_p95_s`."""
        pct = self.percentile
        return f"{pct[0]}_p{pct[1]:g}_s" if pct else self.name

    @property
    def where(self) -> str:
        """'the whole run', 'at 8 users', 'at every step', 'model sim-7b'."""
        if self.scope == "model":
            return f"model {self.selector}"
        if self.scope == "steps" and isinstance(self.selector, tuple):
            kind, level = self.selector
            unit = "req/s" if kind == "rate" else "user" if level == 1 else "users"
            return f"at step {level:g}" if kind == "step" else f"at {level:g} {unit}"
        return "at every step" if self.scope == "steps" else "the whole run"

    def bound_text(self) -> str:
        if self.relative is not None:
            return f"{self.op} baseline {self.relative:+.0%}"
        if self.offset is not None:
            return f"{self.op} baseline{f' {self.offset:+g}' if self.offset else ''}"
        return f"{self.op} {self.bound:g}"


def valid_names() -> str:
    """The names a threshold may use, in words (the message of an unknown name)."""
    groups: dict[str, list[str]] = {}
    for path in run_paths().values():
        if path not in ALIASES.values() and path[0] != "latency":
            groups.setdefault(".".join(path[:-1]), []).append(path[-1])
    paths = "; ".join(f"{head}.{{{', '.join(tails)}}}" if head else ", ".join(tails) for head, tails in groups.items())
    return (f"{', '.join(f'{m}.pP' for m in metrics())} (any percentile P, e.g. ttft.p95); "
            f"{', '.join(ALIASES)}; a step's number as steps[users=N].NAME, steps[rate=R].NAME, "
            f"steps[step=K].NAME, or NAME alone for every step, NAME one of {', '.join(step_keys())}; "
            f"models[\"MODEL\"].ttft.pP (tpot, e2e); or a number by its path: {paths}")


def parse(expr: str, *, abort_on_fail: bool = False, baseline: bool = False) -> Threshold:
    """`ttft.p95 < 1.2` -> a `Threshold`; a `ConfigError` (exit 2) naming the problem and the valid names.

    `baseline`: bounds against a baseline (`+10%`, `baseline - 1`) are allowed (compare)."""
    text = expr.strip()
    for op in OPS:
        left, found, right = text.partition(op)
        if found:
            break
    else:
        raise ConfigError(f"threshold {expr!r}: expected NAME OP BOUND with OP one of <, <=, >, >=, "
                          "e.g. 'ttft.p95 < 1.2'")
    scope, selector, name = _scope(left.strip(), expr)
    bound, relative, offset = _bound(right.strip(), expr, baseline)
    threshold = Threshold(expr=text, name=name, op=found,  # type: ignore[arg-type]
                          scope=scope, selector=selector, bound=bound, relative=relative, offset=offset,
                          abort_on_fail=abort_on_fail)
    _check_name(threshold)
    live = threshold.scope == "run" and (threshold.percentile is not None or threshold.name in LIVE_NAMES)
    if abort_on_fail and not live:
        raise ConfigError(f"threshold {expr!r}: abort_on_fail judges the whole run's percentiles (ttft.p95, "
                          "tpot.p50, e2e.p99, ...), error_rate and slo_attainment as the requests come; "
                          f"{threshold.name} {threshold.where} is known only at the end: drop abort_on_fail")
    if abort_on_fail and (threshold.name, found in ("<", "<=")) in (("error_rate", False), ("slo_attainment", True)):
        raise ConfigError(f"threshold {expr!r}: abort_on_fail stops a run whose error_rate is too high or whose "
                          "slo_attainment is too low ('error_rate < 0.01', 'slo_attainment >= 0.9')")
    if relative is not None and not threshold.percentile:
        raise ConfigError(f"threshold {expr!r}: a relative bound (+N%) judges a percentile against the "
                          "baseline's at each matched load level, e.g. 'ttft.p95 <= +10%'")
    return threshold


def _scope(left: str, expr: str) -> tuple[Literal["run", "steps", "model"], tuple[str, float] | str | None, str]:
    found = _SCOPE.match(left)
    if not found or not left:
        raise ConfigError(f"threshold {expr!r}: no name before the operator; valid names: {valid_names()}")
    kind, inner, name = found[1], found[2], found[3]
    if kind == "models":
        model = _MODEL_SELECTOR.match(inner)
        if model is None:
            raise ConfigError(f"threshold {expr!r}: name the model in quotes, e.g. models[\"sim-7b\"].tpot.p50")
        return "model", model[2], name
    if kind == "steps":
        if inner.strip() in ("", "*"):
            return "steps", None, name
        step = _STEP_SELECTOR.match(inner)
        if step is None:
            raise ConfigError(f"threshold {expr!r}: select a step as steps[users=8], steps[rate=2] or "
                              "steps[step=3]")
        return "steps", (step[1], float(step[2])), name
    return "run", None, name


def _bound(right: str, expr: str, baseline: bool) -> tuple[float | None, float | None, float | None]:
    relative, against = _RELATIVE.match(right), _BASELINE.match(right)
    if relative or against:
        if not baseline:
            raise ConfigError(f"threshold {expr!r}: a bound against a baseline needs one: judge it with "
                              "`tokenload compare BASELINE RUN_DIR --threshold ...`")
        if relative:
            return None, float(relative[1]) / 100, None
        assert against is not None
        return None, None, float(f"{against[1] or '+'}{against[2] or 0}")
    try:
        return float(right), None, None
    except ValueError:
        raise ConfigError(f"threshold {expr!r}: the bound {right!r} is not a number"
                          + (" (or +N%, baseline, baseline - N)" if baseline else "")) from None


def _check_name(t: Threshold) -> None:
    pct = t.percentile
    if t.scope == "model":
        ok = pct is not None and pct[0] in metrics()
    elif pct is not None:
        ok = pct[0] in metrics() or (t.scope == "steps" and t.step_key in get_type_hints(StepRow))
    elif t.scope == "steps":
        ok = t.name in step_keys()
    else:
        ok = t.name in ALIASES or t.name in run_paths() or t.name in step_keys()
    if not ok:
        raise ConfigError(f"threshold {t.expr!r}: {t.name!r} names no number {t.where.replace('the whole run', 'of the run')}; "
                          f"valid names: {valid_names()}")
    if pct is not None and not 0 < pct[1] < 100:
        raise ConfigError(f"threshold {t.expr!r}: a percentile is between 0 and 100, e.g. ttft.p95")


def resolve(t: Threshold) -> Threshold:
    """A step's name without a selector (`output_tok_s < 400`) is judged at every step."""
    if t.scope == "run" and t.percentile is None and t.name not in ALIASES and t.name not in run_paths():
        return Threshold(**{**t.__dict__, "scope": "steps"})
    return t


def verdict(op: str, bound: float, value: float | None, ci: tuple[float | None, float | None] | None) -> Result:
    """pass / fail / inconclusive: `value` with its interval (an end None: unbounded there) against the bound.

    Without an interval the value decides alone; without a value nothing does.
    """
    if value is None:
        return "inconclusive"
    lo, hi = ci if ci is not None else (value, value)
    below = op in ("<", "<=")
    strict = op in ("<", ">")

    def holds(x: float | None) -> bool:
        if x is None:
            return False
        return (x < bound if strict else x <= bound) if below else (x > bound if strict else x >= bound)

    if holds(hi if below else lo):
        return "pass"
    if not holds(lo if below else hi) and (lo if below else hi) is not None:
        return "fail"
    return "inconclusive"


def exit_code(results: list[Result], inconclusive: str = "pass") -> int:
    """0 every threshold passed, 99 one was breached (an inconclusive one too, with `inconclusive` fail)."""
    failed = {"fail", "inconclusive"} if inconclusive == "fail" else {"fail"}
    return BREACHED if any(r in failed for r in results) else PASSED
