"""Quality panel: what the running quantization costs against full precision, and its speed.

A run (started here, computed by app/quality/runner.py off the GUI thread) compares the running
model with its unquantized reference on the current conversation or the shipped evaluation text:
mean and max KL, top-1 agreement and both perplexities as figures, and the per-token KL plotted
along the text (top-1 disagreements marked, the reply shaded). Hovering the plot names the token.
Speed: decode and prefill tokens/s of both, measured by the same run through the engine, and
the running engine's last reply; a scheme slower than full precision says so in colour.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import QComboBox, QGridLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from live.state import LiveState
from widgets import theme
from widgets.plot_style import AUTO_DOWNSAMPLE_FACTOR, legend_entry, styled_plot
from widgets.token_text import visible

KL_COLOUR = "#5b9bd5"
DISAGREE_COLOUR = "#ef6b73"
REPLY_SHADE = (240, 180, 41, 28)
SLOWER_COLOUR = "#e8833a"
FASTER_COLOUR = "#5fd38d"
NO_PEN = pg.mkPen(None)  # made once: pyqtgraph caches a symbol per pen object
DISAGREE_BRUSH = pg.mkBrush(DISAGREE_COLOUR)
TABLE_ROWS = ("", "perplexity", "decode", "prefill", "last reply")


def speed_ratio_text(quantized: float, reference: float) -> str:
    """'0.44×, slower' (than full precision) in colour, or faster, or the same within 5%."""
    if not (reference > 0 and quantized > 0) or math.isnan(quantized) or math.isnan(reference):
        return ""
    ratio = quantized / reference
    if ratio < 0.95:
        return f"<span style='color:{SLOWER_COLOUR}'><b>{ratio:.2f}×, slower</b></span>"
    if ratio > 1.05:
        return f"<span style='color:{FASTER_COLOUR}'>{ratio:.2f}×, faster</span>"
    return f"{ratio:.2f}×, about as fast"


class QualityPanel(QWidget):
    run_requested = Signal(str)  # the source key of the chosen text

    def __init__(
        self, state: LiveState, sources: tuple[tuple[str, str], ...], parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.state = state
        self.result = None  # the QualityResult shown
        self.source_labels = dict(sources)
        self.engine_label = ""
        self.setObjectName("qualityPanel")
        self.setStyleSheet(
            f"#qualityPanel, #qualityPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.source = QComboBox()
        for key, label in sources:
            self.source.addItem(label, key)
        self.source.setToolTip("Which text both models read, token by token")
        self.run_button = QPushButton("Compare with full precision")
        self.run_button.setToolTip(
            "Load the running model again and unquantized (one after the other, off the GUI thread), "
            "read the text with both and compare their next-token distributions; time a short reply of each"
        )
        self.run_button.clicked.connect(self._on_run_clicked)
        self.status = QLabel()
        self.status.setStyleSheet(f"color: {theme.MUTED};")
        self.status.setWordWrap(True)
        self.status.hide()  # shown while a run goes and for its errors
        # The figures as a small table (scheme | full precision), one short line per cell, so a
        # short dock still shows them all; the KL line spans the table.
        self.table = QGridLayout()
        self.table.setHorizontalSpacing(14)
        self.table.setVerticalSpacing(1)
        self.cells: dict[tuple[str, int], QLabel] = {}
        for row, name in enumerate(TABLE_ROWS):
            head = QLabel(name)
            head.setStyleSheet(f"color: {theme.MUTED};")
            self.table.addWidget(head, row, 0)
            for column in (1, 2):
                cell = QLabel()
                cell.setTextFormat(Qt.TextFormat.RichText)
                self.cells[(name, column)] = cell
                self.table.addWidget(cell, row, column)
        self.table.setColumnStretch(3, 1)
        self.figures = QLabel()  # the KL and top-1 line, or what the panel is for before a run
        self.figures.setTextFormat(Qt.TextFormat.RichText)
        self.figures.setWordWrap(True)
        self.figures.setToolTip(
            "Both models read the same tokens (teacher forcing); KL(full precision || this scheme) at each "
            "position. Speeds: one greedy reply of each through the engine, back to back in the same run; "
            "'last reply' is the running engine's own."
        )
        self.hover = QLabel()
        self.hover.setStyleSheet(f"color: {theme.MUTED};")
        self.plot = styled_plot()
        item = self.plot.getPlotItem()
        item.setLabel("bottom", "token position in the text")  # KL's unit is in the figures' legend
        self.plot.setMinimumHeight(100)
        self.reply_region = pg.LinearRegionItem(movable=False, brush=pg.mkBrush(*REPLY_SHADE), pen=NO_PEN)
        self.reply_region.hide()
        item.addItem(self.reply_region, ignoreBounds=True)
        self.kl_curve = item.plot(
            pen=pg.mkPen(KL_COLOUR, width=1.2), autoDownsampleFactor=AUTO_DOWNSAMPLE_FACTOR
        )
        self.disagree_points = item.plot(
            pen=None,
            symbol="x",
            symbolSize=7,
            symbolPen=pg.mkPen(DISAGREE_COLOUR),
            symbolBrush=DISAGREE_BRUSH,
        )
        self.mean_line = pg.InfiniteLine(angle=0, pen=pg.mkPen(theme.MUTED, style=Qt.PenStyle.DashLine))
        self.mean_line.hide()
        item.addItem(self.mean_line, ignoreBounds=True)
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)

        controls = QHBoxLayout()
        controls.addWidget(QLabel("Text"))
        controls.addWidget(self.source)
        controls.addWidget(self.run_button)
        controls.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        layout.addLayout(controls)
        layout.addWidget(self.status)
        layout.addLayout(self.table)
        layout.addWidget(self.figures)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.hover)
        self._show_empty()
        self._refresh_live()

    # ---- what the window tells it ------------------------------------------------------------
    def set_engine_label(self, text: str) -> None:
        """What the running engine is (scheme, KV dtype), for the live speed line."""
        self.engine_label = text
        self._refresh_live()

    def set_running(self, text: str) -> None:
        self.run_button.setEnabled(False)
        self.status.setStyleSheet(f"color: {theme.MUTED};")
        self.status.setText(f"Running: {text}…")
        self.status.show()

    def show_error(self, message: str) -> None:
        self.run_button.setEnabled(True)
        self.status.setStyleSheet(f"color: {DISAGREE_COLOUR};")
        self.status.setText(message)
        self.status.show()

    def show_result(self, result) -> None:
        """Draw a QualityResult (app/quality/compute.py)."""
        self.result = result
        self.run_button.setEnabled(True)
        self.status.setText("")
        self.status.hide()  # the figures take its room; the hover line says how long it took
        report = result.report
        x, kl = self.kl_series()
        self.kl_curve.setData(x, kl)
        disagree = ~np.array(report.top1_agree, dtype=bool)
        self.disagree_points.setData(x[disagree], kl[disagree])
        self.mean_line.setValue(report.mean_kl)
        self.mean_line.show()
        if result.reply_start is not None:
            self.reply_region.setRegion((max(0, result.reply_start) - 0.5, len(result.token_ids) - 0.5))
            self.reply_region.show()
        else:
            self.reply_region.hide()
        self._fill_table(result)
        self.figures.setText(self._kl_text(result))
        self.hover.setText(f"Measured in {result.seconds:.0f} s. Hover the plot to read each token.")

    def kl_series(self) -> tuple[np.ndarray, np.ndarray]:
        """(token position, KL there): position p is the prediction of token p from tokens < p."""
        if self.result is None:
            return np.empty(0), np.empty(0)
        kl = np.asarray(self.result.report.kl, dtype=float)
        return np.arange(1, kl.size + 1, dtype=float), kl

    # ---- the panel protocol ------------------------------------------------------------------
    def refresh(self, dirty: set[str]) -> None:
        if "requests" in dirty or "model" in dirty:
            self._refresh_live()

    def flush(self) -> None:
        self._refresh_live()

    # ---- text --------------------------------------------------------------------------------
    def _show_empty(self) -> None:
        self.figures.setText(
            f"<span style='color:{theme.MUTED}'>Compare the running scheme with full precision: "
            "per-token KL divergence, top-1 agreement and perplexity of both, with the speed of each "
            "measured through the engine.</span>"
        )

    def figures_text(self) -> str:
        """Every figure shown, row by row (the table, then the KL line)."""
        rows = []
        for name in TABLE_ROWS:
            cells = [self.cells[(name, c)].text() for c in (1, 2)]
            if any(cells):
                rows.append(" | ".join([name, *cells]))
        return "\n".join([*rows, self.figures.text()])

    def _set_row(self, name: str, scheme: str, reference: str) -> None:
        self.cells[(name, 1)].setText(scheme)
        self.cells[(name, 2)].setText(reference)

    def _fill_table(self, result) -> None:
        report, job = result.report, result.job
        kv = "" if job.kv_dtype == "auto" else f" + KV {job.kv_dtype}"
        self._set_row("", f"<b>{result.scheme}{kv}</b>", f"<b>{result.reference_label}</b>")
        self._set_row(
            "perplexity", f"<b>{report.quantized_perplexity:.2f}</b>", f"{report.reference_perplexity:.2f}"
        )
        q, r = result.quantized_speed, result.reference_speed
        if q is None or r is None:
            self._set_row("decode", "", "")
            self._set_row("prefill", "", "")
            return
        self._set_row(
            "decode",
            f"<b>{q.decode_tok_s:.1f}</b> tok/s {speed_ratio_text(q.decode_tok_s, r.decode_tok_s)}",
            f"{r.decode_tok_s:.1f} tok/s",
        )
        self._set_row(
            "prefill",
            f"{q.prefill_tok_s:.0f} tok/s {speed_ratio_text(q.prefill_tok_s, r.prefill_tok_s)}",
            f"{r.prefill_tok_s:.0f} tok/s",
        )

    def _kl_text(self, result) -> str:
        report, job = result.report, result.job
        where = self.source_labels.get(job.source, job.source).lower()
        cut = f", its last {len(result.token_ids):,}" if result.truncated else ""
        return (
            legend_entry(KL_COLOUR, f"KL mean <b>{report.mean_kl:.4g}</b> · max {report.max_kl:.3g} nats")
            + " &nbsp; "
            + legend_entry(DISAGREE_COLOUR, f"top-1 agreement <b>{report.top1_agreement:.1%}</b>", "✕")
            + f" <span style='color:{theme.MUTED}'>over {report.num_tokens:,} tokens of the {where}{cut}</span>"
        )

    def _refresh_live(self) -> None:
        """The running engine's last finished reply: its decode speed, as the chat measured it."""
        # Only this engine's replies: request views of an earlier engine (another scheme) stay in
        # the state, and both carry engine times from the same clock.
        since = self.state.loaded.t if self.state.loaded is not None else -math.inf
        finished = [v.finished for v in self.state.requests.values() if v.finished is not None]
        finished = [f for f in finished if f.t >= since and f.stats.generated_tokens > 1]
        if not finished:
            self._set_row("last reply", "", "")
            return
        stats = finished[-1].stats
        self._set_row(
            "last reply",
            f"{stats.tokens_per_s:.1f} tok/s, {stats.generated_tokens} tokens",
            f"<span style='color:{theme.MUTED}'>{self.engine_label or 'the running engine'}, in the chat</span>",
        )

    # ---- slots -------------------------------------------------------------------------------
    @Slot()
    def _on_run_clicked(self) -> None:
        self.run_requested.emit(self.source.currentData())

    @Slot(object)
    def _on_mouse_moved(self, pos) -> None:
        if self.result is None or not self.plot.sceneBoundingRect().contains(pos):
            return
        x = self.plot.getPlotItem().vb.mapSceneToView(pos).x()
        self.hover.setText(self.describe_position(round(x)))

    def describe_position(self, position: int) -> str:
        """The hover line for token `position` of the text (1 .. n-1 have a prediction)."""
        report, texts = self.result.report, self.result.token_texts
        if not 1 <= position <= report.num_tokens:
            return ""
        i = position - 1
        agree = "top-1 agrees" if report.top1_agree[i] else "top-1 differs"
        reply = ""
        start = self.result.reply_start
        if start is not None and position >= start:
            reply = f" · reply token {position - start}"
        return (
            f"token {position} {visible(texts[position])!r}: KL {report.kl[i]:.4g} nats · {agree} · "
            f"−log p {report.quantized_nll[i]:.2f} (full precision {report.reference_nll[i]:.2f}){reply}"
        )
