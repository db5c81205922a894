"""Latency against throughput: one point per measured load run.

x is the run's median inter-token latency (what one user feels), y its total generated tokens per
second across all requests (what the server delivers). Points are labelled with their concurrency,
so a sweep 1, 2, 4, 8 draws the batching trade-off: throughput climbs while each user's ITL rises.
Every point is a figure the engine measured (event times of one load run); nothing is modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from widgets import theme
from widgets.plot_style import styled_plot

POINT_COLOUR = "#5fd38d"


@dataclass(frozen=True, slots=True)
class ThroughputPoint:
    concurrency: int
    total_tokens_per_s: float
    median_itl_s: float


class ThroughputView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.points: list[ThroughputPoint] = []
        self._labels: list[pg.TextItem] = []
        self.caption = QLabel()
        self.caption.setTextFormat(Qt.TextFormat.RichText)
        self.caption.setWordWrap(True)
        self.plot = styled_plot()
        item = self.plot.getPlotItem()
        item.setLabel("bottom", "median ITL per request (ms)")
        item.setLabel("left", "total tokens/s")
        self.curve = item.plot(
            pen=pg.mkPen(theme.MUTED, width=1, style=Qt.PenStyle.DotLine),
            symbol="o",
            symbolSize=9,
            symbolBrush=pg.mkBrush(POINT_COLOUR),
            symbolPen=None,
        )
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.caption)
        layout.addWidget(self.plot, 1)
        self._redraw()

    def add_point(self, point: ThroughputPoint) -> None:
        self.points.append(point)
        self._redraw()

    def clear(self) -> None:
        self.points.clear()
        self._redraw()

    def _redraw(self) -> None:
        item = self.plot.getPlotItem()
        for label in self._labels:
            item.removeItem(label)
        self._labels.clear()
        # Joined in concurrency order, so the line reads as "more users ->".
        ordered = sorted(self.points, key=lambda p: p.concurrency)
        xs = [p.median_itl_s * 1000.0 for p in ordered]
        ys = [p.total_tokens_per_s for p in ordered]
        self.curve.setData(xs, ys)
        if ordered:
            # From zero on both axes: the ratios between points are what is read, and a single
            # point would otherwise get an axis spanning a hair around its own value.
            item.setRange(xRange=(0, max(xs) * 1.25), yRange=(0, max(ys) * 1.25), padding=0)
        for p, x, y in zip(ordered, xs, ys, strict=True):
            label = pg.TextItem(f"×{p.concurrency}", color=theme.TEXT, anchor=(0, 1))
            label.setPos(x, y)
            item.addItem(label)
            self._labels.append(label)
        if not ordered:
            self.caption.setText(
                f"<span style='color:{theme.MUTED}'>Throughput vs latency: run a load "
                "(or a sweep) to add a point per concurrency</span>"
            )
            return
        best = max(ordered, key=lambda p: p.total_tokens_per_s)
        self.caption.setText(
            f"{len(ordered)} run(s) · most throughput at ×{best.concurrency}: "
            f"<b>{best.total_tokens_per_s:.1f} tokens/s</b> at a median ITL of "
            f"<b>{best.median_itl_s * 1000.0:.1f} ms</b>"
        )
