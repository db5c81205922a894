"""The latency graph: one point per generated token, TTFT marked, ITL percentiles."""

from __future__ import annotations

import numpy as np
import pytest
from hand_events import token

from engine.events import RequestStarted
from live.state import LiveState
from widgets.latency_panel import LatencyPanel


@pytest.fixture
def panel(qtbot):
    panel = LatencyPanel(LiveState())
    qtbot.addWidget(panel)
    panel.resize(400, 300)
    return panel


def test_one_point_per_token_with_ttft_marked_per_request(panel):
    itl_1 = [0.02, 0.03, 0.025, 0.04]
    times_1 = np.cumsum([0.3, *itl_1])
    events = [RequestStarted(1, 5, t=0.0), RequestStarted(2, 5, t=0.1)]
    events += [token(1, i, t=float(t)) for i, t in enumerate(times_1)]
    events += [token(2, 0, t=0.6), token(2, 1, t=0.65)]
    panel.refresh(panel.state.apply(events))
    assert panel.point_count() == 7
    assert panel.ttft_points.xData.tolist() == [0, 5]
    assert panel.ttft_points.yData == pytest.approx([300.0, 500.0])
    itl_y = panel.itl_curve.yData
    assert itl_y[np.isfinite(itl_y)] == pytest.approx([20.0, 30.0, 25.0, 40.0, 50.0])
    itl_ms = np.array([20.0, 30.0, 25.0, 40.0, 50.0])
    assert (panel.p50, panel.p99) == pytest.approx((np.percentile(itl_ms, 50), np.percentile(itl_ms, 99)))
    assert panel.p50_line.isVisible() and panel.p50_line.value() == pytest.approx(np.log10(panel.p50))
    text = panel.readout.text()
    assert "p50 <b>30.0</b>" in text and "TTFT <b>500 ms</b> (reply #2)" in text and "7 tokens" in text


def test_points_follow_new_tokens_and_the_rate_curve_has_one_value_each(panel):
    state = panel.state
    state.apply([RequestStarted(1, 5, t=0.0)])
    for i in range(10):
        panel.refresh(state.apply([token(1, i, t=0.2 + 0.05 * i)]))
        assert panel.point_count() == i + 1
    rate = panel.rate_curve.yData
    assert len(rate) == 10 and np.isfinite(rate).all()


def test_empty_state_shows_no_points(panel):
    assert panel.point_count() == 0
    assert "no tokens" in panel.readout.text()
    assert not panel.p50_line.isVisible()
