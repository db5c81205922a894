"""The model picker's quantization rows: the weight scheme and the KV-cache dtype chosen at load
time, and what the loaded model's weights weigh before and after quantizing.

Every scheme stays listed. One that cannot run on the chosen device is greyed out (a disabled
item) with its reason as the item's tooltip, and the reasons are also written under the box,
grouped when several schemes share one (a CPU-only PyTorch refuses every scheme on cuda for the
same reason). Nothing falls back silently: the choice is what gets loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject, Qt, Slot
from PySide6.QtGui import QColor, QStandardItemModel
from PySide6.QtWidgets import QComboBox, QFormLayout, QLabel, QStyledItemDelegate

from engine.config import KV_DTYPES, ModelSpec
from engine.events import ModelInfo, ModelLoaded
from engine.units import format_bytes

NONE = "none"  # engine.quant.schemes.NONE, without importing torch for a constant
KV_LABELS = {"auto": "auto", "float16": "float16", "int8": "int8 (per-token scales)"}  # auto: the tooltip
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}
MUTED_ITEM = "#6b7280"  # an unavailable scheme's text in the drop-down


@dataclass(frozen=True, slots=True)
class WeightsFigures:
    """What the loaded model's weights take, and what they would take unquantized."""

    scheme: str
    load_dtype: str
    bytes_now: int  # the engine's count of parameters and buffers after quantization
    bytes_full: int | None  # the same weights in the load dtype; None when nothing was quantized

    @property
    def ratio(self) -> float | None:
        return self.bytes_now / self.bytes_full if self.bytes_full else None


def weights_figures(spec: ModelSpec, info: ModelInfo) -> WeightsFigures:
    """From the spec the engine loaded and the info it reported: the engine counts the weights
    before quantizing (`info.weight_bytes_before`). An info without that count (None) falls back
    to the parameter count (kept from before quantizing) times the load dtype's element size."""
    if info.quantization == NONE:
        return WeightsFigures(NONE, spec.dtype, info.weight_bytes, None)
    full = info.weight_bytes_before
    if full is None:
        full = info.params * BYTES_PER_ELEMENT[spec.dtype]
    return WeightsFigures(info.quantization, spec.dtype, info.weight_bytes, full)


def describe_loaded(weights: WeightsFigures, loaded: ModelLoaded, kv_dtype: str) -> str:
    """The picker's lines once a model is up: weights before/after, KV page size, then how the
    engine runs it (ModelInfo.notes: the weights kept, the forward, its threads, the kernel table)."""
    if weights.bytes_full is None:
        line = f"Loaded weights: {format_bytes(weights.bytes_now)} in {weights.load_dtype} (not quantized)"
    else:
        line = (
            f"Loaded weights: {format_bytes(weights.bytes_now)} with {weights.scheme}, "
            f"{format_bytes(weights.bytes_full)} in {weights.load_dtype} ({weights.ratio:.2f}×)"
        )
    per_block = loaded.kv_pool_bytes // loaded.kv_num_blocks if loaded.kv_num_blocks else 0
    full_block = loaded.info.kv_bytes_per_token * loaded.kv_block_size
    kv = f"KV {loaded.info.kv_stored_as(kv_dtype)}: {format_bytes(per_block)} per page"
    if kv_dtype != "auto" and full_block:
        kv += f" ({format_bytes(full_block)} in {loaded.info.kv_stored_as('auto')}), {loaded.kv_num_blocks:,} pages"
    else:
        kv += f", {loaded.kv_num_blocks:,} pages"
    return "\n".join([line, kv, *loaded.info.notes])


def statuses_for(device: str):
    """engine.quant.schemes's statuses for the picker's device entry ('auto', 'cpu', 'cuda')."""
    import torch

    from engine.api import scheme_statuses

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return scheme_statuses(device)


def unavailable_text(statuses) -> str:
    """The reasons of the unavailable schemes, one line per distinct reason."""
    by_reason: dict[str, list[str]] = {}
    for status in statuses:
        if not status.available:
            by_reason.setdefault(status.reason, []).append(status.name)
    if not by_reason:
        return ""
    if len(by_reason) == 1 and all(not s.available for s in statuses):
        return f"Unavailable here, every scheme: {next(iter(by_reason))}"
    lines = [f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()]
    return "Unavailable here:\n" + "\n".join(lines)


