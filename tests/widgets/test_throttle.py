"""Throttled redraws are deferred, never dropped."""

from __future__ import annotations

from widgets.throttle import RedrawThrottle


def test_requests_within_the_interval_are_deferred_to_the_next_due_frame():
    throttle = RedrawThrottle(0.1)
    assert not throttle.due(now=0.0)  # nothing requested
    throttle.request()
    assert throttle.due(now=0.0)
    throttle.request()
    assert not throttle.due(now=0.05) and throttle.pending
    assert throttle.due(now=0.1) and not throttle.pending
    assert not throttle.due(now=5.0)
    throttle.request()
    throttle.drawn(now=5.0)  # a forced redraw satisfies the request and restarts the interval
    assert not throttle.pending
    throttle.request()
    assert not throttle.due(now=5.05) and throttle.due(now=5.2)


def test_panels_carry_a_deferred_redraw_to_a_later_idle_frame(qtbot):
    from widget_events import token

    from engine.events import RequestStarted
    from live.state import LiveState
    from widgets.latency_panel import LatencyPanel

    state = LiveState()
    panel = LatencyPanel(state)
    qtbot.addWidget(panel)
    state.apply([RequestStarted(1, 3, t=0.0)])
    panel.refresh(state.apply([token(1, 0, t=0.5)]))
    assert panel.point_count() == 1
    panel.throttle.interval_s = 3600.0  # the next redraw cannot be due during this test
    panel.refresh(state.apply([token(1, 1, t=0.6)]))
    assert panel.point_count() == 1 and panel.throttle.pending
    panel.throttle.interval_s = 0.0
    panel.refresh(set())  # an idle frame: nothing new arrived, the deferred redraw happens
    assert panel.point_count() == 2


def test_flush_draws_a_deferred_redraw_at_once(qtbot):
    from widget_events import token

    from engine.events import RequestStarted
    from live.state import LiveState
    from widgets.latency_panel import LatencyPanel

    state = LiveState()
    panel = LatencyPanel(state)
    qtbot.addWidget(panel)
    state.apply([RequestStarted(1, 3, t=0.0)])
    panel.refresh(state.apply([token(1, 0, t=0.5)]))
    panel.throttle.interval_s = 3600.0
    panel.refresh(state.apply([token(1, 1, t=0.6)]))
    assert panel.point_count() == 1
    panel.flush()
    assert panel.point_count() == 2 and not panel.throttle.pending
    # Throttled redraws still happen after a flush.
    panel.throttle.interval_s = 0.0
    panel.refresh(state.apply([token(1, 2, t=0.7)]))
    assert panel.point_count() == 3
