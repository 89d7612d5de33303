"""The verdict (terminal and HTML) and the self-contained HTML page builder.

The verdict rows are computed once from `summary.json`'s dict and rendered
twice (rich table, HTML table), so the terminal and the report never disagree.
The HTML inlines every image as base64: the file can be mailed or attached to
a ticket on its own.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from tokenload.analysis import caching, fidelity
from tokenload.analysis.breakpoint import breakpoint_text
from tokenload.analysis.records import cut_text
from tokenload.analysis.search import probe_text
from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import Summary

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.5em} h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em} td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3} td.l,th.l{text-align:left} figure{margin:1.5em 0} img{max-width:100%}
figcaption{color:#555;font-size:.9em} .bad{color:#b00020;font-weight:600} .good{color:#1b7f2a}
ul.advice li{margin:.3em 0} .problems{background:#fff4e5;border:1px solid #f0b400;padding:.5em 1em}
.scroll{overflow-x:auto;max-width:100%} h3{font-size:1em;color:#444}
"""


def _fmt(x: Any, unit: str = "", digits: int = 3) -> str:
    """A value as a reader should see it: never Python's `None`, `True` or 17 digits."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}{unit}"
    return f"{x}{unit}"


def slope_text(fit: Mapping[str, Any]) -> str:
    """A fit's s/token; a power law's slope changes with the input length, so it says where it was taken."""
    text = f"{fit['slope_s_per_token']:.3g} s/token"
    if fit.get("model") == "power" and fit.get("slope_at_input_tokens") is not None:
        text += f" at {fit['slope_at_input_tokens']:,.0f} input tokens (the curve's slope there)"
    return text


def verdict_rows(summary: Summary) -> list[tuple[str, str, bool | None]]:
    """(topic, finding, ok?) rows; ok is None where the row is information, not a verdict."""
    run, slo, lat = summary["run"], summary["slo"], summary["latency"]
    ttft_fit, e2e_fit = summary["fits"]["ttft_vs_input"], summary["fits"]["e2e_vs_output"]
    formula, diag, bp = summary["formula"], summary["diagnosis"], summary["breakpoint"]
    complete = run.get("completeness") or {}
    rows: list[tuple[str, str, bool | None]] = []
    search = summary.get("search")
    if search:
        rows.append(("Capacity (search)", search["verdict"],
                     None if search["capacity"] is None and not search["below_range"] else not search["below_range"]))
        rows += [(f"Probe {n}", probe_text(p, search["unit"], search["slo"]),
                  {"pass": True, "fail": False}.get(p["verdict"])) for n, p in enumerate(search["probes"], start=1)]
    if complete.get("interrupted") or complete.get("truncated") or complete.get("storm"):
        rows.append(("Run incomplete", complete["note"] or "", False))
    if outage := summary.get("outage"):
        rows.append(("Outage", outage["verdict"], False))
    rows += [
        ("Requests", f"{run['requests']:,} ({run['ok']:,} ok, {run['errors']:,} errors{_classes(summary)}, "
                     f"{cut_text(run['in_flight'], run.get('cut_step_down', 0))})",
         run["errors"] == 0 if run["requests"] else False),
    ]
    if slo.get("per_probe"):
        rows.append(("SLO", f"{slo.get('describe')}: judged per probe, each at its own load (the probes above); "
                            "no attainment is pooled over probes of different loads", None))
    else:
        rows.append(("SLO attainment", f"{_fmt(100 * slo['attainment'] if slo['attainment'] is not None else None, '%')} "
                                        f"of {slo.get('judged', 0):,} judged requests; SLO: {slo.get('describe')}"
                                        + (f" ({slo['not_judged']:,} configuration/input errors not judged)"
                                           if slo.get("not_judged") else ""),
                     None if slo["attainment"] is None else slo["attainment"] >= slo["target"]))
    if run.get("truncated"):
        rows.append(("Answers cut short", f"{run['truncated']:,} answer(s) ended for length below the max_tokens "
                                          "asked: the server cut them (a full context slot); shorten the prompts "
                                          "or give the server a longer context", False))
    for metric, p, unit in (("ttft", lat["ttft"], " s"), ("tpot", lat["tpot"], " s/token"), ("e2e", lat["e2e"], " s")):
        shown = " · ".join(f"{k} {'≥ ' if k in p.get('bounds', []) else ''}{_fmt(v)}" for k, v in p.items()
                           if k.startswith("p") and k[1:2].isdigit())
        cut = (f"; {cut_text(p['censored'], p.get('censored_step_down', 0))}, censored when cut" if p.get("censored")
               else "")
        pooled = "all probes pooled: " if search else ""
        rows.append((metric.upper(), f"{pooled}{shown}{unit} (n={p.get('n', 0):,}{cut})", None))
    if ttft_fit.get("model"):
        extra = f", exponent {ttft_fit['exponent']:.2f}" if ttft_fit["model"] == "power" else ""
        rows.append(("TTFT vs input", f"{ttft_fit['model']}: {slope_text(ttft_fit)}, "
                                      f"intercept {ttft_fit['intercept_s']:.3g} s{extra}, R² {ttft_fit['r2']:.3f} "
                                      f"(n={ttft_fit['n']:,}, {_steps(ttft_fit['steps_used'])})", None))
        law = summary.get("prefill_law")
        rows.append(("Prefill sub-linear?", law["verdict"] if law else ttft_fit.get("sublinear", ""), None))
    else:
        rows.append(("TTFT vs input", ttft_fit.get("note", "not fitted"), False))
    rows += [("Models", r["headline"], None) for r in summary.get("model_ratios") or []]
    if size_law := summary.get("model_size_law"):
        rows.append(("Sub-linear in model size?", size_law["verdict"], None))
    if e2e_fit.get("slope_s_per_token") is not None:
        vs = (f"; slope = {e2e_fit['slope_over_tpot_p50']:.3g}x median TPOT"
              if e2e_fit.get("slope_over_tpot_p50") is not None else "")
        rows.append(("e2e vs output", f"{e2e_fit['slope_s_per_token']:.3g} s/token, intercept "
                                      f"{e2e_fit['intercept_s']:.3g} s, R² {e2e_fit['r2']:.3f}{vs}", None))
    else:
        rows.append(("e2e vs output", e2e_fit.get("note", "not fitted"), False))
    simple, exact = formula["mape_simple"], formula["mape_exact"]
    if simple is not None and exact is not None:
        where = formula.get("typical_values_break_at")
        tail = (f"; with typical TTFT/TPOT it misses by > {100 * formula['typical_values_tolerance']:.0f}% "
                f"from {where}" if where else "")
        if formula.get("not_judged_steps"):
            tail += (f"; {_steps(formula['not_judged_steps'])} not judged (prompt lengths vary, too few requests "
                     "to predict TTFT from them)")
        rows.append(("Formula TTFT + TPOT × N", "with each step's median TPOT and typical TTFT (at each request's own "
                                                "input length where lengths vary within a step) it predicts e2e within "
                                                f"{100 * simple:.1f}% on average "
                                                f"({100 * exact:.1f}% with N − 1){tail}",
                     formula["holds"]))
    elif formula.get("note"):
        rows.append(("Formula TTFT + TPOT × N", formula["note"], None))
    models = summary.get("models") or {}
    per_model = [(m, f, f["mape_simple"], f["mape_exact"]) for m, e in models.items() if (f := e["formula"])]
    judged = [(m, f, simple, exact) for m, f, simple, exact in per_model if simple is not None and exact is not None]
    if len(models) > 1 and judged:
        rows.append(("Formula per model", "each model's own steps (the run's pools several models): " + ", ".join(
            f"{m} within {100 * simple:.1f}% ({100 * exact:.1f}% with N − 1)" for m, _, simple, exact in judged),
            all(f["holds"] for _, f, _, _ in judged)))
    rows.append(("Output length drives e2e?", summary["e2e_drivers"]["verdict"], None))
    if bp:
        note = f" ({summary['breakpoint_note']})" if summary.get("breakpoint_note") else ""
        rows.append(("Breakpoint", f"{breakpoint_text(bp)} ({bp['reason']}): {bp['detail']}{note}", False))
    elif search:  # the step rules need steps held as a ramp holds them; "run a ramp" would send the user away
        rows.append(("Breakpoint", "see the capacity the search found: its probes are decided by their own evidence, "
                                   "not held long enough for the step rules", None))
    else:
        rows.append(("Breakpoint", summary.get("breakpoint_note") or "none",
                     None if (run.get("completeness") or {}).get("note") else True))
    if auto := summary.get("auto_stop"):
        rows.append(("Auto-stop", auto["verdict"], None))
    bound = diag["bound"] or "not determined (no request finished)"
    rows.append(("Bound", bound + (f" ({diag['bound_reason']})" if diag.get("bound_reason") else ""), None))
    top = (summary.get("levers") or [])[:1]
    base = summary.get("lever_baseline")
    if top and base and (met := top[0]["attainment"]) is not None and base["attainment"] < summary["slo"]["target"]:
        rows.append(("First fix", f"{top[0]['change']}: {top[0].get('arithmetic', '')} (predicted), SLO met by "
                                  f"{100 * met:.0f}% of requests (see Which lever)", None))
    elif diag["advice"]:
        rows.append(("First fix", diag["advice"][0], None))
    rows += caching.verdict_rows(summary)
    rows += fidelity.verdict_rows(summary)
    for problem in summary.get("problems", []):
        rows.append(("Missing", problem, False))
    return rows


def _classes(summary: Summary) -> str:
    """': 3 load, 2 input' (only the load class counts towards the error-rate rule)."""
    by_class = summary.get("errors_by_class") or {}
    return (": " + ", ".join(f"{n:,} {cls}" for cls, n in sorted(by_class.items()))) if by_class else ""


def _steps(steps: Sequence[int]) -> str:
    """'step 3', 'steps 1–4', 'steps 1, 3', 'no step'."""
    if not steps:
        return "no step"
    if len(steps) == 1:
        return f"step {steps[0]}"
    run = list(steps) == list(range(steps[0], steps[-1] + 1))
    return f"steps {steps[0]}–{steps[-1]}" if run else "steps " + ", ".join(map(str, steps))


def verdict_table(summary: Summary, title: str | None = None) -> Table:
    """The rich verdict table printed by `analyze` (and by `demo`)."""
    table = Table(title=title or f"tokenload verdict: {summary['run'].get('label')}", show_lines=False,
                  title_justify="left")
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("finding", overflow="fold")
    for topic, finding, good in verdict_rows(summary):
        style = "" if good is None else ("green" if good else "red")
        table.add_row(topic, Text(finding), style=style)  # findings quote scenario keys like [session]: not markup
    return table


# ----- HTML -----------------------------------------------------------------------------------

def h(text: Any) -> str:
    """Escape for HTML."""
    return html.escape(str(text))


def html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], left: int = 1) -> str:
    """A plain table; the first `left` columns are text (left aligned), the rest numbers."""
    def cell(tag: str, i: int, value: Any) -> str:
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{h(value)}</{tag}>"
    head = "".join(cell("th", i, x) for i, x in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", i, _fmt(x, digits=4)) for i, x in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def verdict_html(summary: Summary) -> str:
    rows = []
    for topic, finding, good in verdict_rows(summary):
        cls = "" if good is None else (' class="good"' if good else ' class="bad"')
        rows.append(f'<tr><th class="l">{h(topic)}</th><td class="l"{cls}>{h(finding)}</td></tr>')
    return f"<table>{''.join(rows)}</table>"


def figure(path: Path, caption: str) -> str:
    """An inlined PNG with its one-line caption."""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return (f'<figure><img alt="{h(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{h(caption)}</figcaption></figure>")


def page(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """A complete HTML document: (heading, html body) per section."""
    body = "".join(f"<h2>{h(head)}</h2>{content}" if head else content for head, content in sections)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{h(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{h(title)}</h1>{body}</body></html>")


LOAD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("requests", "requests"), ("ok", "ok (measured)"), ("warmup_excluded", "warm-up excluded"),
    ("open_at_step_end", "open at step end"), ("censored", "open at run end"), ("errors", "errors"),
    ("load_errors", "load errors"), ("input_errors", "input errors"), ("config_errors", "config errors"),
    ("achieved_rate", "sent req/s"), ("achieved_concurrency", "in flight (mean)"), ("rps", "done req/s"),
    ("output_tok_s", "out tok/s"), ("input_tok_s", "in tok/s"), ("total_tok_s", "total tok/s"),
    ("goodput_rps", "goodput req/s"), ("slo_attainment", "SLO met"), ("formula_mape", "formula MAPE"),
    ("ttft_slope_s_per_token", "TTFT s/token"),
)


def _load_cell(step: Mapping[str, Any]) -> str:
    text = level_text(step["load_level"], step["load_unit"])
    return text if step.get("decided", True) else f"{text} (too few to judge)"


def _bounded(row: Mapping[str, Any], key: str) -> str:
    """'1.23', '≥ 4.5' for a censored bound, 'n/a' when absent."""
    value = row.get(key)
    if value is None:
        return "n/a"
    return f"≥ {value:.3g}" if key in row.get("bounds", []) else f"{value:.3g}"


def _with_ci(step: Mapping[str, Any], key: str) -> str:
    """'1.23 [1.1, 1.4]', '≥ 4.5' for a censored bound, 'n/a' when absent."""
    value = step.get(key)
    if value is None or key in step.get("bounds", []):
        return _bounded(step, key)
    ci = (step.get("ci") or {}).get(key)
    return f"{value:.3g}" + (f" [{ci[0]:.3g}, {ci[1]:.3g}]" if ci else "")


def probes_html(search: Mapping[str, Any], percentiles: Sequence[float] = (50, 95, 99)) -> str:
    """A search's probes in the order they ran: verdict, evidence, latency percentiles of each probe's own
    requests (≥: a lower bound, streams cut before they reached it), goodput, time and tokens spent."""
    heads = ["#", "load", "trial", "verdict", "judged", "attainment [95% CI]"]
    heads += [f"{m.upper()} p{p:g}" for m in ("ttft", "tpot", "e2e") for p in percentiles]
    heads += ["goodput req/s", "duration s", "tokens", "counted", "warm-up", "cut"]
    rows = []
    for n, p in enumerate(search["probes"], start=1):
        ci = p.get("ci")
        attainment = "n/a" if p.get("attainment") is None else (
            f"{p['attainment']:.1%}" + (f" [{ci[0]:.1%}, {ci[1]:.1%}]" if ci else ""))
        split = p.get("tokens_split") or {}
        rows.append([n, level_text(p["level"], search["unit"]), p.get("trial"),
                     p["verdict"] + (f" ({p['binding']})" if p["verdict"] == "fail" and p.get("binding") else ""),
                     p.get("n"), attainment, *(_bounded(p, f"{m}_p{q:g}_s") for m in ("ttft", "tpot", "e2e")
                                               for q in percentiles),
                     p.get("goodput_rps"), p.get("duration_s"), p.get("tokens"),
                     split.get("counted"), split.get("warmup"), split.get("cut")])
    return f"<div class='scroll'>{html_table(heads, rows, left=4)}</div>"


def steps_html(steps: Sequence[Mapping[str, Any]], percentiles: Sequence[float] = (50, 95, 99)) -> str:
    """Two per-step tables (load and throughput; latency with n and 95% CIs), each scrolling on its own."""
    load = html_table(["step", "load", *(name for _, name in LOAD_COLUMNS)],
                      ([s["step"], _load_cell(s), *(s.get(key) for key, _ in LOAD_COLUMNS)] for s in steps), left=2)
    heads = ["step", "load"]
    for metric in ("ttft", "tpot", "e2e"):
        heads += [f"{metric.upper()} n"] + [f"{metric.upper()} p{p:g}" for p in percentiles]
    heads += ["ITL p50", "ITL p99"]
    rows = []
    for s in steps:
        row: list[Any] = [s["step"], _load_cell(s)]
        for metric in ("ttft", "tpot", "e2e"):
            row.append(s.get(f"{metric}_n"))
            row += [_with_ci(s, f"{metric}_p{p:g}_s") for p in percentiles]
        rows.append([*row, s.get("itl_p50_s"), s.get("itl_p99_s")])
    latency = html_table(heads, rows, left=2)
    return (f"<h3>Load and throughput</h3><div class='scroll'>{load}</div>"
            "<h3>Latency (s): value [95% bootstrap interval]; ≥ marks a lower bound where requests still open "
            f"at the end reach the percentile</h3><div class='scroll'>{latency}</div>")
