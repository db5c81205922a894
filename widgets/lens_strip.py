"""The logit lens of the selected token: one cell per stage of the residual stream (the embedding,
then each layer's output), read through the final norm and the head as the model reads its last
layer. A cell's colour is the drawn token's probability there (log scale), its number the token's
rank; a mark shows the layer where it first leads. Clicking a cell lists that layer's top
candidates; hovering says the same in a tooltip. It only draws the engine's answer
(engine.inside.LogitLens), which the app asks for when a token is pinned."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFontMetricsF, QMouseEvent, QPainter, QPen
from PySide6.QtWidgets import QLabel, QSizePolicy, QToolTip, QVBoxLayout, QWidget

from engine.inside import LensLayer, LogitLens
from widgets import theme
from widgets.heat import heat, log_scale
from widgets.probability_bars import percent
from widgets.token_text import escape_html, visible

STRIP_PX = 34
LABEL_PX = 14
FAINT = 0.03  # shades below this are drawn as EMPTY_CELL (the ramp's bottom is the background)
EMPTY_CELL = (44, 48, 56)


def after(stage: int) -> str:
    """Where stage `stage` of the residual stream is read: "after the embedding", "after layer 3"."""
    return "after the embedding" if stage == 0 else f"after layer {stage - 1}"


def top_line(layer: LensLayer, n: int = 5) -> str:
    parts = [
        f"{escape_html(visible(t))} {percent(p)}" for t, p in zip(layer.top.texts[:n], layer.top.probs[:n])
    ]
    return " · ".join(parts)


class LensCells(QWidget):
    """The painted strip: one cell per stage."""

    stage_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.lens: LogitLens | None = None
        self.chosen: int | None = None
        self.setMinimumHeight(STRIP_PX + LABEL_PX + 4)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)
        self._font = theme.mono_font(8.0)

    def set_lens(self, lens: LogitLens | None) -> None:
        self.lens, self.chosen = lens, None
        self.update()

    def _cell(self, i: int, count: int) -> QRectF:
        width = max(1.0, (self.width() - 2.0) / count)
        return QRectF(1.0 + i * width, 2.0, width - 1.0, STRIP_PX)

    def stage_at(self, x: float) -> int | None:
        if self.lens is None or not self.lens.layers:
            return None
        count = len(self.lens.layers)
        i = int((x - 1.0) // max(1.0, (self.width() - 2.0) / count))
        return i if 0 <= i < count else None

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        lens = self.lens
        if lens is None:
            painter.end()
            return
        painter.setFont(self._font)
        metrics = QFontMetricsF(self._font)
        count = len(lens.layers)
        for i, layer in enumerate(lens.layers):
            rect = self._cell(i, count)
            shade = log_scale(layer.token_prob)
            # below the ramp's floor a cell is still a cell: a dim box, not the background
            painter.fillRect(rect, heat(shade) if shade > FAINT else QColor(*EMPTY_CELL))
            rank = str(layer.token_rank) if layer.token_rank < 1000 else f"{layer.token_rank // 1000}k"
            if metrics.horizontalAdvance(rank) + 2 <= rect.width():
                painter.setPen(QColor("#101010") if layer.token_prob > 0.2 else QColor(theme.TEXT))
                painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, rank)
            if layer.stage == lens.first_lead:
                painter.setPen(QPen(QColor(theme.MARK), 2))
                painter.drawLine(rect.bottomLeft(), rect.bottomRight())
            if i == self.chosen:
                painter.setPen(QPen(QColor(theme.ACCENT), 2))
                painter.drawRect(rect.adjusted(1, 1, -1, -1))
            if layer.stage == 0 or (layer.stage - 1) % 5 == 0 or i == count - 1:  # emb, 0, 5, 10, ...
                painter.setPen(QColor(theme.MUTED))
                label = "emb" if layer.stage == 0 else str(layer.stage - 1)
                painter.drawText(
                    QRectF(rect.left() - 10, STRIP_PX + 3, rect.width() + 20, LABEL_PX),
                    Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop,
                    label,
                )
        painter.end()

    def mousePressEvent(self, event: QMouseEvent) -> None:  # noqa: N802 - Qt override
        stage = self.stage_at(event.position().x())
        if stage is not None:
            self.chosen = stage
            self.update()
            self.stage_clicked.emit(stage)

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip and self.lens is not None:
            i = self.stage_at(event.pos().x())
            if i is None:
                QToolTip.hideText()
            else:
                layer = self.lens.layers[i]
                QToolTip.showText(
                    event.globalPos(),
                    f"<b>{after(layer.stage)}</b>: {escape_html(visible(self.lens.token_text))} rank "
                    f"{layer.token_rank}, {percent(layer.token_prob)}<br>top: {top_line(layer)}",
                    self,
                )
            return True
        return super().event(event)


class LensStrip(QWidget):
    """The strip with a title line above and the chosen stage's candidates below."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("lensStrip")
        self.setStyleSheet(
            f"#lensStrip, #lensStrip QLabel {{ background: {theme.BACKGROUND}; color: {theme.TEXT}; }}"
        )
        self.title = QLabel()
        # what the answer cost: on the engine, and to draw here
        self.cost = QLabel()
        self.cost.setStyleSheet(f"color: {theme.MUTED};")
        self.title.setWordWrap(True)
        self.title.setTextFormat(Qt.TextFormat.RichText)
        self.cells = LensCells()
        self.detail = QLabel()
        self.detail.setTextFormat(Qt.TextFormat.RichText)
        self.detail.setWordWrap(True)
        self.detail.setStyleSheet(f"color: {theme.MUTED};")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(2)
        layout.addWidget(self.title)
        layout.addWidget(self.cost)
        layout.addWidget(self.cells)
        layout.addWidget(self.detail)
        layout.addStretch(1)
        self.cells.stage_clicked.connect(self._show_stage)
        self.show_message(
            "Pin a token of a reply (click it) to see its logit lens: the token's rank after every layer."
        )

    def set_cost(self, text: str) -> None:
        self.cost.setText(text)

    def show_message(self, text: str) -> None:
        self.cost.setText("")
        self.cells.set_lens(None)
        self.title.setText(f"<span style='color:{theme.MUTED}'>{text}</span>")
        self.detail.setText("")

    def set_lens(self, lens: LogitLens) -> None:
        self.cells.set_lens(lens)
        lead = (
            f"first leads {after(lens.first_lead)}"
            if lens.first_lead is not None
            else "never the top candidate"
        )
        # the step's own logits while the engine keeps them for the token, else the replay's
        whose = "the step's own logits" if lens.against_the_step else "the replayed step's logits"
        last = (
            f"the last layer through the head is {whose}, to the bit"
            if lens.last_gap == 0.0
            else f"the last layer through the head is within {lens.last_gap:.2g} of {whose}"
        )
        token = f"<b style='color:{theme.MARK}'>{escape_html(visible(lens.token_text))}</b>"
        self.title.setText(
            f"Logit lens of {token}: rank per layer (colour: its probability) · {lead} · {last}"
        )
        self._show_stage(len(lens.layers) - 1)

    def _show_stage(self, stage: int) -> None:
        lens = self.cells.lens
        if lens is None:
            return
        layer = lens.layers[stage]
        self.detail.setText(f"{after(layer.stage)}: {top_line(layer)} · entropy {layer.entropy:.2f} nats")
