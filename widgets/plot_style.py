"""The pyqtgraph look shared by the time-series panels.

Legends are a line of coloured text above each plot rather than a box inside it: a box would
cover the newest data, which is what a live graph is read for.
"""

from __future__ import annotations

import math

import pyqtgraph as pg

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
        axis.setTextPen(pg.mkPen(theme.MUTED_TEXT))
    return plot


def legend_entry(color: str, label: str, glyph: str = "━") -> str:
    """Rich text for one legend entry: the series' mark in its colour, then its label."""
    return f"<span style='color:{color}'>{glyph}</span>&nbsp;{label}"
