"""Remote metrics: the attached server's own /metrics, polled once a second and graphed.

Three graphs over the last minutes: KV-cache usage (% of the server's pool), generated tokens per
second (all its requests, from its token counter), and mean TTFT and inter-token latency per poll
interval (from its histograms; llama.cpp's server has none, so its ITL is the time it reports
predicting over the tokens predicted). The header names the source and says which figures the
server does not export. These are the server's figures; the Latency panel keeps this client's
own TTFT and ITL of each reply.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Slot
from PySide6.QtWidgets import QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.remote.host import AttachableHost
from widgets import theme
from widgets.plot_style import styled_plot

WINDOW_S = 300.0  # the graphs show the last five minutes


def _fmt(value: float | None, unit: str, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value * scale:.{digits}f} {unit}"


class RemoteMetricsPanel(QWidget):
    def __init__(self, host: AttachableHost, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.host = host
        self.setObjectName("remoteMetricsPanel")
        self.setStyleSheet(
            f"#remoteMetricsPanel, #remoteMetricsPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.header = QLabel()
        self.header.setTextFormat(Qt.TextFormat.RichText)
        self.header.setWordWrap(True)
        self.readout = QLabel()
        self.readout.setTextFormat(Qt.TextFormat.RichText)
        self.readout.setWordWrap(True)
        self.kv_plot, self.kv_curve = self._plot("KV usage %", theme.SERIES["ttft"])
        self.tps_plot, self.tps_curve = self._plot("tokens/s", theme.SERIES["tokens_per_s"])
        self.lat_plot, self.itl_curve = self._plot("ITL ━ TTFT ▲ ms", theme.SERIES["itl"])
        self.ttft_curve = self.lat_plot.getPlotItem().plot(
            pen=None, symbol="t1", symbolSize=9, symbolBrush=pg.mkBrush(theme.SERIES["ttft"]), symbolPen=None
        )
        self.kv_plot.getPlotItem().setYRange(0, 100, padding=0)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addWidget(self.header)
        layout.addWidget(self.readout)
        plots = QHBoxLayout()  # side by side: the dock sits under the chat, wide and short
        for plot in (self.kv_plot, self.tps_plot, self.lat_plot):
            plots.addWidget(plot, 1)
        layout.addLayout(plots, 1)
        host.metrics_changed.connect(self.redraw)
        host.source_changed.connect(self.redraw)
        self.redraw()

    def _plot(self, label: str, colour: str):
        plot = styled_plot()
        item = plot.getPlotItem()
        item.setTitle(f"<span style='color:{theme.MUTED}'>{label}</span>", size="8pt")
        # points as well as lines: a server that updates its counters only when a request ends
        # (llama.cpp) gives isolated points between gaps
        curve = item.plot(
            pen=pg.mkPen(colour, width=1.5), connect="finite", symbol="o", symbolSize=4, symbolPen=None,
            symbolBrush=pg.mkBrush(colour),
        )  # fmt: skip
        return plot, curve

    @Slot()
    def redraw(self, *_args) -> None:
        host = self.host
        source = host.remote
        if source is None:
            self.header.setText(
                f"<span style='color:{theme.MUTED}'>Not attached: Remote ▸ Attach to server… connects to "
                "a vLLM, SGLang, llama.cpp or kvscope server and graphs its /metrics here.</span>"
            )
            self.readout.setText("")
            for curve in (self.kv_curve, self.tps_curve, self.itl_curve, self.ttft_curve):
                curve.setData([], [])
            return
        family = host.metrics_family or source.family
        prefix = f"{family}:" if family else "no known prefix"
        self.header.setText(
            f"<b>{source.server_name}</b> at {source.target.label} · source: its /metrics ({prefix} names), "
            f"polled every second, the last {WINDOW_S / 60:.0f} minutes (x: seconds ago). <span style='color:{theme.MUTED}'>The server's own figures; the "
            "Latency panel has this client's TTFT and ITL per reply.</span>"
        )
        points = list(host.metrics)
        if host.metrics_error:
            self.readout.setText(f"<span style='color:{theme.WHAT_IF}'>{host.metrics_error}</span>")
        elif points:
            last = points[-1]
            exported = host.metrics_sample.values if host.metrics_sample else {}
            missing = [
                name
                for name, key in (("KV usage", "kv_usage"), ("TTFT", "ttft_count"), ("ITL", "itl_count"))
                if key not in exported and not (key == "itl_count" and "generation_seconds" in exported)
            ]
            text = (
                f"KV {_fmt(last.kv_usage, '%', 100)} · {_fmt(last.tokens_per_s, 'tok/s')} · running "
                f"{_fmt(last.running, '', digits=0)} · waiting {_fmt(last.waiting, '', digits=0)}"
            )
            if last.prefix_hit_rate is not None:
                text += f" · prefix-cache hits {last.prefix_hit_rate * 100:.1f}% of queried tokens"
            if missing:
                text += f" <span style='color:{theme.MUTED}'>({', '.join(missing)}: not exported)</span>"
            self.readout.setText(text)
        else:
            self.readout.setText(f"<span style='color:{theme.MUTED}'>waiting for the second poll…</span>")
        if not points:
            return
        now = points[-1].t
        ago = np.array([p.t - now for p in points])
        keep = ago >= -WINDOW_S

        def series(name: str, scale: float = 1.0) -> np.ndarray:
            values = [getattr(p, name) for p in points]
            return np.array([math.nan if v is None else v * scale for v in values])[keep]

        x = ago[keep]
        self.kv_curve.setData(x, series("kv_usage", 100.0))
        self.tps_curve.setData(x, series("tokens_per_s"))
        self.itl_curve.setData(x, series("itl_s", 1000.0))
        ttft = series("ttft_s", 1000.0)
        finite = np.isfinite(ttft)
        self.ttft_curve.setData(x[finite], ttft[finite])
