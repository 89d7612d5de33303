"""The charts of the report and of comparisons (matplotlib, Agg backend).

Every chart takes a list of `(label, Analysis)` views, so one function draws a
single run for `analyze` and several overlaid runs for `compare`. Scatter
plots are downsampled (at most `MAX_POINTS` per chart) so a million-request run
draws as fast as a small one; statistics never come from the sample.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from tokenload.analysis.steps import STEADY_REQUESTS  # noqa: E402
from tokenload.analysis.summary import Analysis  # noqa: E402
from tokenload.analysis.windows import USERS, level_text  # noqa: E402
from tokenload.contracts.summary import Fits, SearchSummary, Summary  # noqa: E402

View = tuple[str, Analysis]
Curve = tuple[str, Callable[..., np.ndarray], str]  # (legend label, y(x), line style)
MAX_POINTS = 20_000
COLORS = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
DPI = 110


def _sample(frame: pd.DataFrame, limit: int, seed: int = 0) -> pd.DataFrame:
    if len(frame) <= limit:
        return frame
    return frame.sample(n=limit, random_state=seed)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


# Legend samples this many font sizes long: at matplotlib's default (2) a dashed line with a marker shows its
# one gap behind the marker, and the p95 entry looked as solid as the p50 one.
LEGEND_HANDLE_LENGTH = 4.0


def legend(ax: Axes, **options: Any) -> None:
    """`ax.legend` with samples long enough to show each line's dash style."""
    ax.legend(handlelength=LEGEND_HANDLE_LENGTH, **options)


PLAIN = matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}")


def _log_axis(ax: Axes, axis: str, base: float = 10) -> None:
    """Log scale with plain tick labels (0.5, 1, 10) rather than powers."""
    getattr(ax, f"set_{axis}scale")("log", base=base)
    getattr(ax, f"{axis}axis").set_major_formatter(PLAIN)


def load_unit(views: Sequence[View]) -> str:
    """The x unit of per-step charts: the first run's (a comparison pairs runs of one unit)."""
    units = [str(v.table["load_unit"].iloc[0]) for _, v in views if len(v.table)]
    return units[0] if units else USERS


def _load_axis(ax: Axes, views: Sequence[View]) -> None:
    """Log-2 x axis when the ramp spans a wide range (1, 2, 4 ... 64 users, or 0.5 ... 16 req/s)."""
    levels = np.concatenate([v.table["load_level"].to_numpy() for _, v in views if len(v.table)] or [np.ones(1)])
    if levels.min() > 0 and levels.max() / levels.min() >= 8:
        _log_axis(ax, "x", base=2)
    ax.set_xlabel("concurrent users" if load_unit(views) == USERS else "offered load (requests / s)")


def _series(views: Sequence[View]) -> list[tuple[str, pd.DataFrame, list[int], Fits]]:
    """(legend prefix, finished requests, low-load steps, fits) per run; a single run of several models, per model."""
    models = views[0][1].summary.get("models") or {} if len(views) == 1 else {}
    if len(models) > 1:
        a = views[0][1]
        return [(f"{m}: ", a.ok[a.ok["model"].astype(str) == m], a.low_steps, e["fits"]) for m, e in models.items()]
    return [(f"{label}: " if len(views) > 1 else "", a.ok, a.low_steps, a.summary["fits"]) for label, a in views]


