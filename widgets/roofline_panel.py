"""Roofline panel: every engine step placed against this device's measured limits, live.

Log-log: x is a step's arithmetic intensity (FLOPs per byte moved), y the FLOP/s it achieved.
The roof is measured, never assumed: the bandwidth slope (intensity x bytes/s) rises until it
meets the matmul peak at the ridge. Steps left of the ridge cannot reach the peak whatever the
kernels do (memory-bound: a decode reads every weight for a token or two); steps right of it
could (compute-bound: a prefill reuses each weight for many tokens). Batching decodes and
longer prefill chunks move points to the right.

The panel only draws. Its points are the live state's (live.roofline: each step's FLOPs and
bytes as the engine counted them, over its target forward time); the limits are measured by the
shell on request (`measure_requested`) and handed over with `set_limits` as a `Roof`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from engine.units import duration, si
from live.roofline import PHASES, RooflinePoint, phase_utilisation
from live.state import LiveState
from widgets import theme
from widgets.plot_style import styled_plot
from widgets.si_axis import SILogAxis

# MFU/MBU are over this many of the latest steps of a phase: enough to smooth one slow step
# (a page fault, a GC pause), few enough to follow a change of batch size within a reply.
UTILISATION_STEPS = 32
PHASE_COLOURS = {"prefill": "#e8833a", "decode": "#5b9bd5", "mixed": "#9b7ede"}
PHASE_MEANING = {
    "prefill": "steps that only prefill prompt tokens",
    "decode": "steps that only decode (one new token per sequence)",
    "mixed": "steps with prefill chunks and decodes in one forward (continuous batching)",
}
ROOF_COLOUR = theme.TEXT
NO_PEN = pg.mkPen(None)
# Made once: pyqtgraph caches a rendered symbol per brush object (see latency_panel).
BRUSHES = {phase: pg.mkBrush(colour) for phase, colour in PHASE_COLOURS.items()}
HOW_COUNTED = (
    "Counted by the engine from what each step ran. FLOPs: the matmuls of every token through "
    "q/k/v/o and the MLP of every layer, attention scores and value sums over each query's keys, "
    "and the LM head for the rows it computed.\n"
    "Bytes: every weight once per step in its stored format, the gathered embedding rows, the "
    "K/V read (whole context) and written (new tokens).\n"
    "Time: the target model's forward of those steps (drafting excluded)."
)


@dataclass(frozen=True, slots=True)
class Roof:
    """The measured limits the panel draws: the matmul peak and the memory bandwidth of a device
    in a dtype, with what they were measured on (`device`, e.g. "AMD EPYC (2 threads) float32")
    and how (`how`, the measurement in words, for the tooltip). The shell writes both."""

    peak_flops: float
    bandwidth: float
    device: str
    how: str

    @property
    def ridge(self) -> float:
        """FLOP per byte at which the compute roof meets the bandwidth slope."""
        return self.peak_flops / self.bandwidth


class RooflinePanel(QWidget):
    measure_requested = Signal()  # the user asked to measure (again) the loaded model's device

    def __init__(self, state: LiveState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.limits: Roof | None = None
        self.measuring = False
        self.limits_error = ""
        self._drawn = -1  # the live points' count when last drawn

        self.setObjectName("rooflinePanel")
        self.setStyleSheet(
            f"#rooflinePanel, #rooflinePanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.device_label = QLabel()
        self.device_label.setWordWrap(True)
        self.device_label.setTextFormat(Qt.TextFormat.RichText)
        self.measure_button = QPushButton("Measure limits")
        self.measure_button.setToolTip(
            "Time the largest matmuls this device runs fast in the model's dtype and a large memory "
            "copy (about ten seconds) on the engine's thread: a reply waits meanwhile, so nothing "
            "else runs on the device. The result is cached per device and dtype."
        )
        self.measure_button.clicked.connect(self.measure_requested)
        # One label per phase: its colour mark (the legend), its MFU and MBU, and in the tooltip
        # how they were computed and its latest step.
        self.utilisation = {phase: QLabel() for phase in PHASES}
        for label in self.utilisation.values():
            label.setTextFormat(Qt.TextFormat.RichText)

        self.plot = styled_plot({"bottom": SILogAxis("bottom"), "left": SILogAxis("left")})
        item = self.plot.getPlotItem()
        item.setLogMode(x=True, y=True)  # the axes read log10 view coordinates; data is given as log10
        item.setClipToView(False)
        item.setLabel("bottom", "arithmetic intensity (FLOP / byte moved)")
        item.setLabel("left", "achieved FLOP/s")
        self.roof = pg.PlotCurveItem(pen=pg.mkPen(ROOF_COLOUR, width=2))
        item.addItem(self.roof)
        self.ridge_line = pg.InfiniteLine(
            angle=90,
            movable=False,
            pen=pg.mkPen(theme.MUTED, width=1, style=Qt.PenStyle.DashLine),
            label="ridge",
            labelOpts={"position": 0.08, "color": theme.MUTED, "anchors": [(0, 1), (0, 1)]},
        )
        item.addItem(self.ridge_line, ignoreBounds=True)
        self.memory_text = pg.TextItem("← memory-bound", color=theme.MUTED, anchor=(1, 1))
        self.compute_text = pg.TextItem("compute-bound →", color=theme.MUTED, anchor=(0, 1))
        for text in (self.memory_text, self.compute_text):
            item.addItem(text, ignoreBounds=True)
        self.scatter: dict[str, pg.ScatterPlotItem] = {}
        for phase in PHASES:
            scatter = pg.ScatterPlotItem(
                size=7, pen=NO_PEN, brush=BRUSHES[phase], hoverable=True, tip=self._point_tip
            )
            item.addItem(scatter)
            self.scatter[phase] = scatter
        top = QHBoxLayout()
        top.addWidget(self.device_label, 1)
        top.addWidget(self.measure_button, 0, Qt.AlignmentFlag.AlignTop)
        figures = QHBoxLayout()
        figures.setSpacing(16)
        for phase in PHASES:
            figures.addWidget(self.utilisation[phase])
        figures.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addLayout(top)
        layout.addLayout(figures)
        layout.addWidget(self.plot, 1)
        self._redraw()

    # ---- inputs ----------------------------------------------------------------------------
    def set_limits(self, limits: Roof | None) -> None:
        """The measured limits of the loaded model's device and dtype (None: not measured)."""
        self.limits, self.limits_error = limits, ""
        self._redraw()

    def set_measuring(self, measuring: bool) -> None:
        self.measuring = measuring
        if measuring:
            self.limits_error = ""
        self._redraw()

    def set_limits_error(self, message: str) -> None:
        self.measuring, self.limits_error = False, message
        self._redraw()

    def refresh(self, dirty: set[str]) -> None:
        unplaced = "steps" in dirty and not self.state.roofline.points  # says why nothing shows
        if dirty & {"roofline", "model"} or unplaced or self.state.roofline.added != self._drawn:
            self._redraw()

    @property
    def points(self) -> list[RooflinePoint]:
        return list(self.state.roofline.points)

    def phase_points(self, phase: str) -> list[RooflinePoint]:
        return self.state.roofline.of_phase(phase)

    def plotted(self, phase: str) -> tuple[np.ndarray, np.ndarray]:
        """The (intensity, FLOP/s) the scatter of `phase` shows, in data units (not log10)."""
        x, y = self.scatter[phase].getData()
        return 10.0 ** np.asarray(x, dtype=float), 10.0 ** np.asarray(y, dtype=float)

    # ---- drawing ---------------------------------------------------------------------------
    def _redraw(self) -> None:
        self._drawn = self.state.roofline.added
        self.device_label.setText(self._device_text())
        self.device_label.setToolTip(self._device_tip())
        loaded = self.state.loaded
        self.measure_button.setEnabled(loaded is not None and not self.measuring)
        self.measure_button.setText("Re-measure limits" if self.limits else "Measure limits")
        for phase in PHASES:
            chosen = self.phase_points(phase)
            self.scatter[phase].setData(
                x=[math.log10(p.intensity) for p in chosen],
                y=[math.log10(p.flops_per_s) for p in chosen],
                data=chosen,
            )
        self._draw_roof()
        self._draw_utilisation()

    def _device_text(self) -> str:
        muted = f"<span style='color:{theme.MUTED}'>"
        loaded = self.state.loaded
        if loaded is None:
            return f"{muted}Roofline: load a model; its steps are placed against this device's measured limits.</span>"
        info = loaded.info
        lines = []
        limits = self.limits
        if limits is not None:
            lines.append(
                f"<b>{limits.device}</b>: peak <b>{si(limits.peak_flops, 'FLOP/s')}</b> · "
                f"bandwidth <b>{si(limits.bandwidth, 'B/s')}</b> · ridge <b>{limits.ridge:.2f} FLOP/B</b>"
            )
        elif self.measuring:
            lines.append(
                f"Measuring {info.device} in {info.dtype}: matmul peak and memory bandwidth "
                "(replies wait until it is done)…"
            )
        else:
            lines.append(
                f"{muted}Device limits for {info.device} in {info.dtype} not measured yet: press "
                "<i>Measure limits</i> to draw the roof and compute MFU and MBU.</span>"
            )
        if self.limits_error:
            lines.append(f"<span style='color:{theme.WHAT_IF}'>Measuring failed: {self.limits_error}</span>")
        if self.state.steps and not self.state.roofline.points:
            lines.append(
                f"{muted}This engine's steps carry no FLOP and byte counts: they cannot be placed.</span>"
            )
        return "<br>".join(lines)

    def _device_tip(self) -> str:
        limits = self.limits
        if limits is None:
            return ""
        return (
            f"{limits.how}\n"
            f"ridge = peak / bandwidth = {limits.ridge:.2f} FLOP per byte: a step that does fewer FLOPs "
            "per byte it moves waits on memory (memory-bound); one that does more waits on arithmetic "
            "(compute-bound)."
        )

    def _draw_roof(self) -> None:
        limits = self.limits
        visible = limits is not None
        for item in (self.roof, self.ridge_line, self.memory_text, self.compute_text):
            item.setVisible(visible)
        if limits is None:
            self.roof.setData([], [])
            return
        ridge = limits.ridge
        xs = [p.intensity for p in self.points] + [ridge]
        lo, hi = min(xs) / 4, max(xs) * 4
        lo, hi = min(lo, ridge / 10), max(hi, ridge * 10)
        x = np.log10([lo, ridge, hi])
        y = np.log10([lo * limits.bandwidth, limits.peak_flops, limits.peak_flops])
        self.roof.setData(x, y)
        self.ridge_line.setPos(math.log10(ridge))
        self.ridge_line.label.setFormat(f"ridge {ridge:.2f} FLOP/B")
        top = math.log10(limits.peak_flops)
        self.memory_text.setPos(math.log10(ridge) - 0.05, top)
        self.compute_text.setPos(math.log10(ridge) + 0.05, top)

    def _draw_utilisation(self) -> None:
        muted = f"<span style='color:{theme.MUTED}'>"
        for phase, label in self.utilisation.items():
            head = f"<span style='color:{PHASE_COLOURS[phase]}'>●</span>&nbsp;{phase}"
            chosen = self.phase_points(phase)
            if not chosen:
                label.setText(f"{head} {muted}–</span>")
                label.setToolTip(f"{PHASE_MEANING[phase].capitalize()}: none yet.")
                continue
            latest = f"Latest step: {self._point_tip(0.0, 0.0, chosen[-1])}"
            if self.limits is None:
                recent = chosen[-UTILISATION_STEPS:]
                rate = sum(p.flops for p in recent) / sum(p.forward_s for p in recent)
                label.setText(f"{head} <b>{si(rate, 'FLOP/s')}</b>")
                label.setToolTip(
                    f"{PHASE_MEANING[phase].capitalize()}. Measure the device limits for MFU and MBU.\n\n{latest}"
                )
                continue
            util = phase_utilisation(
                chosen, phase, self.limits.peak_flops, self.limits.bandwidth, UTILISATION_STEPS
            )
            assert util is not None  # `chosen` is not empty
            label.setText(f"{head} MFU <b>{util.mfu.value:.1%}</b> · MBU <b>{util.mbu.value:.1%}</b>")
            label.setToolTip(
                f"{PHASE_MEANING[phase].capitalize()}, the last {util.steps}:\n"
                f"{util.mfu.how}\n{util.mbu.how}\n\n{HOW_COUNTED}\n\n{latest}"
            )

    def _point_tip(self, x: float, y: float, data: RooflinePoint) -> str:
        lines = [
            data.describe(),
            f"{data.intensity:.2f} FLOP/B: {si(data.flops, 'FLOP')} over {si(data.bytes, 'B')}",
            f"{si(data.flops_per_s, 'FLOP/s')} in {duration(data.forward_s)} (target forward)",
        ]
        terms = [f"{name} {si(value, '')}".strip() for name, value in data.breakdown.items()]
        if terms:
            lines.append("engine's count: " + ", ".join(terms))
        if self.limits is not None:
            lines.append(
                f"MFU {data.flops_per_s / self.limits.peak_flops:.1%} · MBU {data.bytes_per_s / self.limits.bandwidth:.1%}"
            )
        return "\n".join(lines)
