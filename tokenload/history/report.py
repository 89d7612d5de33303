"""history.html, its PNG charts, history.json, the CSV export and the printed verdict.

The numbers all come from `views.analyze_history`; this module only draws and
words them, so a test that checks history.json checks what the page shows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from tokenload.dayclock import DAY_S, timezone_name
from tokenload.history.views import HOURS, METRICS, MIN_PER_HOUR, SERVER_TERMS, fold

WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
DPI = 110


def _period_note(period_s: float) -> str:
    return "" if period_s == DAY_S else f", a day compressed into {period_s:g} s"


def _shade(ax: Any, metrics: dict[str, Any]) -> None:
    for key, color in (("peak", "tab:red"), ("off_peak", "tab:green")):
        window = metrics.get(key)
        if window:
            for hour in window["hours"]:
                ax.axvspan(hour, hour + 1, color=color, alpha=0.12, lw=0)


def heatmap_image(fig: Any, ax: Any, data: np.ndarray, key: str) -> Any:
    """One weekday x hour heatmap with its colour bar. The error rate's scale starts at 0 (at least 0..1%): on
    matplotlib's own scale an all-zero grid spans -0.1..+0.1 and its zeros were drawn mid-orange."""
    if key != "load_error_rate":
        image = ax.imshow(data, aspect="auto", cmap="magma_r", extent=(0, HOURS, 7, 0))
        fig.colorbar(image, ax=ax, pad=0.01)
        return image
    top = float(np.nanmax(data)) if np.isfinite(data).any() else 0.0
    image = ax.imshow(data, aspect="auto", cmap="Reds", extent=(0, HOURS, 7, 0), vmin=0.0, vmax=max(top, 0.01))
    fig.colorbar(image, ax=ax, pad=0.01, format=matplotlib.ticker.PercentFormatter(xmax=1.0))
    return image


def plot_heatmaps(result: dict[str, Any], path: Path) -> Path:
    """Hour of day x weekday heatmaps of TTFT p50, TPOT p50 and the load-error rate."""
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5))
    for ax, (key, title, fmt) in zip(axes, (("ttft_p50_s", "TTFT p50 (s)", "{:.2f}"),
                                             ("tpot_p50_s", "TPOT p50 (ms/token)", "{:.0f}"),
                                             ("load_error_rate", "error rate under load", "{:.0%}"))):
        data = np.array([[np.nan if v is None else v for v in row] for row in result["heatmap"][key]], dtype=float)
        if key == "tpot_p50_s":
            data = data * 1000
        heatmap_image(fig, ax, data, key)
        ax.set_yticks(np.arange(7) + 0.5, WEEKDAYS)
        ax.set_xticks(range(0, HOURS + 1, 2))
        ax.set_title(title, fontsize=10)
        for day in range(7):
            for hour in range(HOURS):
                if not np.isnan(data[day, hour]):
                    ax.text(hour + 0.5, day + 0.5, fmt.format(data[day, hour]),
                            ha="center", va="center", fontsize=5.5, color="grey")
    axes[-1].set_xlabel(f"hour of day, {timezone_name()}{_period_note(result['period_s'])}")
    return _save(fig, path)


def plot_hours(result: dict[str, Any], path: Path) -> Path:
    """Median TTFT and TPOT per hour with bootstrap intervals, peak (red) and off-peak (green) shaded."""
    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for ax, (name, _column) in zip(axes, METRICS):
        table = result["hours"][name]
        scale = 1000 if name == "tpot" else 1
        x = [r["hour"] + 0.5 for r in table if r["p50_s"] is not None]
        y = [r["p50_s"] * scale for r in table if r["p50_s"] is not None]
        ax.plot(x, y, "o-", color="tab:blue", label="median")
        rest = [(r["hour"] + 0.5, r["p50_s"] / r["ratio"] * r["ci95"][0] * scale, r["p50_s"] / r["ratio"] * r["ci95"][1] * scale)
                for r in table if r["ratio"]]
        if rest:
            hx, lo, hi = zip(*rest)
            ax.fill_between(hx, lo, hi, color="tab:blue", alpha=0.15, label="95% interval")
        _shade(ax, result["metrics"][name])
        ax.set_ylabel("TTFT p50 (s)" if name == "ttft" else "TPOT p50 (ms/token)")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xticks(range(0, HOURS + 1, 2))
    axes[-1].set_xlim(0, HOURS)
    axes[-1].set_xlabel(f"hour of day, {timezone_name()}{_period_note(result['period_s'])}; "
                        "red: peak, green: off-peak")
    return _save(fig, path)


