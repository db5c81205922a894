"""The Controls dock: the model's load bar pinned at the top (which model, Load model, Open…, the
load's progress), then the model's settings, sampling and speculation in one scrolling column."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt, Slot
from PySide6.QtWidgets import QFrame, QGroupBox, QPushButton, QScrollArea, QVBoxLayout, QWidget

from app.models.picker import ModelPicker
from app.sampling_controls import SamplingControls
from app.sampling_presets import PresetBar, PresetStore
from app.settings import DEFAULT_SAMPLING, ModelChoice
from app.speculation.controls import SpeculationControls
from engine.config import SamplingParams


class ControlsPanel(QWidget):
    def __init__(
        self,
        params: SamplingParams,
        choice: ModelChoice,
        default_budget_bytes: int,
        parent: QWidget | None = None,
        presets: PresetStore | None = None,
        token_texts: dict | None = None,
    ):
        super().__init__(parent)
        self.setObjectName("controls")
        self.scroll = QScrollArea()
        self.scroll.setObjectName("controlsScroll")
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.model = ModelPicker(choice, default_budget_bytes)
        self.sampling = SamplingControls(params)
        if token_texts:
            self.sampling.set_params(params, token_texts)
        self.presets = PresetBar(presets, self.sampling) if presets is not None else None
        self.speculation = SpeculationControls()
        reset = QPushButton("Reset to defaults")
        reset.setToolTip("Back to kvscope's starting sampling settings")
        reset.clicked.connect(self._on_reset)

        model_box = QGroupBox("Model settings")
        QVBoxLayout(model_box).addWidget(self.model)
        sampling_box = QGroupBox("Sampling")
        sampling_layout = QVBoxLayout(sampling_box)
        if self.presets is not None:
            sampling_layout.addWidget(self.presets)
        sampling_layout.addWidget(self.sampling)
        sampling_layout.addWidget(reset)

        speculation_box = QGroupBox("Speculative decoding")
        QVBoxLayout(speculation_box).addWidget(self.speculation)

        inner = QWidget()
        layout = QVBoxLayout(inner)
        layout.setContentsMargins(6, 0, 6, 6)
        layout.addWidget(model_box)
        layout.addWidget(sampling_box)
        layout.addWidget(speculation_box)
        layout.addStretch(1)
        self.scroll.setWidget(inner)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 0)
        outer.setSpacing(4)
        outer.addWidget(self.model.load_bar)  # taken out of the picker's column: never scrolled away
        outer.addWidget(self.scroll, 1)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        """Wide enough for the scrolling column's widest row and its scroll bar: the dock may be
        short (the column scrolls) but never so narrow that a field or button is cut off."""
        hint = super().minimumSizeHint()
        inner = self.scroll.widget().minimumSizeHint().width()
        bar = self.scroll.verticalScrollBar().sizeHint().width()
        margins = self.layout().contentsMargins()
        return QSize(max(hint.width(), inner + bar + margins.left() + margins.right() + 2), hint.height())

    @Slot()
    def _on_reset(self) -> None:
        defaults = DEFAULT_SAMPLING
        self.sampling.set_params(defaults, {"logit_bias": "", "banned": ""})
        self.sampling.changed.emit(defaults)
        if self.sampling.what_if.isChecked():
            self.sampling.what_if_changed.emit(defaults)
