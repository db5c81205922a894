"""Sweeps: TTFT against prompt length and ITL against context length, measured per dtype on the
user's machine, plotted, and explained in a sentence drawn from the numbers.

The sweep is `engine.bench.sweep.compare_dtypes`: the loaded model's source is loaded once per chosen
dtype (held together and measured interleaved, so drift hits them alike) in a separate engine of
its own. The panel only asks and draws: `run_requested` carries the settings, the shell runs the
sweep on a worker (progress and cancel; cancelling takes effect between two runs) and hands back
its progress and report. The app's own engine keeps its model; for clean figures, do not chat
meanwhile: both share the CPU (or GPU).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt, Signal, Slot
from PySide6.QtWidgets import (
    QBoxLayout,
    QCheckBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.config import DTYPES
from widgets import theme
from widgets.plot_style import LogValueAxis, legend_entry, styled_plot
from widgets.sweep_summary import explain_parts

DTYPE_COLOURS = {"float32": "#5b9bd5", "bfloat16": "#e8833a", "float16": "#5fd38d"}
# The CLI's defaults (engine/cli/physics.py): short enough for a minute or two on a laptop CPU
# with a small model, long enough that prefill scaling and the KV read both show.
DEFAULT_PROMPT_LENGTHS = "32,128,512"
DEFAULT_CONTEXT_LENGTHS = "128,512,1024"
DEFAULT_DTYPES = ("float32", "bfloat16")
PREFERRED_SIZE = (460, 680)
# Below this width two plots side by side get too narrow to read their axes.
SIDE_BY_SIDE_MIN_WIDTH = 640


def parse_lengths(text: str, what: str) -> list[int]:
    """'32, 128,512' -> [32, 128, 512]; ValueError with a reason for anything else."""
    parts = [p.strip() for p in text.replace(";", ",").split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{what}: whole numbers separated by commas, e.g. 32,128,512") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what}: at least one length, each 1 token or more")
    return sorted(set(values))


def progress_steps(dtypes: int, prompts: int, contexts: int, repeats: int) -> int:
    """Progress messages compare_dtypes sends: one per model load, one per timed run."""
    return dtypes + dtypes * repeats * (prompts + contexts)


@dataclass(frozen=True, slots=True)
class SweepSettings:
    """What the user asked to measure (checked: at least one dtype and length of each)."""

    dtypes: tuple[str, ...]  # the first is the baseline
    decode_tokens: int  # timed per context length
    repeats: int  # per length and dtype (the median is shown)
    prompt_lengths: tuple[int, ...]
    context_lengths: tuple[int, ...]

    @property
    def progress_steps(self) -> int:
        return progress_steps(
            len(self.dtypes), len(self.prompt_lengths), len(self.context_lengths), self.repeats
        )


class SweepPanel(QWidget):
    run_requested = Signal(object)  # SweepSettings
    cancel_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.source: str | None = None
        self.device = "auto"
        self.report: dict | None = None
        self.running = False
        self.setObjectName("sweepPanel")
        self.setStyleSheet(
            f"#sweepPanel {{ background: {theme.BACKGROUND}; }} #sweepPanel QLabel {{ color: {theme.TEXT}; }}"
        )

        self.model_label = QLabel()
        self.dtype_boxes = {}
        for dtype in DTYPES:
            box = QCheckBox(dtype)
            box.setChecked(dtype in DEFAULT_DTYPES)
            box.setToolTip(
                "The first checked dtype is the baseline the others are compared with. float16 "
                "needs a GPU: CPUs refuse it."
            )
            self.dtype_boxes[dtype] = box
        self.prompt_lengths = QLineEdit(DEFAULT_PROMPT_LENGTHS)
        self.prompt_lengths.setToolTip("Prompt lengths in tokens: each is prefilled and its TTFT timed")
        self.context_lengths = QLineEdit(DEFAULT_CONTEXT_LENGTHS)
        self.context_lengths.setToolTip(
            "Context lengths in tokens: decode steps after a prompt this long are timed"
        )
        self.decode_tokens = QSpinBox()
        self.decode_tokens.setRange(1, 256)
        self.decode_tokens.setValue(8)
        self.decode_tokens.setToolTip("Decode steps timed per context length (their median ITL is shown)")
        self.repeats = QSpinBox()
        self.repeats.setRange(1, 20)
        self.repeats.setValue(2)
        self.repeats.setToolTip("Runs per length and dtype; the median is shown")
        self.run_button = QPushButton("Run sweep")
        self.run_button.setToolTip(
            "Loads the model once per dtype beside the app's own copy, then times every length "
            "(a minute or two for a small model on a CPU). Do not chat meanwhile: it shares the device."
        )
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setTextVisible(True)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.explanation = QLabel()
        self.explanation.setObjectName("sweepExplanation")
        self.explanation.setWordWrap(True)
        self.explanation.setTextFormat(Qt.TextFormat.RichText)
        self.explanation.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.legend = QLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)

        self.ttft_plot = self._plot("prompt length (tokens)", "TTFT (ms)")
        self.itl_plot = self._plot("context length (tokens)", "median ITL (ms)")
        self.curves: dict[tuple[str, str], pg.PlotDataItem] = {}

        dtypes_row = QHBoxLayout()
        for box in self.dtype_boxes.values():
            dtypes_row.addWidget(box)
        dtypes_row.addStretch(1)
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow("dtypes", dtypes_row)
        form.addRow("prompt lengths", self.prompt_lengths)
        form.addRow("context lengths", self.context_lengths)
        numbers = QHBoxLayout()
        numbers.addWidget(QLabel("decode steps"))
        numbers.addWidget(self.decode_tokens)
        numbers.addWidget(QLabel("repeats"))
        numbers.addWidget(self.repeats)
        numbers.addStretch(1)
        form.addRow(numbers)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.progress, 1)
        settings = QVBoxLayout()
        settings.addWidget(self.model_label)
        settings.addLayout(form)
        settings.addLayout(buttons)
        settings.addWidget(self.status)
        plots = self._plots = QBoxLayout(QBoxLayout.Direction.LeftToRight)
        plots.addWidget(self.ttft_plot, 1)
        plots.addWidget(self.itl_plot, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(4)
        layout.addLayout(settings)
        layout.addWidget(self.explanation)
        layout.addWidget(self.legend)
        layout.addLayout(plots, 1)

        self.run_button.clicked.connect(self.run)
        self.cancel_button.clicked.connect(self.cancel)
        self._update_controls()

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt override
        # What a side dock can give; wider, the plots go side by side (resizeEvent).
        return QSize(*PREFERRED_SIZE)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        # Side by side when there is room, stacked in a narrow dock (the right-hand column).
        wide = event.size().width() >= SIDE_BY_SIDE_MIN_WIDTH
        self._plots.setDirection(
            QBoxLayout.Direction.LeftToRight if wide else QBoxLayout.Direction.TopToBottom
        )
        super().resizeEvent(event)

    def _plot(self, x_label: str, y_label: str) -> pg.PlotWidget:
        plot = styled_plot({"bottom": LogValueAxis("bottom")})
        item = plot.getPlotItem()
        item.setLogMode(x=True, y=False)  # lengths span decades; times start from zero
        item.setLabel("bottom", x_label)
        item.setLabel("left", y_label)
        return plot

    # ---- model -----------------------------------------------------------------------------
    def set_model(self, source: str | None, device: str = "auto", name: str = "") -> None:
        """The model a sweep loads: the app's loaded model's source and device."""
        self.source, self.device = source, device
        shown = name or source
        self.model_label.setText(
            f"Model: {shown} on {device}"
            if source
            else "Load a model first: the sweep measures the loaded model."
        )
        self._update_controls()

    # ---- running ---------------------------------------------------------------------------
    def chosen_dtypes(self) -> list[str]:
        return [dtype for dtype, box in self.dtype_boxes.items() if box.isChecked()]

    def settings(self) -> SweepSettings:
        """The settings typed in; ValueError with the reason for anything unusable."""
        dtypes = self.chosen_dtypes()
        if not dtypes:
            raise ValueError("choose at least one dtype")
        return SweepSettings(
            tuple(dtypes),
            self.decode_tokens.value(),
            self.repeats.value(),
            tuple(parse_lengths(self.prompt_lengths.text(), "prompt lengths")),
            tuple(parse_lengths(self.context_lengths.text(), "context lengths")),
        )

    @Slot()
    def run(self) -> None:
        if self.running or self.source is None:
            return
        try:
            settings = self.settings()
        except ValueError as exc:
            self._set_status(str(exc), error=True)
            return
        self.running = True
        self.progress.setRange(0, settings.progress_steps)
        self.progress.setValue(0)
        self._set_status(f"Starting: {', '.join(settings.dtypes)}…")
        self._update_controls()
        self.run_requested.emit(settings)

    @Slot()
    def cancel(self) -> None:
        if self.running:
            self._set_status("Cancelling after the current run…")
            self.cancel_button.setEnabled(False)
            self.cancel_requested.emit()

    # ---- what the shell reports ------------------------------------------------------------
    def show_progress(self, message: str) -> None:
        self.progress.setValue(min(self.progress.value() + 1, self.progress.maximum()))
        self._set_status(message)

    def show_report(self, report: dict, note: str = "") -> None:
        """A finished sweep, with a note on how trustworthy it is (a busy machine), if any."""
        self.running = False
        self.progress.setValue(self.progress.maximum())
        self._set_status(
            f"Measured {report['model']} on {report['device']}. {note}".strip(), error=bool(note)
        )
        self.set_report(report)
        self._update_controls()

    def show_failed(self, message: str) -> None:
        self.running = False
        self._set_status(f"The sweep failed: {message}", error=True)
        self._update_controls()

    def show_cancelled(self) -> None:
        self.running = False
        self._set_status("Sweep cancelled.")
        self._update_controls()

    def _update_controls(self) -> None:
        self.run_button.setEnabled(self.source is not None and not self.running)
        self.cancel_button.setEnabled(self.running)

    def _set_status(self, text: str, error: bool = False) -> None:
        colour = theme.WHAT_IF if error else theme.MUTED
        self.status.setText(f"<span style='color:{colour}'>{text}</span>")

    # ---- results ---------------------------------------------------------------------------
    def set_report(self, report: dict) -> None:
        """Plot a compare_dtypes report and explain it."""
        self.report = report
        for item in (self.ttft_plot.getPlotItem(), self.itl_plot.getPlotItem()):
            item.clear()
        self.curves.clear()
        dtypes = list(dict.fromkeys(row["dtype"] for row in report["prompt_lengths"]))
        entries = []
        for dtype in dtypes:
            colour = DTYPE_COLOURS.get(dtype, theme.TEXT)
            self._curve("ttft", dtype, colour, report["prompt_lengths"], "prompt_tokens", "ttft_s")
            self._curve("itl", dtype, colour, report["context_lengths"], "context_tokens", "median_itl_s")
            entries.append(
                legend_entry(colour, dtype + (" (baseline)" if dtype == report["baseline_dtype"] else ""))
            )
        self.legend.setText(" &nbsp; ".join(entries) + f" &nbsp; <span style='color:{theme.MUTED}'>"
                            f"{report['model']} on {report['device']}</span>")  # fmt: skip
        comparisons, scaling = explain_parts(report)
        self.explanation.setText("<br>".join([f"<b>{html.escape(c)}</b>" for c in comparisons] + [
            html.escape(s) for s in scaling
        ]))  # fmt: skip

    def _curve(self, which: str, dtype: str, colour: str, rows: list[dict], x_key: str, y_key: str) -> None:
        plot = self.ttft_plot if which == "ttft" else self.itl_plot
        mine = sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: r[x_key])
        x = [r[x_key] for r in mine]
        y = [r[y_key] * 1000.0 for r in mine]
        self.curves[(which, dtype)] = plot.getPlotItem().plot(
            x, y, pen=pg.mkPen(colour, width=2), symbol="o", symbolSize=7,
            symbolBrush=pg.mkBrush(colour), symbolPen=pg.mkPen(None),
        )  # fmt: skip

    def curve(self, which: str, dtype: str):
        """(x, y in ms) of a plotted series, as given (before log-x display)."""
        data = self.curves[(which, dtype)]
        return list(data.xData), list(data.yData)