def plot_daily(result: dict[str, Any], path: Path) -> Path:
    """TTFT and TPOT per day: median line, 10th-90th percentile band."""
    days = result["daily"]
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    x = np.arange(len(days))
    for ax, (name, _column) in zip(axes, METRICS):
        scale = 1000 if name == "tpot" else 1
        band = {q: np.array([np.nan if d[f"{name}_p{q}_s"] is None else d[f"{name}_p{q}_s"] * scale for d in days])
                for q in (10, 50, 90)}
        ax.fill_between(x, band[10], band[90], color="tab:purple", alpha=0.2, label="p10-p90")
        ax.plot(x, band[50], "o-", color="tab:purple", label="p50")
        ax.set_ylabel("TTFT (s)" if name == "ttft" else "TPOT (ms/token)")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xticks(x, [d["label"] for d in days], rotation=45, ha="right", fontsize=8)
    axes[-1].set_xlabel("day" + _period_note(result["period_s"]))
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _s(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.3g} {unit}"


def _window_line(name: str, key: str, window: dict[str, Any] | None) -> str | None:
    if window is None:
        return None
    stats = window["stats"]
    ci = stats.get(f"{name}_p50_ci95")
    interval = f" [95% {ci[0]:.3g}-{ci[1]:.3g}]" if ci else ""
    # Only the simple form: TPOT is measured between the first and the last token, so the N-1 form is exact
    # for every request by definition and its 0.0% said nothing.
    formula = (f"; formula TTFT + TPOT x N off by {_pct(stats['formula_mape_simple'])}"
               if stats["formula_mape_simple"] is not None else "")
    return (f"{key.replace('_', '-')} window ({name.upper()}): {window['label']}  {name.upper()} p50 "
            f"{_s(stats[f'{name}_p50_s'])}{interval}, {window['ratio']:.2f}x the other hours, "
            f"{stats['requests']} requests{formula}")


def verdict_lines(channel: str, result: dict[str, Any]) -> list[str]:
    """The printed verdict: what was measured, the windows, the comparison, the advice."""
    first = time.strftime("%Y-%m-%d %H:%M", time.localtime(result["first_at"])) if result["first_at"] else "-"
    last = time.strftime("%Y-%m-%d %H:%M", time.localtime(result["last_at"])) if result["last_at"] else "-"
    lines = [(f"{channel}: {result['requests']} requests in {result['samples']} samples, {first} .. {last}; "
              f"hours in {timezone_name()}{_period_note(result['period_s'])}")]
    for name, _column in METRICS:
        metrics = result["metrics"][name]
        for key in ("peak", "off_peak"):
            line = _window_line(name, key, metrics[key])
            if line:
                lines.append(line)
    cmp = result.get("comparison")
    if cmp:
        for name in ("ttft", "tpot", "e2e"):
            c = cmp.get(name)
            if c:
                lines.append(f"peak vs off-peak {name.upper()} p50: {c['peak_p50_s']:.3g} s vs {c['off_peak_p50_s']:.3g} s "
                             f"({c['ratio']:.2f}x, Mann-Whitney p={c['p_value']:.2g}, P(slower)={c['effect']:.2f}; "
                             f"n={c['n_peak']}/{c['n_off_peak']})")
            else:
                lines.append(f"peak vs off-peak {name.upper()}: too few successful requests in a window to compare "
                             f"(need {MIN_PER_HOUR} in each)")
    server = result.get("server")
    if server:  # was the server itself busier at peak? (watch --server-metrics)
        windows = result["metrics"]["ttft"]
        parts = [f"{name} {windows[key]['label']}: {_gauges(server[key])}" for key, name in
                 (("peak", "peak"), ("off_peak", "off-peak")) if windows[key] and server[key]]
        parts.append(f"all samples: {_gauges(server['overall'])}")
        lines.append("server (its /metrics, as each sample began): " + "; ".join(parts))
    lines.extend(f"advice: {a}" for a in result["advice"])
    return lines


def _gauges(view: dict[str, Any]) -> str:
    """'4.2 running, 1.5 waiting, KV cache 63% on average (12 samples)'."""
    parts = [f"{view[f'{t}_mean']:.2g} {t}" for t in ("running", "waiting") if view.get(f"{t}_mean") is not None]
    if view.get("kv_cache_usage_mean") is not None:
        parts.append(f"KV cache {view['kv_cache_usage_mean']:.0%}")
    return f"{', '.join(parts)} on average ({view['samples']} samples)"


