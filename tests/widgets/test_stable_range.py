"""Live plots hold their view range while the data grow inside it, moving in nice steps."""

from __future__ import annotations

import pyqtgraph as pg
import pytest

from widgets.plot_style import StableRange, growing_range, nice_ceiling


@pytest.mark.parametrize(
    "value, ceiling",
    [(1.0, 1.0), (1.01, 1.2), (7.0, 8.0), (8.5, 10.0), (0.031, 0.04), (1234.0, 1500.0), (0.0, 1.0)],
)
def test_nice_ceiling(value, ceiling):
    assert nice_ceiling(value) == pytest.approx(ceiling)


def test_range_moves_only_when_the_data_leave_it_and_not_after_the_user_zooms(qtbot):
    plot = pg.PlotWidget()
    qtbot.addWidget(plot)
    view = plot.getPlotItem().getViewBox()
    held = StableRange(view)
    moves = []
    view.sigRangeChanged.connect(lambda *_: moves.append(view.viewRange()[0][1]))
    for n in range(1, 60):
        held.show(growing_range(0.0, float(n)), (0.0, 1.0))
    # 1, 1.2, 1.5, 2, ..., 60: one move per nice step, not per point
    assert len(moves) == 15 and moves[-1] == pytest.approx(60.0)
    view.sigRangeChangedManually.emit([True, True])  # as a mouse pan/zoom does
    held.show(growing_range(0.0, 500.0), (0.0, 1.0))
    assert view.viewRange()[0][1] == pytest.approx(60.0)
