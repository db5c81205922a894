"""Latency-vs-throughput view: points in concurrency order, axes from zero."""

from __future__ import annotations

from widgets.throughput_view import ThroughputPoint, ThroughputView


def test_points_are_drawn_in_concurrency_order_from_zero(qtbot):
    view = ThroughputView()
    qtbot.addWidget(view)
    view.add_point(ThroughputPoint(4, 120.0, 0.040))
    view.add_point(ThroughputPoint(1, 45.0, 0.022))
    x, y = view.curve.getData()
    assert list(x) == [22.0, 40.0] and list(y) == [45.0, 120.0]
    (x0, x1), (y0, y1) = view.plot.getPlotItem().getViewBox().viewRange()
    assert x0 == 0 and y0 == 0 and x1 >= 40.0 and y1 >= 120.0
    assert "×4: <b>120.0 tokens/s</b>" in view.caption.text()
    view.clear()
    assert view.curve.getData()[0] is None or len(view.curve.getData()[0]) == 0