def _fit_text(fit: dict[str, Any]) -> str:
    if fit.get("model") is None:
        return str(fit.get("note", "no fit"))
    slope = f"{fit['slope_s_per_token'] * 1000:.3g} ms/token"
    if fit["model"] == "power":  # a curve has no one slope: the fit gives it at the median input length
        slope += f" at {fit['slope_at_input_tokens']:,.0f} input tokens"
    text = f"{fit['model']}: {fit['intercept_s']:.3g} s + {slope}, R2 {fit['r2']:.2f}"
    return text + (f", exponent {fit['exponent']:.2f}" if fit["model"] == "power" else "")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def window_rows(result: dict[str, Any]) -> list[list[Any]]:
    """One row per window found (TTFT's and TPOT's): the numbers behind the verdict, fits and formula included."""
    rows = []
    for name, _column in METRICS:
        for key in ("off_peak", "peak"):
            window = result["metrics"][name][key]
            if window is None:
                continue
            stats = window["stats"]
            rows.append([f"{key.replace('_', '-')} by {name.upper()}", window["label"], stats["requests"],
                         _s(stats["ttft_p50_s"]), _s(stats["tpot_p50_s"]), _s(stats["e2e_p50_s"]),
                         "-" if stats["load_error_rate"] is None else f"{stats['load_error_rate']:.1%}",
                         _pct(stats["formula_mape_simple"]), _fit_text(stats["ttft_vs_input"])])
    return rows


WINDOW_HEADERS = ("window", "hours", "requests", "TTFT p50", "TPOT p50", "e2e p50", "error rate",
                  "formula error (TTFT + TPOT x N)", "TTFT vs input")


def _hours_rows(result: dict[str, Any]) -> list[list[Any]]:
    """One row per hour; with the server's gauges (`watch --server-metrics`), their means in that hour too."""
    server = {h["hour"]: h for h in (result.get("server") or {}).get("hours", [])}
    rows = []
    for ttft, tpot in zip(result["hours"]["ttft"], result["hours"]["tpot"]):
        row = [f"{ttft['hour']:02d}:00", ttft["requests"], ttft["errors"], ttft["p50_s"],
               ttft["ratio"], ttft["level"] or "too few", tpot["p50_s"], tpot["level"] or "too few"]
        if result.get("server"):
            row += [server.get(ttft["hour"], {}).get(f"{term}_mean") for term in SERVER_TERMS]
        rows.append(row)
    return rows


HOURS_HEADERS = ("hour", "requests", "errors", "TTFT p50 s", "TTFT ratio to rest", "TTFT level", "TPOT p50 s",
                 "TPOT level")
SERVER_HEADERS = ("server running", "server waiting", "server KV cache")


def hours_headers(result: dict[str, Any]) -> tuple[str, ...]:
    return HOURS_HEADERS + (SERVER_HEADERS if result.get("server") else ())


def write_report(reports: Sequence[tuple[str, dict[str, Any], pd.DataFrame]], out_dir: Path,
                 csv: bool = False) -> Path:
    """history.html (one section per channel), PNGs, history.json and, with `csv`, the CSV files."""
    from tokenload.analysis.report import figure, h, html_table, page

    out_dir.mkdir(parents=True, exist_ok=True)
    sections: list[tuple[str, str]] = []
    for index, (channel, result, frame) in enumerate(reports):
        tag = "" if len(reports) == 1 else f"-{index + 1}"
        figures = [
            (plot_heatmaps(result, out_dir / f"heatmap{tag}.png"),
             f"TTFT p50, TPOT p50 and error rate by hour and weekday ({timezone_name()})"),
            (plot_hours(result, out_dir / f"hours{tag}.png"),
             "Median per hour of day with the 95% interval; red = peak window, green = off-peak window"),
            (plot_daily(result, out_dir / f"daily{tag}.png"), ("Each day's median with its 10th-90th percentile band")),
        ]
        verdict = "".join(f"<p>{h(line)}</p>" for line in verdict_lines(channel, result))
        body = (verdict + html_table(WINDOW_HEADERS, window_rows(result), left=2)
                + "".join(figure(path, caption) for path, caption in figures)
                + html_table(hours_headers(result), _hours_rows(result)))
        sections.append((channel, body))
        if csv:
            fold(frame, result["period_s"]).to_csv(out_dir / f"history{tag}.csv", index=False)
            pd.DataFrame(_hours_rows(result), columns=list(hours_headers(result))).to_csv(out_dir / f"hours{tag}.csv",
                                                                                  index=False)
    (out_dir / "history.json").write_text(json.dumps({c: r for c, r, _ in reports}, indent=2), encoding="utf-8")
    path = out_dir / "history.html"
    path.write_text(page("tokenload history: peak and off-peak hours", sections), encoding="utf-8")
    return path
