"""The charts as a reader sees them: rendered pixels, not the artists' settings.

A legend entry is a short sample of its line; at matplotlib's default length the
p95 line's one dash gap sat behind its marker and the entry looked as solid as
p50's (latency, ITL, throughput and comparison charts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from tokenload.analysis import plots
from tokenload.analysis.pipeline import analyze
from tokenload.analysis.summary import Analysis
from tokenload.analysis.synthetic import Law, write_synthetic_run


@pytest.fixture(scope="module")
def analysis(tmp_path_factory: pytest.TempPathFactory) -> Analysis:
    return analyze(write_synthetic_run(tmp_path_factory.mktemp("plots") / "run", n=3000, seed=1), write=False)


def _segments(fig: Figure, handle: Line2D) -> int:
    """Separate inked stretches along the middle of a legend sample, as drawn."""
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].astype(int)  # type: ignore[attr-defined]
    box = handle.get_window_extent(fig.canvas.get_renderer())  # type: ignore[attr-defined]
    middle = int(round(image.shape[0] - (box.y0 + box.y1) / 2))
    band = image[middle - 1:middle + 2, int(box.x0):int(box.x1) + 1]
    ink = ((3 * 255 - band.sum(axis=2)) > 150).any(axis=0)
    return int(ink[0]) + int(np.sum(ink[1:] & ~ink[:-1]))


@pytest.mark.parametrize("draw", [plots.latency_figure, plots.throughput_figure, plots.itl_figure])
@pytest.mark.parametrize("runs", [1, 2], ids=["report", "comparison"])
def test_legend_samples_show_the_dash_style(analysis: Analysis, draw: Callable[[Sequence[plots.View]], Figure],
                                            runs: int) -> None:
    fig = draw([(f"run {i + 1}", analysis) for i in range(runs)])
    checked = []
    for ax in fig.axes:
        legend = ax.get_legend()
        for handle, text in zip(legend.legend_handles, legend.get_texts()):
            if not isinstance(handle, Line2D) or handle.get_linestyle() in ("None", ""):
                continue  # a marker-only entry (steps with too few requests)
            solid = handle.get_linestyle() == "-"
            segments = _segments(fig, handle)
            assert (segments == 1) if solid else (segments >= 3), (text.get_text(), handle.get_linestyle(), segments)
            checked.append(solid)
    assert checked.count(False) >= runs and checked.count(True) >= runs  # p95 (dashed) beside p50 (solid)


@pytest.fixture(scope="module")
def one_level(tmp_path_factory: pytest.TempPathFactory) -> Analysis:
    """A run of one load level (8 users) on a channel of 2 slots: TTFT is mostly the wait for a slot."""
    law = Law(users=(8,), capacity=2, prefill_a=0.05, prefill_b=0.00002, input_tokens=(100, 2000))
    return analyze(write_synthetic_run(tmp_path_factory.mktemp("one") / "run", law, n=600, seed=3), write=False)


@pytest.mark.parametrize("draw", [plots.latency_figure, plots.throughput_figure, plots.itl_figure])
@pytest.mark.parametrize("runs", [1, 2], ids=["report", "comparison"])
def test_one_load_level_is_drawn_side_by_side_not_as_dots(one_level: Analysis,
                                                         draw: Callable[[Sequence[plots.View]], Figure],
                                                         runs: int) -> None:
    """A curve of one level was one dot per run on an axis from 7.9 to 8.1 users: each run gets its place on
    the x axis instead, with its requests' distribution (a box) or the level's value (a bar)."""
    labels = [f"run {i + 1}" for i in range(runs)]
    fig = draw([(label, one_level) for label in labels])
    assert "at 8 users, the only load level" in fig.texts[0].get_text()
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == labels
        dots = [line for line in ax.get_lines() if len(line.get_xdata()) == 1 and line.get_marker() not in ("", "None")]
        assert not dots, ax.get_title()
        shapes = [p for p in ax.patches if np.isfinite(p.get_extents().width)] + list(ax.collections)
        assert len(shapes) >= runs, ax.get_title()


def test_no_ttft_fit_is_drawn_where_queueing_sets_ttft(one_level: Analysis) -> None:
    """At 8 users on 2 slots the wait for a slot dwarfs the prefill: the fit described queueing
    ("5.61 - 0.00174 n"); now the summary and the chart say so instead of drawing a line."""
    fit = one_level.summary["fits"]["ttft_vs_input"]
    assert fit["model"] is None and "does not grow with input length" in fit["note"]
    assert "queueing" in fit["note"] and "prompt-sweep" in fit["note"]
    fig = plots.ttft_figure([("run", one_level)])
    (ax,) = fig.axes
    assert not [line for line in ax.get_lines() if line.get_label().startswith(("linear", "power"))]
    assert any("does not grow with input length" in t.get_text() for t in ax.texts)
    assert any("no fit" in t.get_text() for t in ax.get_legend().get_texts())
