"""Latency graph: one point per generated token, on a log-scale millisecond axis.

A request's first token is its time to first token (prefill and queueing), drawn as a triangle;
every later token is its inter-token latency, on a line in token order that breaks where a new
request begins. Log scale, because a
TTFT of a second and ITLs of twenty milliseconds both need to be readable on one axis. The right
axis carries the rolling tokens/s across all requests; dashed lines mark ITL p50 and p99.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QVBoxLayout, QWidget

from live.state import LiveState
from widgets import theme
from widgets.live_label import LiveLabel
from widgets.plot_style import (
    AUTO_DOWNSAMPLE_FACTOR,
    LogValueAxis,
    StableRange,
    growing_range,
    legend_entry,
    nice_ceiling,
    styled_plot,
)

# Beyond this many points per-token dots merge into a smear and cost more than the line.
MAX_DOTS = 400
# Symbol pens and brushes are made once: pyqtgraph caches a rendered symbol per pen/brush
# object, so a colour given as a string would add a new cache entry on every setData.
NO_PEN = pg.mkPen(None)


def itl_percentiles(latency_ms: np.ndarray, is_first: np.ndarray) -> tuple[float, float]:
    """(p50, p99) of the inter-token latencies (first tokens excluded); NaN when there are none."""
    itl = latency_ms[(is_first == 0) & np.isfinite(latency_ms)]
    if itl.size == 0:
        return math.nan, math.nan
    p50, p99 = np.percentile(itl, [50, 99])
    return float(p50), float(p99)


class LatencyPanel(QWidget):
    def __init__(self, state: LiveState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.p50 = self.p99 = math.nan
        self.setObjectName("latencyPanel")
        self.setStyleSheet(
            f"#latencyPanel, #latencyPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.readout = LiveLabel()
        self.readout.setTextFormat(Qt.TextFormat.RichText)
        self.readout.setWordWrap(True)
        self.plot = styled_plot({"left": LogValueAxis("left")})
        item = self.plot.getPlotItem()
        item.setLogMode(x=False, y=True)
        item.setLabel("bottom", "generated token #")
        item.setLabel("left", "latency (ms)")
        self.itl_curve = item.plot(
            autoDownsampleFactor=AUTO_DOWNSAMPLE_FACTOR,
            pen=pg.mkPen(theme.SERIES["itl"], width=1.5),
            connect="finite",
            symbol="o",
            symbolSize=3,
            symbolPen=NO_PEN,
            symbolBrush=pg.mkBrush(theme.SERIES["itl"]),
        )
        self.ttft_points = item.plot(
            pen=None,
            symbol="t1",
            symbolSize=11,
            symbolBrush=pg.mkBrush(theme.SERIES["ttft"]),
            symbolPen=NO_PEN,
        )
        self.p50_line = self._percentile_line(Qt.PenStyle.DashLine, "p50")
        self.p99_line = self._percentile_line(Qt.PenStyle.DotLine, "p99")
        for line in (self.p50_line, self.p99_line):
            item.addItem(line, ignoreBounds=True)

        # Tokens/s on a second view box sharing the x axis, drawn against the right axis.
        self.rate_view = pg.ViewBox()
        item.showAxis("right")
        item.getAxis("right").setLogMode(False, False)  # setLogMode above applied to every axis
        item.getAxis("right").setLabel("tokens/s")
        item.getAxis("right").linkToView(self.rate_view)
        item.scene().addItem(self.rate_view)
        self.rate_view.setXLink(item)
        self.rate_curve = pg.PlotDataItem(
            pen=pg.mkPen(theme.SERIES["tokens_per_s"], width=1.5), autoDownsampleFactor=AUTO_DOWNSAMPLE_FACTOR
        )
        self.rate_curve.setClipToView(True)
        self.rate_curve.setDownsampling(auto=True, method="peak")
        self.rate_view.addItem(self.rate_curve)
        item.getViewBox().sigResized.connect(self._sync_rate_view)
        self.view_range = StableRange(item.getViewBox())
        self.rate_range = StableRange(self.rate_view)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addWidget(self.readout)
        layout.addWidget(self.plot, 1)
        self._redraw()

    def _percentile_line(self, style: Qt.PenStyle, name: str) -> pg.InfiniteLine:
        line = pg.InfiniteLine(
            angle=0,
            movable=False,
            pen=pg.mkPen(theme.TEXT, width=1, style=style),
            label=name,
            labelOpts={"position": 0.98, "color": theme.MUTED, "anchors": [(1, 1), (1, 1)]},
        )
        line.hide()
        return line

    def _sync_rate_view(self) -> None:
        self.rate_view.setGeometry(self.plot.getPlotItem().getViewBox().sceneBoundingRect())
        self.rate_view.linkedViewChanged(self.plot.getPlotItem().getViewBox(), self.rate_view.XAxis)

    def refresh(self, dirty: set[str]) -> None:
        if "latency" in dirty:
            self._redraw()

    def point_count(self) -> int:
        """Points drawn: finite ITL points plus TTFT markers (one per generated token)."""
        return _finite_count(self.itl_curve) + _finite_count(self.ttft_points)

    def _redraw(self) -> None:
        ring = self.state.latency
        if len(ring) == 0:
            self.readout.setText(f"<span style='color:{theme.MUTED}'>Latency: no tokens generated yet</span>")
            for curve in (self.itl_curve, self.ttft_points, self.rate_curve):
                curve.setData([], [])
            self.p50_line.hide()
            self.p99_line.hide()
            return
        x = ring.column("x")
        latency = ring.column("latency_ms")
        first = ring.column("is_first")
        # A NaN at each request's first token breaks the ITL line between requests.
        itl = np.where(first == 0, latency, np.nan)
        if np.isfinite(itl).any():
            self.itl_curve.setSymbol("o" if len(ring) <= MAX_DOTS else None)
            self.itl_curve.setData(x, itl)
        else:  # only first tokens so far; an all-NaN series trips pyqtgraph's bounds
            self.itl_curve.setData([], [])
        self.ttft_points.setData(x[first == 1], latency[first == 1])
        rates = ring.column("tokens_per_s")
        self.rate_curve.setData(x, rates)
        self._hold_ranges(x, latency, rates)
        self.p50, self.p99 = itl_percentiles(latency, first)
        for line, value, name in ((self.p50_line, self.p50, "p50"), (self.p99_line, self.p99, "p99")):
            line.setVisible(math.isfinite(value))
            if math.isfinite(value):
                line.setPos(math.log10(max(value, 1e-3)))  # the y axis is log10(ms)
                line.label.setFormat(f"{name} {value:.1f} ms")
        self.readout.setText(self._readout(ring))

    def _hold_ranges(self, x: np.ndarray, latency_ms: np.ndarray, rates: np.ndarray) -> None:
        """Token range in nice steps, whole decades of latency (the y axis is log10 ms), and
        tokens/s from 0 with headroom on the right axis."""
        positive = latency_ms[np.isfinite(latency_ms) & (latency_ms > 0)]
        decades = None
        if positive.size:
            low = math.floor(math.log10(float(positive.min())))
            decades = (low, max(low + 1, math.ceil(math.log10(float(positive.max())))))
        self.view_range.show(growing_range(float(x[0]), float(x[-1]) + 1), decades)
        finite = rates[np.isfinite(rates)]
        if finite.size:
            self.rate_range.show(None, (0.0, nice_ceiling(1.05 * float(finite.max()))))

    def _readout(self, ring) -> str:
        first = ring.column("is_first")
        latency = ring.column("latency_ms")
        ttft_rows = np.flatnonzero(first == 1)
        # The readout doubles as the legend: each figure follows its series' mark.
        parts = []
        itl = legend_entry(theme.SERIES["itl"], "ITL")
        if math.isfinite(self.p50):
            itl += f" p50 <b>{self.p50:.1f}</b> · p99 <b>{self.p99:.1f} ms</b>"
        parts.append(itl)
        ttft = legend_entry(theme.SERIES["ttft"], "TTFT", "▲")
        if ttft_rows.size:
            row = ttft_rows[-1]
            ttft += f" <b>{latency[row]:.0f} ms</b> (reply #{int(ring.column('request_id')[row])})"
        parts.append(ttft)
        rate = ring.column("tokens_per_s")[-1]
        parts.append(
            legend_entry(theme.SERIES["tokens_per_s"], "tokens/s")
            + (f" <b>{rate:.1f}</b>" if math.isfinite(rate) else "")
            + f" <span style='color:{theme.MUTED}'>(right axis) · {len(ring)} tokens</span>"
        )
        return " &nbsp; ".join(parts)


def _finite_count(curve: pg.PlotDataItem) -> int:
    # yData is the data as given; getData() would be what the current view clips and downsamples.
    y = curve.yData
    return 0 if y is None else int(np.count_nonzero(np.isfinite(y)))