def _scatter_fit(ax: Axes, views: Sequence[View], x_col: str, y_col: str,
                 lines: Callable[[Fits], tuple[list[Curve], str | None]]) -> None:
    """Points of the low-load steps in the run's (or model's) colour, others grey; then each one's fitted lines, or
    why it has none."""
    series = _series(views)
    per_run = MAX_POINTS // max(len(series), 1)
    y_tops: list[float] = []
    notes: list[str] = []
    for i, (prefix, ok, low_steps, fits) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        used = ok["step"].isin(low_steps)
        low, rest = _sample(ok[used], per_run), _sample(ok[~used], per_run // 2)
        if len(rest):
            ax.scatter(rest[x_col], rest[y_col], s=3, color="0.7", alpha=0.3, rasterized=True,
                       label=f"{prefix}higher-load steps (not fitted)")
        curves, why = lines(fits)
        ax.scatter(low[x_col], low[y_col], s=3, color=color, alpha=0.25, rasterized=True,
                   label=f"{prefix}low-load steps ({'fitted' if curves else 'no fit'})")
        if len(low):
            y_tops.append(float(np.percentile(low[y_col], 99.5)))
            xs = np.linspace(max(float(low[x_col].min()), 1.0), float(low[x_col].max()), 200)
            for name, fn, style in curves:
                ax.plot(xs, fn(xs), style, color=color if len(series) > 1 or style == "-" else "black",
                        lw=2, label=f"{prefix}{name}")
        if not curves and why:
            notes.append(f"{prefix}{why}")
    if y_tops:
        top = 1.3 * max(y_tops)
        ax.set_ylim(0, top)
        above = sum(int((ok[y_col] > top).sum()) for _, ok, _, _ in series)
        if above:
            total = sum(len(ok) for _, ok, _, _ in series)
            ax.text(0.99, 0.02, f"{above} of {total} points lie above the top of this axis (not shown)",
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=8,
                    color="#b00020", bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "#b00020"})
    if notes:  # under the axis, where it covers no point
        ax.text(0.0, -0.12, "\n".join(textwrap.fill(n, 120) for n in notes), transform=ax.transAxes, ha="left",
                va="top", fontsize=8, color="#b00020")
    legend(ax, loc="upper left", fontsize=8, markerscale=4, framealpha=0.9)
    ax.grid(alpha=0.3)


def _ttft_lines(fits: Fits) -> tuple[list[Curve], str | None]:
    fit = fits["ttft_vs_input"]
    out: list[Curve] = []
    lin = fit.get("linear")
    if lin:
        out.append((f"linear: {lin['intercept_s']:.3g} + {lin['slope_s_per_token']:.3g}·n s (R² {lin['r2']:.3f})",
                    lambda x, f=lin: f["intercept_s"] + f["slope_s_per_token"] * x, "-"))
    pw = fit.get("power")
    if pw:
        chosen = " [chosen]" if fit["model"] == "power" else ""
        out.append((f"power: {pw['a_s']:.3g} + {pw['b']:.3g}·n^{pw['exponent']:.2f} s (R² {pw['r2']:.3f}){chosen}",
                    lambda x, f=pw: f["a_s"] + f["b"] * np.power(x, f["exponent"]), "--"))
    return out, None if out else fit.get("note")


def _e2e_lines(fits: Fits) -> tuple[list[Curve], str | None]:
    fit = fits["e2e_vs_output"]
    out: list[Curve] = []
    if fit.get("slope_s_per_token") is not None:
        out.append((f"fit: {fit['intercept_s']:.3g} + {fit['slope_s_per_token']:.3g}·N s (R² {fit['r2']:.3f})",
                    lambda x, f=fit: f["intercept_s"] + f["slope_s_per_token"] * x, "-"))
    if fit.get("tpot_p50_s") is not None:
        out.append((f"formula: TTFT {fit['ttft_p50_s']:.3g} + TPOT {fit['tpot_p50_s']:.3g}·N s",
                    lambda x, f=fit: f["ttft_p50_s"] + f["tpot_p50_s"] * x, "--"))
    return out, None if out else fit.get("note")


def plot_ttft_vs_input(views: Sequence[View], path: Path) -> Path:
    """TTFT against input tokens with the linear and power fits."""
    return _save(ttft_figure(views), path)


def ttft_figure(views: Sequence[View]) -> plt.Figure:
    """The TTFT-vs-input chart as a figure, before it is saved (its lines and notes can be read back)."""
    fig, ax = plt.subplots(figsize=(9, 5.5))
    _scatter_fit(ax, views, "input_tokens", "ttft_s", _ttft_lines)
    ax.set(xlabel="input tokens", ylabel="TTFT (s)", title="TTFT vs input length (successful requests)")
    return fig


def plot_e2e_vs_output(views: Sequence[View], path: Path) -> Path:
    """End-to-end latency against output tokens with the fit and the TTFT + TPOT x N line."""
    fig, ax = plt.subplots(figsize=(9, 5.5))
    _scatter_fit(ax, views, "output_tokens", "e2e_s", _e2e_lines)
    ax.set(xlabel="output tokens", ylabel="end-to-end latency (s)",
           title="Total latency vs output length (successful requests)")
    return _save(fig, path)