class QuantizationChoice(QObject):
    """The scheme and KV-dtype combo boxes plus their explanation lines, placed into the model
    picker's form with `add_rows` so they align with its other fields."""

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.scheme = QComboBox()
        self.scheme.setObjectName("quantScheme")
        # A styled combo's own menu delegate paints every item alike; this one honours the
        # disabled state and the item colour, so unavailable schemes read as greyed out.
        self.scheme.setItemDelegate(QStyledItemDelegate(self.scheme))
        self.kv_dtype = QComboBox()
        self.kv_dtype.setObjectName("kvDtype")
        for name in KV_DTYPES:
            self.kv_dtype.addItem(KV_LABELS.get(name, name), name)
        self.kv_dtype.setToolTip(
            "How the paged KV cache stores keys and values: auto is the model's dtype (float16 for a "
            "GGUF kept at its own bits, as llama.cpp keeps it); float16 whatever the model (half of "
            "float32); or int8 with a scale per token and head (a quarter of float32)"
        )
        self.note = QLabel()  # the chosen scheme: what it does, and how it runs or why not
        self.note.setObjectName("hint")
        self.note.setWordWrap(True)
        self.unavailable = QLabel()
        self.unavailable.setObjectName("fieldError")
        self.unavailable.setWordWrap(True)
        self.loaded = QLabel()  # weights before/after of the model that is running
        self.loaded.setObjectName("hint")
        self.loaded.setWordWrap(True)
        self.loaded.hide()
        self.statuses: list = []
        self._device = ""
        self.scheme.currentIndexChanged.connect(self._on_scheme_changed)
        self.set_device("auto")

    def add_rows(self, form: QFormLayout) -> None:
        form.addRow("weights", self.scheme)
        form.addRow(self.note)
        form.addRow(self.unavailable)
        form.addRow("KV cache", self.kv_dtype)
        form.addRow(self.loaded)

    # ---- values ----------------------------------------------------------------------------
    def scheme_name(self) -> str:
        return self.scheme.currentData() or NONE

    def kv_dtype_name(self) -> str:
        return self.kv_dtype.currentData() or "auto"

    def set_values(self, scheme: str, kv_dtype: str) -> None:
        index = self.scheme.findData(scheme)
        self.scheme.setCurrentIndex(index if index >= 0 else self.scheme.findData(NONE))
        index = self.kv_dtype.findData(kv_dtype)
        self.kv_dtype.setCurrentIndex(max(0, index))

    def is_enabled(self, name: str) -> bool:
        item = self.scheme.model().item(self.scheme.findData(name))
        return item is not None and item.isEnabled()

    # ---- availability ----------------------------------------------------------------------
    @Slot(str)
    def set_device(self, device: str) -> None:
        """List the schemes again for `device`; the chosen one stays chosen even when it cannot
        run there (the note says why, and loading it reports the same reason)."""
        if device == self._device:
            return
        self._device = device
        chosen = self.scheme_name() if self.scheme.count() else NONE
        self.statuses = statuses_for(device)
        model = self.scheme.model()
        assert isinstance(model, QStandardItemModel)
        self.scheme.blockSignals(True)
        self.scheme.clear()
        for i, status in enumerate(self.statuses):
            self.scheme.addItem(
                status.name if status.available else f"{status.name} (unavailable)", status.name
            )
            tip = f"{status.description}.\n{'Runs with' if status.available else 'Unavailable:'} {status.reason}."
            self.scheme.setItemData(i, tip, Qt.ItemDataRole.ToolTipRole)
            model.item(i).setEnabled(status.available)
            if not status.available:  # the stylesheet's item colour would hide the disabled state
                self.scheme.setItemData(i, QColor(MUTED_ITEM), Qt.ItemDataRole.ForegroundRole)
        self.scheme.setCurrentIndex(max(0, self.scheme.findData(chosen)))
        self.scheme.blockSignals(False)
        self.unavailable.setText(unavailable_text(self.statuses))
        self.unavailable.setVisible(bool(self.unavailable.text()))
        self._on_scheme_changed()

    @Slot()
    def _on_scheme_changed(self) -> None:
        status = next((s for s in self.statuses if s.name == self.scheme_name()), None)
        if status is None:
            return
        if status.available:
            text = f"{status.description}. Runs with {status.reason}."
        else:
            text = f"{status.name} cannot run here: {status.reason}."
        self.note.setText(text)
        self.scheme.setToolTip(text)

    # ---- the running model -----------------------------------------------------------------
    def show_loaded(self, weights: WeightsFigures, loaded: ModelLoaded, kv_dtype: str) -> None:
        self.loaded.setText(describe_loaded(weights, loaded, kv_dtype))
        self.loaded.show()
