"""Speculation settings in the Controls dock: proposer (off, n-gram prompt lookup, the target's
first layers, or a draft model picked as a folder or .gguf file), tokens per round, adaptive.

Apply emits the chosen SpeculativeConfig (None: off); the window restarts the engine with it, as
the model picker's Load does, because the proposer is part of the engine.
"""

from __future__ import annotations

from PySide6.QtCore import Signal, Slot
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.config import ConfigError, SpeculativeConfig

PROPOSERS = (
    ("Off", None),
    ("N-gram prompt lookup", "ngram"),
    ("Self-draft", "self"),
    ("Draft model", "draft"),
)


class SpeculationControls(QWidget):
    apply_requested = Signal(object)  # SpeculativeConfig | None

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.proposer = QComboBox()
        for label, method in PROPOSERS:
            self.proposer.addItem(label, method)
        self.proposer.setToolTip(
            "Who drafts tokens for the target to verify in one forward: n-gram lookup copies from the "
            "conversation (no model); self-draft has the target draft for itself, from its own "
            "hidden state or its first layers; a draft model must share the target's tokenizer"
        )
        self.num_draft = QSpinBox()
        self.num_draft.setRange(1, 16)
        self.num_draft.setValue(4)
        self.num_draft.setToolTip("Draft tokens per round (the most, when adaptive)")
        self.adaptive = QCheckBox("Adaptive")
        self.adaptive.setChecked(True)  # the engine's default: never slower than not speculating
        self.adaptive.setToolTip(
            "Each reply's draft length follows its recent acceptance and the engine's measured step "
            "times, down to none when drafts do not pay; off: always the tokens per round above"
        )
        self.self_layers = QSpinBox()
        self.self_layers.setRange(0, 256)
        self.self_layers.setSpecialValueText("auto (calibrated)")
        self.self_layers.setToolTip(
            "Decoder layers the self-draft keeps. Auto: once per model, the calibration measures "
            "drafts from the target's own hidden state and from its first layers on the model's "
            "replies, and keeps the one that saves the most"
        )
        self.draft_model = QLineEdit()
        self.draft_model.setPlaceholderText("folder or .gguf of the draft model")
        self.browse = QPushButton("Browse…")
        self.browse.clicked.connect(self._on_browse)
        self.error = QLabel("")
        self.error.setObjectName("estimate")
        self.error.setWordWrap(True)
        self.apply_button = QPushButton("Apply speculation")
        self.apply_button.setToolTip("Restart the engine with these speculation settings (same model)")
        self.apply_button.clicked.connect(self._on_apply)

        draft_row = QHBoxLayout()
        draft_row.addWidget(self.draft_model, 1)
        draft_row.addWidget(self.browse)
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        # a field under its label where the column is too narrow for both side by side
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        form.addRow("proposer", self.proposer)
        form.addRow("tokens per round", self.num_draft)
        form.addRow("", self.adaptive)
        form.addRow("self-draft layers", self.self_layers)
        form.addRow("draft model", draft_row)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(form)
        layout.addWidget(self.error)
        layout.addWidget(self.apply_button)
        self.proposer.currentIndexChanged.connect(self._sync_enabled)
        self._sync_enabled()

    def set_method(self, method: str | None) -> None:
        self.proposer.setCurrentIndex(self.proposer.findData(method))

    def config(self) -> SpeculativeConfig | None:
        """The chosen settings; raises ConfigError with a reason for the user when invalid."""
        method = self.proposer.currentData()
        if method is None:
            return None
        return SpeculativeConfig(
            method,
            num_draft=self.num_draft.value(),
            draft_model=self.draft_model.text().strip() or None if method == "draft" else None,
            self_draft_layers=(self.self_layers.value() or None) if method == "self" else None,
            adaptive=self.adaptive.isChecked(),
        )

    @Slot()
    def _sync_enabled(self) -> None:
        method = self.proposer.currentData()
        for widget in (self.num_draft, self.adaptive):
            widget.setEnabled(method is not None)
        self.self_layers.setEnabled(method == "self")
        self.draft_model.setEnabled(method == "draft")
        self.browse.setEnabled(method == "draft")

    @Slot()
    def _on_browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Draft model (.gguf)", "", "GGUF models (*.gguf);;All files (*)"
        )
        if not path:
            path = QFileDialog.getExistingDirectory(self, "Draft model folder")
        if path:
            self.draft_model.setText(path)

    @Slot()
    def _on_apply(self) -> None:
        try:
            config = self.config()
        except ConfigError as exc:
            self.error.setText(str(exc))
            return
        self.error.setText("")
        self.apply_requested.emit(config)
