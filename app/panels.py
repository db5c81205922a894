"""The live inspection panels (from widgets/), built over one LiveState, and the order in
which they redraw.

Each panel only reads the state and redraws in `refresh(dirty)`; none talks to the engine.
Qt repaints every widget marked dirty in one pass per frame, and a pyqtgraph plot costs tens of
milliseconds to paint on a small CPU, so refreshing all plots in the same frame makes one long
pass that the user feels as a stutter (and the engine as a GIL hog). So the plots take turns:
one visible plot per frame, with every dirty key it missed; a plot in a hidden tab or a closed
dock is brought up to date only now and then. Every other panel refreshes every frame.
Measured on the packaged model (2 cores, interleaved runs): p99 delay of a 10 ms GUI probe
timer 145-155 ms with every plot every frame, 74-91 ms with plots taking turns.
A visible plot also redraws at most every PLOT_INTERVAL_S: a time series read by eye needs a
few updates a second, and at 15 redraws a second each the plots were ~60% of the GUI thread's
CPU time during generation (py-spy, `python -m tools.measure_app`). And a plot's redraw is deferred a
moment (`_defer`): Qt repaints every dirty widget of the window in one pass, so a plot redrawn
in the same frame as the chat and the bars made that frame the longest stall of the event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol

from PySide6.QtCore import QObject, QTimer, Slot

from live.state import LiveState

if TYPE_CHECKING:
    from widgets.kv_page_map import KVPageMapPanel
    from widgets.latency_panel import LatencyPanel
    from widgets.memory_panel import MemoryPanel
    from widgets.probability_panel import ProbabilityPanel
    from widgets.quality_panel import QualityPanel
    from widgets.roofline_panel import RooflinePanel
    from widgets.speculation_panel import SpeculationPanel
    from widgets.step_timeline import StepTimelinePanel

# The pyqtgraph panels: the expensive ones to repaint.
PLOTS = ("memory", "latency", "roofline", "step_timeline")
# A hidden plot still folds its state (some accumulate from bounded buffers) every this many
# frames: about 2 Hz at the 30 Hz render rate.
HIDDEN_EVERY_FRAMES = 15
# The shortest time between two redraws of one visible plot (once a second: a history graph
# read by eye; the text and the bars stream at the render rate).
PLOT_INTERVAL_S = 1.0
# How long after a render frame a due plot redraws: long enough for Qt to paint the frame's
# other widgets first, short enough to read as the same moment.
PLOT_DEFER_MS = 5


class LivePanel(Protocol):
    """What the render frame asks of a panel."""

    def refresh(self, dirty: set[str]) -> None: ...

    def isVisible(self) -> bool: ...  # noqa: N802 - Qt's name


@dataclass(slots=True)
class Panels:
    probabilities: ProbabilityPanel
    page_map: KVPageMapPanel
    memory: MemoryPanel
    latency: LatencyPanel
    quality: QualityPanel
    roofline: RooflinePanel
    step_timeline: StepTimelinePanel
    speculation: SpeculationPanel

    _pending: dict[str, set[str]] = field(default_factory=dict)  # dirty keys a panel has not seen
    _frame: int = 0
    _next_plot: int = 0
    _plot_drawn_at: dict[str, float] = field(default_factory=dict)  # perf_counter of last refresh
    # Runs a due plot's refresh: immediately by default; the window passes a short timer so the
    # plot paints in a pass of its own, after the frame's other widgets.
    _defer: Callable[[Callable[[], None]], None] = lambda refresh: refresh()

    def named(self) -> list[tuple[str, LivePanel]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")]

    def all(self) -> tuple[LivePanel, ...]:
        return tuple(panel for _, panel in self.named())

    def refresh(self, dirty: set[str], now: float | None = None) -> None:
        """One render frame: the non-plot panels, then the next visible plot that is due, then
        (now and then) the hidden plots; each gets all the dirty keys gathered since its last
        refresh."""
        now = time.perf_counter() if now is None else now
        self._frame += 1
        due_plots = []
        for name, panel in self.named():
            self._pending.setdefault(name, set()).update(dirty)
            if name not in PLOTS:
                self._refresh(name, panel)
            elif panel.isVisible():
                if now - self._plot_drawn_at.get(name, -math.inf) >= PLOT_INTERVAL_S:
                    due_plots.append((name, panel))
            elif self._frame % HIDDEN_EVERY_FRAMES == 0:
                self._refresh(name, panel)
        if due_plots:
            self._next_plot %= len(due_plots)
            name, panel = due_plots[self._next_plot]
            self._plot_drawn_at[name] = now
            self._defer(lambda: self._refresh(name, panel))
            self._next_plot += 1

    def refresh_all(self, dirty: set[str]) -> None:
        """Every panel at once, plot turns ignored: the final frame of a scripted screenshot."""
        for name, panel in self.named():
            self._pending.setdefault(name, set()).update(dirty)
            self._refresh(name, panel)

    def _refresh(self, name: str, panel: LivePanel) -> None:
        keys = self._pending.get(name, set())
        self._pending[name] = set()
        panel.refresh(keys)


class PlotPass(QObject):
    """Runs a due plot's refresh PLOT_DEFER_MS after the frame, in a paint pass of its own."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._refresh: Callable[[], None] | None = None
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(PLOT_DEFER_MS)
        self._timer.timeout.connect(self._run)

    def defer(self, refresh: Callable[[], None]) -> None:
        self._refresh = refresh
        self._timer.start()

    @Slot()
    def _run(self) -> None:
        refresh, self._refresh = self._refresh, None
        if refresh is not None:
            refresh()


def build_panels(live: LiveState, defer: Callable[[Callable[[], None]], None] | None = None) -> Panels:
    from app.quality.jobs import QUALITY_SOURCES
    from widgets.kv_page_map import KVPageMapPanel
    from widgets.latency_panel import LatencyPanel
    from widgets.memory_panel import MemoryPanel
    from widgets.probability_panel import ProbabilityPanel
    from widgets.quality_panel import QualityPanel
    from widgets.roofline_panel import RooflinePanel
    from widgets.speculation_panel import SpeculationPanel
    from widgets.step_timeline import StepTimelinePanel

    return Panels(
        ProbabilityPanel(live),
        KVPageMapPanel(live),
        MemoryPanel(live),
        LatencyPanel(live),
        QualityPanel(live, QUALITY_SOURCES),
        RooflinePanel(live),
        StepTimelinePanel(live),
        SpeculationPanel(live),
        _defer=defer if defer is not None else (lambda refresh: refresh()),
    )
