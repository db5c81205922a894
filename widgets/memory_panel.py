"""Memory graph: weights, KV pool, KV in use, a speculative draft model's weights and cache, and
the process total over time.

Every series is named with where its number comes from (tensor sizes for weights, the KV pool
and the draft's, block count for KV in use, the engine's probe for the process: psutil RSS on
CPU, torch CUDA counters or NVML on a GPU). The draft's series appear only while the engine runs
one (a self-draft shares the target's weights: only its cache shows). The y axis uses one binary unit (MiB or GiB) chosen from the
largest value, so tick labels stay round. With quantized weights (`set_weights_scheme`) the
weights series names its scheme and a dashed line marks what the same weights take in full
precision, so the saving reads straight off the graph.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QVBoxLayout, QWidget

from engine.units import byte_unit, format_bytes
from live.state import LiveState
from widgets import theme
from widgets.live_label import LiveLabel
from widgets.plot_style import AUTO_DOWNSAMPLE_FACTOR, StableRange, legend_entry, nice_ceiling, styled_plot

# (ring column, legend label); "{source}" is the engine's probe name for the process figures.
SERIES = (
    ("weights", "weights (tensor sizes)"),
    ("kv_pool", "KV pool allocated"),
    ("kv_used", "KV in use (used blocks)"),
    ("draft_weights", "draft model weights (tensor sizes)"),
    ("draft_cache", "draft KV cache"),
    ("process", "process total ({source})"),
    ("reserved", "reserved ({source})"),
)
DASHED = ("reserved", "draft_cache")
# Shown only when they hold something: most engines run no draft model.
ONLY_WHEN_USED = ("draft_weights", "draft_cache")


class MemoryPanel(QWidget):
    def __init__(self, state: LiveState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.unit: tuple[str, int] = ("MiB", 1 << 20)
        self.setObjectName("memoryPanel")
        self.setStyleSheet(
            f"#memoryPanel, #memoryPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.legend = LiveLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        self.plot = styled_plot()
        item = self.plot.getPlotItem()
        item.setLabel("bottom", "time since start (s)")
        item.setLabel("left", self.unit[0])
        self.view_range = StableRange(item.getViewBox())
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.weights_scheme: str | None = None  # None: the weights are not quantized
        self.full_precision: tuple[int, str] | None = None  # (bytes, load dtype) when quantized
        self.full_precision_line = pg.InfiniteLine(
            angle=0, pen=pg.mkPen(theme.SERIES["weights"], width=1, style=Qt.PenStyle.DashLine)
        )
        self.full_precision_line.hide()
        item.addItem(self.full_precision_line, ignoreBounds=True)
        for key, _ in SERIES:
            dashed = key in DASHED
            pen = pg.mkPen(
                theme.SERIES[key], width=2, style=Qt.PenStyle.DashLine if dashed else Qt.PenStyle.SolidLine
            )
            self.curves[key] = item.plot(pen=pen, autoDownsampleFactor=AUTO_DOWNSAMPLE_FACTOR)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addWidget(self.legend)
        layout.addWidget(self.plot, 1)
        self._redraw()

    def refresh(self, dirty: set[str]) -> None:
        if "memory" in dirty:
            self._redraw()

    def set_weights_scheme(self, scheme: str | None, full_bytes: int | None = None, dtype: str = "") -> None:
        """The loaded model's weight quantization (None or 'none': full precision) and, when
        quantized, the bytes of its parameters in the load dtype `dtype`."""
        quantized = scheme not in (None, "none") and full_bytes is not None
        self.weights_scheme = scheme if quantized else None
        self.full_precision = (full_bytes, dtype) if quantized else None
        self._redraw()

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """The (x seconds, y in the axis unit) data given to a series (before view clipping)."""
        curve = self.curves[key]
        empty = np.empty(0)
        return (empty, empty) if curve.xData is None else (curve.xData, curve.yData)

    def _redraw(self) -> None:
        ring = self.state.memory
        if len(ring) == 0:
            self.legend.setText(
                f"<span style='color:{theme.MUTED}'>Memory: waiting for the engine's first sample</span>"
            )
            for curve in self.curves.values():
                curve.setData([], [])
            return
        origin = self.state.origin_t if self.state.origin_t is not None else ring.column("t")[0]
        x = ring.column("t") - origin
        columns = {key: ring.column(key) for key, _ in SERIES}
        # Reserved differs from the process figure only where the probe has both (CUDA).
        show_reserved = bool(np.any(columns["reserved"] != columns["process"]))
        largest = max(float(np.nanmax(columns[key])) for key, _ in SERIES)
        if self.full_precision is not None:
            largest = max(largest, float(self.full_precision[0]))
        unit = byte_unit(largest)
        if unit != self.unit:
            self.unit = unit
            self.plot.getPlotItem().setLabel("left", unit[0])
        used = {key for key in ONLY_WHEN_USED if bool(np.nanmax(columns[key]) > 0)}
        shown = tuple(
            key
            for key, _ in SERIES
            if (key != "reserved" or show_reserved) and (key not in ONLY_WHEN_USED or key in used)
        )
        for key, _ in SERIES:
            curve = self.curves[key]
            curve.setVisible(key in shown)
            if key in shown:
                curve.setData(x, columns[key] / unit[1])
            else:
                curve.setData([], [])
        if self.full_precision is not None:
            self.full_precision_line.setValue(self.full_precision[0] / unit[1])
            self.full_precision_line.show()
        else:
            self.full_precision_line.hide()
        # Headroom above the largest series so its line does not run along the frame.
        self.view_range.show((0.0, nice_ceiling(float(x[-1]))), (0.0, nice_ceiling(1.05 * largest / unit[1])))
        self.legend.setText(self._readout(columns, shown))

    def _readout(self, columns: dict[str, np.ndarray], shown: tuple[str, ...]) -> str:
        """The legend: each drawn series' mark and label (with its source) and latest value."""
        source = self.state.memory_source
        labels = dict(SERIES)
        entries = []
        if self.weights_scheme is not None:
            labels["weights"] = f"weights, {self.weights_scheme} (tensor sizes)"
        for key in shown:
            value = float(columns[key][-1])
            entries.append(
                legend_entry(
                    theme.SERIES[key], labels[key].format(source=source), "┅" if key in DASHED else "━"
                )
                + f" <b>{format_bytes(value)}</b>"
            )
            if key == "weights" and self.full_precision is not None:
                full, dtype = self.full_precision
                entries.append(
                    legend_entry(theme.SERIES["weights"], f"unquantized ({dtype})", "┅")
                    + f" <b>{format_bytes(full)}</b>"
                )
        total = float(self.state.memory.column("device_total")[-1])
        if total > 0:
            entries.append(f"<span style='color:{theme.MUTED}'>of {format_bytes(total)} total</span>")
        return " &nbsp; ".join(entries)