@dataclass(frozen=True)
class Panel:
    """One panel of a per-concurrency chart: columns of the step table to draw."""

    title: str
    ylabel: str
    series: tuple[tuple[str, str, str], ...]  # (column, legend name, line style)
    slo: float | None = None
    scale: float = 1.0
    # Columns drawn with their bootstrap 95% interval as a shaded band.
    bands: tuple[str, ...] = ()
    # Per-request columns whose distribution stands for the series at a single load level: (column, legend name).
    records: tuple[tuple[str, str], ...] = ()
    # Window rates: a step whose window was too short for a steady state (`steady` false) gets a hollow marker.
    rates: bool = False


def _ci_band(t: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper 95% bounds of a step column from the `ci` dicts (NaN where none)."""
    cis = [ci.get(col) if isinstance(ci, dict) else None for ci in t["ci"]]
    lo = np.array([c[0] if c else np.nan for c in cis], dtype=float)
    hi = np.array([c[1] if c else np.nan for c in cis], dtype=float)
    return lo, hi


def breakpoint_marker(summary: Summary) -> tuple[float, str] | None:
    """(load level, legend) of the breakpoint line; None when there is none to draw.

    A breakpoint below the range (no level met the SLO) has no level on the axis:
    a line at the lowest level would claim that level as the breakpoint.
    """
    bp = summary.get("breakpoint")
    level = bp["load_level"] if bp else None
    if not bp or level is None:
        return None
    return float(level), f"breakpoint {level_text(level, bp['load_unit'])} ({bp['reason']})"


def _one_level(views: Sequence[View], panels: Sequence[Panel], name: str, level: float) -> plt.Figure:
    """Every run at one load level: a curve would be a dot on an axis one level wide, so each panel shows the
    runs side by side: the requests' distribution as a box (median, quartiles, whiskers at the 5th and 95th
    percentile) where the quantity is per request, the level's value as a bar where it is per window."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), squeeze=False)
    names = [label for label, _ in views]
    for ax, panel in zip(axes[0], panels):
        series = panel.records or tuple((col, name) for col, name, _ in panel.series)
        width = 0.8 / len(series)
        for k, (column, name) in enumerate(series):
            hatch = ("", "//", "..", "xx")[k % 4]
            for i, (_, a) in enumerate(views):
                at = i + (k - (len(series) - 1) / 2) * width
                color = COLORS[i % len(COLORS)]
                if panel.records:
                    if column not in a.ok or not a.ok[column].notna().any():
                        continue
                    values = a.ok[column].dropna().to_numpy(dtype=float) * panel.scale
                    box = ax.boxplot(values, positions=[at], widths=0.85 * width, whis=(5, 95), showfliers=False,
                                     patch_artist=True, manage_ticks=False)
                    for patch in box["boxes"]:
                        patch.set(facecolor=color, alpha=0.45, hatch=hatch)
                    for median in box["medians"]:
                        median.set(color="black", lw=1.5)
                elif len(a.table) and column in a.table:
                    ax.bar(at, float(a.table[column].iloc[0]) * panel.scale, 0.85 * width, color=color, alpha=0.6,
                           hatch=hatch, edgecolor="0.3")
            if len(series) > 1:
                ax.bar(np.nan, np.nan, color="white", edgecolor="0.3", hatch=hatch, label=name)
        if panel.slo is not None:
            ax.axhline(panel.slo, color="red", ls="-.", lw=1, label=f"SLO {panel.slo:g} s")
        ax.set_xticks(range(len(views)), names)
        ax.set_xlim(-0.6, len(views) - 0.4)
        ax.set(title=panel.title, ylabel=panel.ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y")
        if ax.get_legend_handles_labels()[0]:
            legend(ax, fontsize=7, framealpha=0.9)
    what = ("boxes: median and quartiles, whiskers: 5th-95th percentile" if any(p.records for p in panels)
            else "one window per run")
    fig.suptitle(f"{name} at {level_text(level, load_unit(views))}, the only load level ({what})")
    return fig


def _panels_vs_users(views: Sequence[View], panels: Sequence[Panel], name: str, title: str) -> plt.Figure:
    """Per-concurrency curves: one panel per quantity, one colour per run, breakpoints marked.

    When every run measured the same single load level there is no curve to draw: `_one_level` (its
    title starts with `name`).
    """
    levels = {float(x) for _, a in views if len(a.table) for x in a.table["load_level"]}
    if len(levels) == 1:
        return _one_level(views, panels, name, levels.pop())
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for i, (label, a) in enumerate(views):
            if a.table.empty:
                continue
            t = a.table.sort_values(["load_level", "start"])
            color = COLORS[i % len(COLORS)]
            prefix = f"{label} " if len(views) > 1 else ""
            short = ~t["steady"].fillna(False).astype(bool) if panel.rates and "steady" in t else None
            for k, (col, name, style) in enumerate(panel.series):
                y = t[col] * panel.scale
                ax.plot(t["load_level"], y, style, color=color, marker="o", ms=4, label=f"{prefix}{name}")
                if short is not None and short.any():
                    ax.plot(t["load_level"][short], y[short], "o", ms=8, mfc="white", mec=color,
                            label=None if k else f"{prefix}window under {STEADY_REQUESTS} requests long: "
                                                 "a transient, not a steady rate")
                if col in panel.bands:
                    lo, hi = _ci_band(t, col)
                    ax.fill_between(t["load_level"], lo * panel.scale, hi * panel.scale, color=color, alpha=0.12,
                                    lw=0)
            small = t[~t["decided"]] if "decided" in t else t.iloc[:0]
            for col, _, _ in panel.series[:1]:
                ax.plot(small["load_level"], small[col] * panel.scale, "x", color="0.4", ms=8,
                        label=f"{prefix}too few requests to judge" if len(small) else None)
            marker = breakpoint_marker(a.summary)
            if marker is not None:
                ax.axvline(marker[0], color=color, ls=":", lw=1.5, label=f"{prefix}{marker[1]}")
        if panel.slo is not None:
            ax.axhline(panel.slo, color="red", ls="-.", lw=1, label=f"SLO {panel.slo:g} s")
        _load_axis(ax, views)
        ax.set(title=panel.title, ylabel=panel.ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        legend(ax, fontsize=7, framealpha=0.9)
    fig.suptitle(title)
    return fig


def plot_latency_vs_users(views: Sequence[View], path: Path) -> Path:
    """TTFT, TPOT and e2e p50/p95 per load step, with bootstrap bands."""
    return _save(latency_figure(views), path)


def latency_figure(views: Sequence[View]) -> plt.Figure:
    """The latency chart as a figure, before it is saved (its legends can be read back)."""
    slo = views[0][1].slo
    panels = [
        Panel("TTFT", "seconds", (("ttft_p50_s", "p50", "-"), ("ttft_p95_s", "p95", "--")), slo=slo.ttft_s,
              bands=("ttft_p50_s", "ttft_p95_s"), records=(("ttft_s", "TTFT"),)),
        Panel("TPOT", "seconds per token", (("tpot_p50_s", "p50", "-"), ("tpot_p95_s", "p95", "--")),
              slo=slo.tpot_s, bands=("tpot_p50_s", "tpot_p95_s"), records=(("tpot_s", "TPOT"),)),
        Panel("End-to-end", "seconds", (("e2e_p50_s", "p50", "-"), ("e2e_p95_s", "p95", "--")), slo=slo.e2e_s,
              bands=("e2e_p50_s", "e2e_p95_s"), records=(("e2e_s", "e2e"),)),
    ]
    return _panels_vs_users(views, panels, "Latency", f"Latency percentiles vs load ({load_unit(views)}; "
                                           "bands: 95% bootstrap intervals)")


def plot_throughput_vs_users(views: Sequence[View], path: Path) -> Path:
    """Output tokens/s, requests/s (all and within SLO) and error rate per step."""
    return _save(throughput_figure(views), path)


def throughput_figure(views: Sequence[View]) -> plt.Figure:
    """The throughput chart as a figure, before it is saved (its legends can be read back)."""
    panels = [
        Panel("Output throughput", "tokens / s", (("output_tok_s", "output tokens/s", "-"),), rates=True),
        Panel("Total throughput", "tokens / s", (("total_tok_s", "input + output tokens/s", "-"),
                                                 ("input_tok_s", "input tokens/s", "--")), rates=True),
        Panel("Request rate", "requests / s", (("rps", "all", "-"), ("goodput_rps", "within SLO", "--")),
              rates=True),
        Panel("Errors", "% of requests", (("error_rate", "all errors", "-"), ("load_error_rate", "load errors", "--")),
              scale=100.0),
    ]
    return _panels_vs_users(views, panels, "Throughput", f"Throughput vs load ({load_unit(views)}; tokens counted in the "
                                           "window they were streamed)")


def plot_itl(views: Sequence[View], path: Path) -> Path:
    """Inter-token latency per step: the median request's median gap and its p99 gap."""
    return _save(itl_figure(views), path)


def itl_figure(views: Sequence[View]) -> plt.Figure:
    """The inter-token latency chart as a figure, before it is saved (its legends can be read back)."""
    panels = [Panel("Inter-token latency", "seconds between tokens",
                    (("itl_p50_s", "median gap (median request)", "-"), ("itl_p99_s", "p99 gap (median request)", "--")),
                    records=(("itl_p50_s", "each request's median gap"), ("itl_p99_s", "each request's p99 gap")))]
    return _panels_vs_users(views, panels, "Inter-token latency", f"Inter-token latency vs load ({load_unit(views)})")


def plot_cdfs(views: Sequence[View], path: Path, metrics: Sequence[str] = ("ttft", "tpot", "e2e")) -> Path:
    """Empirical CDFs of per-request latencies, one line per run."""
    names = {"ttft": "TTFT (s)", "tpot": "TPOT (s per token)", "e2e": "end-to-end latency (s)"}
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        wide = False
        for i, (label, a) in enumerate(views):
            values = np.sort(a.ok[f"{metric}_s"].dropna().to_numpy())
            if values.size == 0:
                continue
            # At most 2000 points per curve: quantiles at evenly spaced probabilities.
            probs = np.linspace(0, 1, min(values.size, 2000))
            xs = np.quantile(values, probs)
            ax.plot(xs, probs * 100, color=COLORS[i % len(COLORS)], lw=2, label=f"{label} (n={values.size:,})")
            wide |= bool(values[0] > 0 and values[-1] / values[0] > 50)
        slo = views[0][1].slo
        limit = {"ttft": slo.ttft_s, "tpot": slo.tpot_s, "e2e": slo.e2e_s}.get(metric)
        if limit is not None:
            ax.axvline(limit, color="red", ls="-.", lw=1, label=f"SLO {limit:g} s")
        if wide:
            _log_axis(ax, "x")
        ax.set(xlabel=names[metric], ylabel="% of requests at or below", title=f"{metric.upper()} CDF")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        legend(ax, fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_timeline(views: Sequence[View], path: Path, bins: int = 120) -> Path:
    """The first run over time: active users, request outcomes per second, TTFT of each request."""
    _, a = views[0]
    df = a.run.df
    t0 = float(df["started_at"].min())
    # Minutes for long runs, so tick labels stay short.
    unit, per = ("minutes", 60.0) if float(df["started_at"].max()) - t0 > 1800 else ("seconds", 1.0)
    t = (df["started_at"].to_numpy() - t0) / per
    edges = np.linspace(0, max(float(t.max()), 1e-9), bins + 1)
    width = edges[1] - edges[0]
    is_err = df["status"].eq("error").to_numpy()
    ok_counts, _ = np.histogram(t[~is_err], edges)
    err_counts, _ = np.histogram(t[is_err], edges)
    users = pd.Series(df["active_users"].to_numpy()).groupby(np.digitize(t, edges[1:-1])).max()

    fig, axes = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True)
    if load_unit(views[:1]) == USERS:
        axes[0].step(edges[users.index.to_numpy()], users.to_numpy(), where="post", color=COLORS[0])
        axes[0].set(ylabel="active users", title="Run timeline (by request start time)")
    else:  # open loop: the pool size says nothing, the offered rate per step does
        for _, step in a.table.iterrows():
            axes[0].hlines(step["load_level"], (step["start"] - t0) / per, (step["end"] - t0) / per, color=COLORS[0])
        axes[0].set(ylabel="offered req/s", title="Run timeline (by request start time)")
    axes[1].bar(edges[:-1], ok_counts / width, width=width, align="edge", color=COLORS[2], label="ok")
    axes[1].bar(edges[:-1], err_counts / width, width=width, align="edge", bottom=ok_counts / width,
                color=COLORS[3], label="error")
    axes[1].set(ylabel=f"requests / {unit[:-1]}")
    legend(axes[1], fontsize=8, loc="upper left")
    ok = _sample(a.ok, MAX_POINTS)
    axes[2].scatter((ok["started_at"] - t0) / per, ok["ttft_s"], s=3, alpha=0.3, color=COLORS[0], rasterized=True,
                    label="TTFT per request")
    if a.slo.ttft_s is not None:
        axes[2].axhline(a.slo.ttft_s, color="red", ls="-.", lw=1, label=f"SLO {a.slo.ttft_s:g} s")
    if len(ok) and ok["ttft_s"].max() / max(ok["ttft_s"].min(), 1e-9) > 50:
        _log_axis(axes[2], "y")
    axes[2].set(ylabel="TTFT (s)", xlabel=f"{unit} since the first request")
    legend(axes[2], fontsize=8, loc="upper left", markerscale=4)
    for ax in axes:
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_capacity(searches: Sequence[tuple[str, SearchSummary]], path: Path) -> Path:
    """A breakpoint search: SLO attainment (with its 95% interval) and goodput per probe against load.

    Each probe is a point numbered in the order it ran; the SLO target is a line; the band where the
    boundary lies ([capacity, first failing]) is shaded. Several searches (a comparison) share the axes.
    """
    fig, (att_ax, good_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    unit = searches[0][1]["unit"] if searches else "users"
    for i, (label, s) in enumerate(searches):
        color = f"C{i}"
        probes = [p for p in s["probes"] if p.get("attainment") is not None]
        for n, p in enumerate(s["probes"], start=1):
            att = p["attainment"]
            if att is None:
                continue
            ci = p.get("ci")
            yerr = [[max(0.0, att - ci[0])], [max(0.0, ci[1] - att)]] if ci else None
            marker = {"pass": "o", "fail": "x", "undecided": "s"}[p["verdict"]]
            att_ax.errorbar(p["level"], p["attainment"], yerr=yerr, fmt=marker, color=color, capsize=3, ms=6)
            att_ax.annotate(str(n), (p["level"], p["attainment"]), textcoords="offset points", xytext=(5, 5),
                            fontsize=8, color=color)
            if p.get("goodput_rps") is not None:
                good_ax.plot(p["level"], p["goodput_rps"], marker, color=color, ms=6)
                good_ax.annotate(str(n), (p["level"], p["goodput_rps"]), textcoords="offset points",
                                 xytext=(5, 5), fontsize=8, color=color)
        lo, hi = s["interval"]
        if hi is not None:
            for ax in (att_ax, good_ax):
                ax.axvspan(lo, hi, color=color, alpha=0.15,
                           label=f"{label + ': ' if len(searches) > 1 else ''}boundary in [{lo}, {hi}]")
        if probes:
            att_ax.plot([], [], "o", color=color, label=f"{label}: pass / x fail / ■ undecided" if len(searches) > 1
                        else "o pass · x fail · ■ undecided")
        att_ax.axhline(s["slo"]["target"], color="red", ls="-.", lw=1,
                       label=f"SLO target {s['slo']['target']:.0%}" if i == 0 else None)
    att_ax.set_ylim(-0.05, 1.05)
    att_ax.set_ylabel("SLO attainment (95% interval)")
    good_ax.set_ylabel("goodput (requests/s meeting the SLO)")
    for ax in (att_ax, good_ax):
        ax.set_xlabel(f"load ({unit})")
        ax.grid(alpha=0.3)
        legend(ax, fontsize=8, loc="best")
    att_ax.set_title("Attainment per probe (numbers: probe order)")
    good_ax.set_title("Goodput per probe")
    return _save(fig, path)
