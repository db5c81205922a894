"""Panels redraw tens of times a second for hours: nothing may accumulate per redraw."""

from __future__ import annotations

import sys

import numpy as np
import PySide6
import pytest
from hand_events import model_loaded, snapshot, token

from engine.events import BlockEvent, MemorySample, RequestStarted
from live.state import LiveState
from widgets.kv_page_map import KVPageMapPanel
from widgets.latency_panel import LatencyPanel
from widgets.memory_panel import MemoryPanel
from widgets.probability_panel import ProbabilityPanel

REDRAWS = 50
DIRTY = {"kv", "tokens", "latency", "memory"}


@pytest.fixture
def panels(qtbot):
    state = LiveState()
    snap = snapshot(np.linspace(3, -3, 10), [f" t{i}" for i in range(10)], drawn=2, temperature=0.8, top_k=6)
    state.apply([model_loaded(num_blocks=64, block_size=4)])
    state.apply([BlockEvent("allocate", (0, 1), 1), BlockEvent("append", (0, 1), 1, 0, 6, (4, 2))])
    state.apply([RequestStarted(1, 3, t=0.0)] + [token(1, i, t=0.1 + 0.02 * i, snap=snap) for i in range(30)])
    state.apply(
        [
            MemorySample(1 << 29, 1 << 26, 1 << 20, 1 << 30, 1 << 30, 1 << 34, "psutil RSS", t=0.25 * i)
            for i in range(30)
        ]
    )
    made = [ProbabilityPanel(state), KVPageMapPanel(state), MemoryPanel(state), LatencyPanel(state)]
    for panel in made:
        qtbot.addWidget(panel)
        panel.resize(400, 300)
        panel.show()
    qtbot.waitExposed(made[0])
    return made


def redraw(panels, qtbot) -> None:
    for panel in panels:
        panel.refresh(DIRTY)
        panel.repaint()


def test_latency_symbols_do_not_grow_pyqtgraph_symbol_cache(panels, qtbot):
    latency = panels[3]
    redraw(panels, qtbot)
    atlas = latency.ttft_points.scatter.fragmentAtlas
    before = len(atlas)
    for _ in range(REDRAWS):
        redraw(panels, qtbot)
    assert len(atlas) == before


def test_redraws_keep_none_referenced(panels, qtbot):
    """PySide6 6.12.0 drops one reference to None on (nearly) every void Qt call. Python 3.11's
    None is not immortal, so the process dies with "none_dealloc" after ~140k such calls: a
    minute or two of live panels. Python 3.12+ makes None immortal, which hides it."""
    redraw(panels, qtbot)
    before = sys.getrefcount(None)
    for _ in range(REDRAWS):
        redraw(panels, qtbot)
    lost = before - sys.getrefcount(None)
    assert lost < REDRAWS, (
        f"{lost} references to None lost over {REDRAWS} redraws with PySide6 {PySide6.__version__} on "
        f"Python {sys.version.split()[0]}: this build will crash the app; pin PySide6-Essentials<6.12"
    )
