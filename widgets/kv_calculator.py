"""KV memory calculator: what the KV cache of a config costs per token, per sequence and per batch,
how much fits beside the weights, and a chart of KV bytes against context for several batches.

Fields start from the loaded model (and follow it until the user edits them); "Loaded model"
brings them back, "From model" reads any source's config, and every field can be typed to
explore any config. The widget only draws and asks: the shell reads configs and memory
(`inspect_requested`, `loaded_requested`) and hands the figures back (`show_loaded`,
`show_inspected`, `show_error`).
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt, Signal, Slot
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.units import GIB, byte_unit, format_bytes
from live.state import LiveState
from widgets import theme
from widgets.kv_memory import KV_DTYPES, KVConfig, chart_batches
from widgets.plot_style import legend_entry, styled_plot

BATCH_COLOURS = ("#5b9bd5", "#5fd38d", "#f0b429", "#e8833a", "#9b7ede")
CHART_POINTS = 64
CHART_HEADROOM = 1.3
# Two field columns keep the calculator narrow enough for a side dock beside the chat.
GRID_COLUMNS = 2
PREFERRED_SIZE = (440, 640)


class KVCalculator(QWidget):
    inspect_requested = Signal(str, str)  # source, the KV dtype chosen: read that model's config
    loaded_requested = Signal()  # fill in the loaded model and the memory available now

    def __init__(self, state: LiveState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.config: KVConfig | None = None
        self.error = ""
        self.follows_loaded = True  # until the user edits a field, the loaded model fills them
        self._filling = False
        self.setObjectName("kvCalculator")
        self.setStyleSheet(
            f"#kvCalculator QLabel {{ color: {theme.TEXT}; }} #kvCalculator {{ background: {theme.BACKGROUND}; }}"
        )

        self.layers = _int_field(1, 10_000, "Decoder layers: each stores its own K and V")
        self.kv_heads = _int_field(1, 4096, "KV heads: fewer than query heads is GQA, one is MQA")
        self.query_heads = _int_field(0, 4096, "Query heads (0 = unknown): shows what GQA/MQA saves")
        self.query_heads.setSpecialValueText("unknown")
        self.head_dim = _int_field(1, 65_536, "Dimension of one head's key (and value) vector")
        self.dtype = QComboBox()
        self.dtype.addItems(KV_DTYPES)
        self.dtype.setToolTip(
            "What the cached keys and values are stored in: the model's dtype, or int8 codes with a "
            "float16 scale per head (the engine's KV dtype int8)"
        )
        self.context = _int_field(1, 10_000_000, "Tokens per sequence: prompt plus reply")
        self.context.setGroupSeparatorShown(True)
        self.batch = _int_field(1, 1_000_000, "Sequences held at once")
        self.weights = _gib_field("Memory the weights take (the KV cache gets what is left)")
        self.budget = _gib_field("Device memory to share between the weights and the KV cache")
        self.source = QLineEdit()
        self.source.setPlaceholderText("default, a folder, a .gguf file or a cached repo id")
        self.source.setText("default")
        self.from_model = QPushButton("From model")
        self.from_model.setToolTip(
            "Read the config of this source (metadata only, nothing is loaded): shapes, the weights "
            "in the chosen dtype, and the memory available now as the budget"
        )
        self.from_loaded = QPushButton("Loaded model")
        self.from_loaded.setToolTip(
            "The config of the model the engine runs, its weights, and the memory available now"
        )
        self.results = QLabel()
        self.results.setObjectName("kvResults")
        self.results.setTextFormat(Qt.TextFormat.RichText)
        self.results.setWordWrap(True)
        self.results.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.legend = QLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        self.plot = styled_plot()
        item = self.plot.getPlotItem()
        # A few straight lines: nothing to clip or downsample (peak downsampling would step them).
        item.setClipToView(False)
        item.setDownsampling(auto=False)
        item.setLabel("bottom", "context (tokens per sequence)")
        self.curves: dict[int, pg.PlotDataItem] = {}
        self.budget_line = pg.InfiniteLine(
            angle=0,
            movable=False,
            pen=pg.mkPen(theme.MARK, width=1, style=Qt.PenStyle.DashLine),
            label="budget beside the weights",
            labelOpts={"position": 0.02, "color": theme.MARK, "anchors": [(0, 1), (0, 1)]},
        )
        item.addItem(self.budget_line, ignoreBounds=True)

        grid = QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        fields = [
            ("layers", self.layers),
            ("KV heads", self.kv_heads),
            ("query heads", self.query_heads),
            ("head dim", self.head_dim),
            ("KV dtype", self.dtype),
            ("context", self.context),
            ("batch", self.batch),
            ("weights", self.weights),
            ("budget", self.budget),
        ]
        for i, (name, widget) in enumerate(fields):
            row, col = divmod(i, GRID_COLUMNS)
            grid.addWidget(QLabel(name), row, 2 * col)
            grid.addWidget(widget, row, 2 * col + 1)
        source_row = QHBoxLayout()
        source_row.addWidget(self.from_loaded)
        source_row.addWidget(self.source, 1)
        source_row.addWidget(self.from_model)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(4)
        layout.addLayout(source_row)
        layout.addLayout(grid)
        layout.addWidget(self.results)
        layout.addWidget(self.legend)
        layout.addWidget(self.plot, 1)

        for spin in (self.layers, self.kv_heads, self.query_heads, self.head_dim, self.context, self.batch):
            spin.valueChanged.connect(self._on_edited)
        for spin in (self.weights, self.budget):
            spin.valueChanged.connect(self._on_edited)
        self.dtype.currentIndexChanged.connect(self._on_edited)
        self.from_loaded.clicked.connect(self.loaded_requested)
        self.from_model.clicked.connect(self.inspect_source)
        self._recompute()

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt override
        return QSize(*PREFERRED_SIZE)

    # ---- filling the fields ----------------------------------------------------------------
    def set_config(self, config: KVConfig) -> None:
        """Show `config` in the fields (and its figures)."""
        self._filling = True
        try:
            self.layers.setValue(config.num_layers)
            self.kv_heads.setValue(config.num_kv_heads)
            self.query_heads.setValue(config.num_heads)
            self.head_dim.setValue(config.head_dim)
            self.dtype.setCurrentText(config.dtype)
            self.context.setValue(config.context)
            self.batch.setValue(config.batch)
            self.weights.setValue(config.weight_bytes / GIB)
            self.budget.setValue(config.budget_bytes / GIB)
        finally:
            self._filling = False
        self._recompute()

    def show_loaded(self, config: KVConfig) -> None:
        """The loaded model's config (its shapes, KV storage, full context, weights, and the
        memory its device has available now as the budget): the fields follow it again."""
        self.follows_loaded, self.error = True, ""
        self.set_config(config)

    @Slot()
    def inspect_source(self) -> None:
        """Ask for the config of the typed source, stored in the chosen KV dtype."""
        source = self.source.text().strip() or "default"
        if not self.from_model.isEnabled():
            return  # one read at a time
        self.error = ""
        self.from_model.setEnabled(False)
        self.results.setText(f"Reading the config of {source}…")
        self.inspect_requested.emit(source, self.dtype.currentText())

    def show_inspected(self, config: KVConfig) -> None:
        """The config read for "From model": the fields stop following the loaded model."""
        self.from_model.setEnabled(True)
        self.follows_loaded = False
        self.set_config(config)

    def show_error(self, message: str) -> None:
        """Why a config could not be read (or the loaded model filled in)."""
        self.from_model.setEnabled(True)
        self.error = message
        self._recompute()

    # ---- figures ---------------------------------------------------------------------------
    @Slot()
    def _on_edited(self) -> None:
        if not self._filling:
            self.follows_loaded = False
            self.error = ""
            self._recompute()

    def _read_fields(self) -> KVConfig:
        return KVConfig(
            num_layers=self.layers.value(),
            num_kv_heads=self.kv_heads.value(),
            head_dim=self.head_dim.value(),
            dtype=self.dtype.currentText(),
            context=self.context.value(),
            batch=self.batch.value(),
            num_heads=self.query_heads.value(),
            weight_bytes=round(self.weights.value() * GIB),
            budget_bytes=round(self.budget.value() * GIB),
        )

    def _recompute(self) -> None:
        try:
            self.config = self._read_fields()
        except ValueError as exc:
            self.config = None
            self.results.setText(f"<span style='color:{theme.WHAT_IF}'>{exc}</span>")
            self._draw(None)
            return
        self.results.setText(self._results_text(self.config))
        self._draw(self.config)

    def _results_text(self, c: KVConfig) -> str:
        muted = f"<span style='color:{theme.MUTED}'>"
        lines = []
        if self.follows_loaded and self.state.loaded is None:
            lines.append(
                f"{muted}No model loaded yet: type a config, or read one with <i>From model</i>.</span>"
            )
        if self.error:
            lines.append(f"<span style='color:{theme.WHAT_IF}'>{self.error}</span>")
        per_head = (
            f"({c.head_dim} × {c.element_bytes} B + {c.scale_bytes} B float16 scale)"
            if c.quantized
            else f"{c.head_dim} × {c.element_bytes} B"
        )
        per_token = (
            f"Per token <b>{format_bytes(c.bytes_per_token)}</b> {muted}= 2 (K, V) × {c.num_layers} layers × "
            f"{c.num_kv_heads} KV heads × {per_head}</span>"
        )
        mha = c.mha_bytes_per_token
        if mha and c.num_heads != c.num_kv_heads:
            kind = "MQA" if c.num_kv_heads == 1 else "GQA"
            per_token += (
                f" {muted}· {kind}: {c.num_heads // c.num_kv_heads} query heads share each KV head; "
                f"with one KV head per query head it would be {format_bytes(mha)}</span>"
            )
        lines.append(per_token)
        lines.append(
            f"Per sequence at {c.context:,} tokens <b>{format_bytes(c.bytes_per_sequence)}</b> · "
            f"× {c.batch:,} sequence{'s' if c.batch != 1 else ''} = <b>{format_bytes(c.total_bytes)}</b>"
        )
        if c.budget_bytes:
            beside = c.bytes_beside_weights
            verdict = "fits" if c.fits else f"<span style='color:{theme.WHAT_IF}'>does NOT fit</span>"
            lines.append(
                f"Budget {format_bytes(c.budget_bytes)} − weights {format_bytes(c.weight_bytes)} leaves "
                f"<b>{format_bytes(beside)}</b> for KV = <b>{c.tokens_in_budget:,} tokens</b> "
                f"({c.tokens_per_sequence_in_budget:,} per sequence at batch {c.batch:,}): this batch {verdict}"
            )
        else:
            lines.append(f"{muted}Give a memory budget to see how many tokens fit beside the weights.</span>")
        return "<br>".join(lines)

    def _draw(self, c: KVConfig | None) -> None:
        item = self.plot.getPlotItem()
        for curve in self.curves.values():
            item.removeItem(curve)
        self.curves.clear()
        if c is None:
            self.legend.setText("")
            self.budget_line.hide()
            return
        batches = chart_batches(c.batch)
        # The y range ends a little above the chosen batch and the budget: larger batches leave
        # the chart where they outgrow it, rather than flattening every other line to the floor.
        largest = max(c.total_bytes, c.bytes_beside_weights)
        unit, size = byte_unit(largest)
        item.setLabel("left", f"KV cache ({unit})")
        contexts = np.linspace(0, c.context, CHART_POINTS)
        entries = []
        for colour, batch in zip(BATCH_COLOURS, batches):
            width = 3 if batch == c.batch else 1.5
            self.curves[batch] = item.plot(
                contexts, c.kv_bytes(contexts, batch) / size, pen=pg.mkPen(colour, width=width)
            )
            label = f"batch {batch}" + (" (chosen)" if batch == c.batch else "")
            entries.append(legend_entry(colour, label))
        self.budget_line.setVisible(c.budget_bytes > 0)
        if c.budget_bytes:
            self.budget_line.setPos(c.bytes_beside_weights / size)
            self.budget_line.label.setFormat(
                f"budget beside the weights: {format_bytes(c.bytes_beside_weights)}"
            )
        self.legend.setText(" &nbsp; ".join(entries))
        item.setXRange(0, c.context, padding=0.02)
        item.setYRange(0, CHART_HEADROOM * largest / size, padding=0)

    def curve(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        data = self.curves[batch]
        return data.xData, data.yData


def _int_field(low: int, high: int, tip: str) -> QSpinBox:
    spin = QSpinBox()
    spin.setRange(low, high)
    spin.setToolTip(tip)
    spin.setKeyboardTracking(False)  # figures follow a finished number, not every keystroke
    return spin


def _gib_field(tip: str) -> QDoubleSpinBox:
    spin = QDoubleSpinBox()
    spin.setRange(0.0, 99_999.0)
    spin.setDecimals(3)
    spin.setSuffix(" GiB")
    spin.setToolTip(tip)
    spin.setKeyboardTracking(False)
    return spin
