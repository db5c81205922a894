"""Steering: a control vector added to the residual stream at a layer, and how the selected
token's distribution moves. The vector comes from a file in llama.cpp's control-vector GGUF format
(`load_requested`) or from two contrasting prompts (`contrast_requested`); the layer and the
strength (a slider) ask for the distribution again (`steer_requested`); the panel draws the
engine's answer (engine.inside.Steered): the top candidates without and with the vector, and the
KL divergence between the two over the whole vocabulary."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from engine.inside import Candidates, ControlVector, Steered
from widgets import theme
from widgets.probability_bars import percent
from widgets.token_text import escape_html, visible

# The slider in tenths: strengths from -STRENGTH_MAX to +STRENGTH_MAX.
STRENGTH_MAX = 8.0
SLIDER_STEPS = 10


def candidates_html(title: str, candidates: Candidates, other: Candidates | None, colour: str) -> str:
    """A column of candidates; with `other` (the distribution without the vector), each one's move
    from there in percentage points, "new" for one that was not among its top."""
    before = dict(zip(other.ids, other.probs)) if other is not None else {}
    rows = [f"<tr><td colspan=3><b>{escape_html(title)}</b></td></tr>"]
    for token_id, text, p in zip(candidates.ids, candidates.texts, candidates.probs):
        width = max(1, int(p * 120))
        moved = ""
        if other is None:
            moved = ""
        elif token_id in before:
            delta = p - before[token_id]
            moved = f"{delta * 100:+.1f}" if abs(delta) >= 0.0005 else "="
        else:
            moved = "new"
        rows.append(
            f"<tr><td>{escape_html(visible(text))}</td>"
            f"<td><span style='background:{colour}'>{'&nbsp;' * max(1, width // 6)}</span> {percent(p)}</td>"
            f"<td style='color:{theme.MUTED}'>{moved}</td></tr>"
        )
    return "<table cellspacing=2>" + "".join(rows) + "</table>"


class SteeringPanel(QWidget):
    load_requested = Signal()
    contrast_requested = Signal(str, str)
    steer_requested = Signal(object, float)  # layer (None: every layer of the vector), strength

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("steeringPanel")
        self.setStyleSheet(
            f"#steeringPanel, #steeringPanel QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.vector: ControlVector | None = None
        self.load_button = QPushButton("Load control vector…")
        self.load_button.setToolTip("A .gguf file in llama.cpp's control-vector format (direction.N tensors)")
        self.load_button.clicked.connect(self.load_requested)
        self.positive = QLineEdit()
        self.positive.setPlaceholderText("a prompt, e.g. I love this, it is wonderful")
        self.negative = QLineEdit()
        self.negative.setPlaceholderText("its contrast, e.g. I hate this, it is awful")
        self.contrast_button = QPushButton("Compute from the two prompts")
        self.contrast_button.clicked.connect(self._contrast)
        self.vector_label = QLabel()
        self.vector_label.setWordWrap(True)
        self.layer = QComboBox()
        self.layer.currentIndexChanged.connect(self._ask)
        self.strength = QSlider(Qt.Orientation.Horizontal)
        self.strength.setRange(int(-STRENGTH_MAX * SLIDER_STEPS), int(STRENGTH_MAX * SLIDER_STEPS))
        self.strength.setValue(SLIDER_STEPS)
        self.strength.valueChanged.connect(self._ask)
        self.strength_label = QLabel()
        self.result = QLabel()
        self.result.setTextFormat(Qt.TextFormat.RichText)
        self.result.setWordWrap(True)
        self.result.setAlignment(Qt.AlignmentFlag.AlignTop)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.RichText)

        grid = QGridLayout()
        grid.addWidget(self.load_button, 0, 0, 1, 2)
        grid.addWidget(QLabel("or contrast"), 1, 0)
        grid.addWidget(self.positive, 1, 1)
        grid.addWidget(QLabel("minus"), 2, 0)
        grid.addWidget(self.negative, 2, 1)
        grid.addWidget(self.contrast_button, 3, 1)
        grid.addWidget(QLabel("added after"), 4, 0)
        grid.addWidget(self.layer, 4, 1)
        strength_row = QHBoxLayout()
        strength_row.addWidget(self.strength, 1)
        strength_row.addWidget(self.strength_label)
        grid.addWidget(QLabel("strength"), 5, 0)
        grid.addLayout(strength_row, 5, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.addLayout(grid)
        layout.addWidget(self.vector_label)
        layout.addWidget(self.status)
        layout.addWidget(self.result, 1)
        self._set_strength_label()
        self.set_vector(None)

    def strength_value(self) -> float:
        return self.strength.value() / SLIDER_STEPS

    def layer_value(self) -> int | None:
        data = self.layer.currentData()
        return data if isinstance(data, int) else None

    def _set_strength_label(self) -> None:
        self.strength_label.setText(f"{self.strength_value():+.1f}")

    def _contrast(self) -> None:
        positive, negative = self.positive.text(), self.negative.text()
        if not positive.strip() or not negative.strip():
            self.show_error(
                "Type both prompts: the vector is the first's residual stream minus the second's."
            )
            return
        self.status.setText(f"<span style='color:{theme.MUTED}'>computing the vector on the engine…</span>")
        self.contrast_requested.emit(positive, negative)

    def set_vector(self, vector: ControlVector | None) -> None:
        self.vector = vector
        self.layer.blockSignals(True)
        self.layer.clear()
        if vector is None:
            self.vector_label.setText(
                f"<span style='color:{theme.MUTED}'>No control vector: load one, or compute one from two prompts.</span>"
            )
            self.layer.setEnabled(False)
            self.strength.setEnabled(False)
        else:
            self.layer.addItem(
                f"every layer it has ({len(vector.layers)}, as llama.cpp applies a file)", None
            )
            for layer in vector.layers:
                self.layer.addItem(f"layer {layer}", layer)
            if len(vector.layers) > 1:  # a computed vector: one middle layer reads best
                self.layer.setCurrentIndex(1 + len(vector.layers) // 2)
            self.layer.setEnabled(True)
            self.strength.setEnabled(True)
            hint = f" · made for {escape_html(vector.model_hint)}" if vector.model_hint else ""
            self.vector_label.setText(
                f"<b>{escape_html(vector.name)}</b>: {len(vector.layers)} directions of {vector.width}{hint} · "
                f"<span style='color:{theme.MUTED}'>{escape_html(vector.source)}</span>"
            )
        self.layer.blockSignals(False)
        self.status.setText("")
        self._ask()

    def _ask(self) -> None:
        self._set_strength_label()
        if self.vector is not None:
            self.steer_requested.emit(self.layer_value(), self.strength_value())

    def show_error(self, message: str) -> None:
        self.status.setText(f"<span style='color:{theme.ERROR}'>{escape_html(message)}</span>")

    def show_waiting(self, message: str) -> None:
        self.status.setText(f"<span style='color:{theme.MUTED}'>{escape_html(message)}</span>")

    def show_steered(self, steered: Steered, token: str, cost: str = "") -> None:
        where = (
            ", ".join(map(str, steered.layers))
            if len(steered.layers) <= 4
            else f"{len(steered.layers)} layers"
        )
        self.status.setText(
            f"The distribution of {escape_html(visible(token))}'s position with the vector ×{steered.strength:+.1f} "
            f"added after layer {where}: KL(steered ‖ plain) = <b>{steered.kl:.3f}</b> nats{cost}"
        )
        self.result.setText(
            "<table><tr><td valign=top>"
            + candidates_html("without (recomputed alike)", steered.plain, None, theme.SERIES["raw"])
            + "</td><td width=16></td><td valign=top>"
            + candidates_html("with the vector (move)", steered.steered, steered.plain, theme.SERIES["stage"])
            + "</td></tr></table>"
        )
