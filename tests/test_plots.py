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
from tokenload.analysis.synthetic import write_synthetic_run


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
