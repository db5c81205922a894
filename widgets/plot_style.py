"""The pyqtgraph look shared by the time-series panels.

Legends are a line of coloured text above each plot rather than a box inside it: a box would
cover the newest data, which is what a live graph is read for.
"""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtWidgets import QGraphicsItem

from widgets import theme

# Points kept per horizontal pixel by auto downsampling (pyqtgraph's default is 5). Peak mode
# keeps each bucket's min and max, so 1 still draws every spike while painting a fifth of the
# segments of a long series.
AUTO_DOWNSAMPLE_FACTOR = 1.0


class LogValueAxis(pg.AxisItem):
    """A log-scale axis labelled with plain values (20, 50, 100, 200, ...), not powers of ten.

    Only ticks whose leading digit is 1, 2 or 5 get a label, so minor ticks do not crowd.
    """

    def logTickStrings(self, values, scale, spacing):  # noqa: N802 - pyqtgraph override
        labels = []
        for v in values:
            value = 10.0**v * scale
            leading = round(value / 10.0 ** math.floor(math.log10(value))) if value > 0 else 0
            labels.append(f"{value:g}" if leading in (1, 2, 5) else "")
        return labels


def styled_plot(axis_items: dict[str, pg.AxisItem] | None = None) -> pg.PlotWidget:
    """A PlotWidget in the panels' dark look, with clip-to-view and peak downsampling on."""
    plot = pg.PlotWidget(background=theme.BACKGROUND, axisItems=axis_items)
    item = plot.getPlotItem()
    item.setClipToView(True)
    item.setDownsampling(auto=True, mode="peak")
    item.showGrid(x=False, y=True, alpha=0.15)  # x grid lines cost more paint time than they help
    item.setMenuEnabled(False)
    for side in ("left", "bottom", "right"):
        axis = item.getAxis(side)
        axis.setPen(pg.mkPen(theme.GRID))
        axis.setTextPen(pg.mkPen(theme.MUTED))
        # An axis repaints whenever anything in its plot does, replaying its tick labels as
        # text each time (the most expensive part of a live plot's paint, measured). Cached as
        # a pixmap, it is only re-rendered when its range or size changes.
        axis.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
    return plot


# Range ends snap up to these multiples of a power of ten: at most ~25% of a view is empty, and
# a growing series moves its range (and so re-renders its axes) only every ~20% of growth.
NICE_STEPS = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def nice_ceiling(value: float) -> float:
    """The smallest NICE_STEPS x 10^k that is >= value (value > 0; else 1)."""
    if not math.isfinite(value) or value <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    for step in NICE_STEPS:
        if step * scale >= value * (1 - 1e-12):
            return step * scale
    return 10.0 * scale


class StableRange:
    """Holds a live plot's view range still while its data grow, moving it in nice steps.

    pyqtgraph's auto-range moves the view on every redraw of a growing series, and each move
    re-renders the axes' tick labels, the most expensive part of painting a live plot. Here the
    range only moves when the data leave it. A user who pans or zooms takes over until the
    plot's auto-range button hands the view back."""

    def __init__(self, view_box: pg.ViewBox) -> None:
        self.view_box = view_box
        self.user_controls = False
        self._target: tuple | None = None
        view_box.disableAutoRange()
        view_box.sigRangeChangedManually.connect(self._on_user_range)
        view_box.sigStateChanged.connect(self._on_state)

    def _on_user_range(self, *_) -> None:
        self.user_controls = True

    def _on_state(self, *_) -> None:
        if any(self.view_box.state["autoRange"]):  # the "A" button: back to the live view
            self.user_controls = False
            self._target = None
            self.view_box.disableAutoRange()

    def show(self, x_range: tuple[float, float] | None, y_range: tuple[float, float] | None) -> None:
        """Make the view show at least these data ranges (None: leave that axis as it is)."""
        if self.user_controls:
            return
        target = (x_range, y_range)
        if target == self._target:
            return
        self._target = target
        self.view_box.setRange(xRange=x_range, yRange=y_range, padding=0)


def growing_range(low: float, high: float) -> tuple[float, float]:
    """[low, a nice ceiling of high] for a series that starts at `low` and grows upwards."""
    return low, low + nice_ceiling(high - low)


def legend_entry(color: str, label: str, glyph: str = "━") -> str:
    """Rich text for one legend entry: the series' mark in its colour, then its label."""
    return f"<span style='color:{color}'>{glyph}</span>&nbsp;{label}"
