"""Step timeline: what each recent engine step scheduled, as stacked bars.

Each bar is one step: its prefill tokens (prompt chunks) at the bottom, its decode tokens (one per
running sequence) on top, so chunked prefill shows as steps that carry both. Lines on the right
axis give the running and waiting sequence counts after the step, and a red tick above a bar marks
a step in which the scheduler preempted a sequence (StepStats counts preemptions cumulatively, so
a step's own count is the difference from the step before).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from engine.events import StepStats
from live.state import LiveState
from widgets import theme
from widgets.plot_style import legend_entry, styled_plot

# Steps drawn: enough to see a burst of requests being admitted, prefilled and decoded, few
# enough that each bar stays wider than a pixel in a dock.
SHOWN_STEPS = 160
COLOURS = {
    "prefill": "#e8833a",
    "decode": "#5b9bd5",
    "running": "#5fd38d",
    "waiting": "#d7dae0",
    "preempted": "#ff5c5c",
}


@dataclass(frozen=True, slots=True)
class TimelineSeries:
    """The recent steps as columns, oldest first."""

    step: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    preempted: np.ndarray  # preemptions made in that step

    def __len__(self) -> int:
        return len(self.step)

    @property
    def mixed_steps(self) -> int:
        """Steps that carried prefill and decode tokens together (chunked prefill at work)."""
        return int(np.count_nonzero((self.prefill > 0) & (self.decode > 0)))


def timeline_series(steps: list[StepStats], previous_preemptions: int | None = None) -> TimelineSeries:
    """Columns for `steps`; `previous_preemptions` is the cumulative count before the first one
    (None: the first step's own count is unknown and taken as 0)."""
    cumulative = np.array([s.preemptions for s in steps], np.int64)
    before = cumulative[0] if previous_preemptions is None and len(steps) else previous_preemptions or 0
    preempted = np.diff(cumulative, prepend=before) if len(steps) else cumulative
    return TimelineSeries(
        step=np.array([s.step for s in steps], np.float64),
        prefill=np.array([s.prefill_tokens for s in steps], np.float64),
        decode=np.array([s.decode_tokens for s in steps], np.float64),
        running=np.array([s.running for s in steps], np.float64),
        waiting=np.array([s.waiting for s in steps], np.float64),
        preempted=np.maximum(preempted, 0),
    )


class StepTimelinePanel(QWidget):
    def __init__(self, state: LiveState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.series = timeline_series([])
        self.setObjectName("stepTimelinePanel")
        self.setStyleSheet(
            f"#stepTimelinePanel, #stepTimelinePanel QLabel {{ background: {theme.BACKGROUND}; "
            f"color: {theme.TEXT}; }}"
        )
        self.readout = QLabel()
        self.readout.setTextFormat(Qt.TextFormat.RichText)
        self.readout.setWordWrap(True)
        self.plot = styled_plot()
        item = self.plot.getPlotItem()
        item.setLabel("bottom", "engine step")
        item.setLabel("left", "tokens in the step")
        self.prefill_bars = pg.BarGraphItem(x=[], height=[], width=0.85, brush=COLOURS["prefill"], pen=None)
        self.decode_bars = pg.BarGraphItem(
            x=[], y0=[], height=[], width=0.85, brush=COLOURS["decode"], pen=None
        )
        item.addItem(self.prefill_bars)
        item.addItem(self.decode_bars)
        self.preempt_marks = item.plot(
            pen=None, symbol="t", symbolSize=10, symbolBrush=pg.mkBrush(COLOURS["preempted"]), symbolPen=None
        )

        # Sequence counts on a second view box sharing the x axis, against the right axis.
        self.count_view = pg.ViewBox()
        item.showAxis("right")
        item.getAxis("right").setLabel("sequences")
        item.getAxis("right").linkToView(self.count_view)
        item.scene().addItem(self.count_view)
        self.count_view.setXLink(item)
        self.running_curve = pg.PlotDataItem(pen=pg.mkPen(COLOURS["running"], width=1.5), stepMode="center")
        self.waiting_curve = pg.PlotDataItem(
            pen=pg.mkPen(COLOURS["waiting"], width=1.2, style=Qt.PenStyle.DashLine), stepMode="center"
        )
        self.count_view.addItem(self.running_curve)
        self.count_view.addItem(self.waiting_curve)
        item.getViewBox().sigResized.connect(self._sync_count_view)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addWidget(self.readout)
        layout.addWidget(self.plot, 1)
        self._redraw()

    def _sync_count_view(self) -> None:
        view = self.plot.getPlotItem().getViewBox()
        self.count_view.setGeometry(view.sceneBoundingRect())
        self.count_view.linkedViewChanged(view, self.count_view.XAxis)

    def refresh(self, dirty: set[str]) -> None:
        if "steps" in dirty:
            self._redraw()

    def _redraw(self) -> None:
        steps = list(self.state.steps)
        previous = steps[-SHOWN_STEPS - 1].preemptions if len(steps) > SHOWN_STEPS else None
        self.series = s = timeline_series(steps[-SHOWN_STEPS:], previous)
        self.prefill_bars.setOpts(x=s.step, height=s.prefill, width=0.85)
        self.decode_bars.setOpts(x=s.step, y0=s.prefill, height=s.decode, width=0.85)
        marked = s.preempted > 0
        self.preempt_marks.setData(s.step[marked], (s.prefill + s.decode)[marked])
        if len(s):
            # stepMode="center" wants one more x edge than values: each count spans its bar.
            edges = np.append(s.step - 0.5, s.step[-1] + 0.5)
            self.running_curve.setData(edges, s.running)
            self.waiting_curve.setData(edges, s.waiting)
            self.count_view.setYRange(0, max(1.0, float(max(s.running.max(), s.waiting.max()))) * 1.1)
        else:
            self.running_curve.setData([], [])
            self.waiting_curve.setData([], [])
        self.readout.setText(self._readout(steps))

    def _readout(self, steps: list[StepStats]) -> str:
        s = self.series
        if not len(s):
            return f"<span style='color:{theme.MUTED}'>Steps: none yet</span>"
        last = steps[-1]
        parts = [
            legend_entry(COLOURS["prefill"], "prefill", "■") + f" <b>{last.prefill_tokens}</b>",
            legend_entry(COLOURS["decode"], "decode", "■") + f" <b>{last.decode_tokens}</b> tokens",
            legend_entry(COLOURS["running"], "running") + f" <b>{last.running}</b>",
            legend_entry(COLOURS["waiting"], "waiting", "┅") + f" <b>{last.waiting}</b>",
            legend_entry(COLOURS["preempted"], "preemptions", "▼") + f" <b>{last.preemptions}</b>",
            f"<span style='color:{theme.MUTED}'>{s.mixed_steps} of the last {len(s)} steps "
            "mixed prefill with decode</span>",
        ]
        return " &nbsp; ".join(parts)
