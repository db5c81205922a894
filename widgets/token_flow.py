"""A text as a flow of token boxes, each coloured by a value in [0, 1] on the heat ramp (None: a
grey box), with a tooltip per token and an outline on the marked ones; an optional gap every
`group` tokens (where a KV block ends). The attention view's large map and the scoring view draw
with it."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import QEvent, QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFontMetricsF, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from widgets import theme
from widgets.heat import heat
from widgets.token_text import visible

GREY = QColor(58, 62, 70)


class TokenFlow(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.texts: Sequence[str] = ()
        self.values: Sequence[float | None] = ()
        self.tips: Sequence[str] = ()
        self.marked: frozenset[int] = frozenset()
        self.group = 0
        self._boxes: list[QRectF] = []
        self._font = theme.mono_font(8.5)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)

    def set_tokens(
        self,
        texts: Sequence[str],
        values: Sequence[float | None],
        tips: Sequence[str],
        marked: frozenset[int] = frozenset(),
        group: int = 0,
    ) -> None:
        self.texts, self.values, self.tips, self.marked, self.group = texts, values, tips, marked, group
        self._lay_out()
        self.update()

    def _lay_out(self) -> None:
        metrics = QFontMetricsF(self._font)
        line = metrics.height() + 6
        x, y = 4.0, 4.0
        width = max(100, self.width() - 8)
        self._boxes = []
        for i, text in enumerate(self.texts):
            if self.group and i and i % self.group == 0:
                x += 5
            w = metrics.horizontalAdvance(visible(text, 16)) + 6
            if x + w > width and x > 4.0:
                x, y = 4.0, y + line
            self._boxes.append(QRectF(x, y, w, line - 2))
            x += w + 1
        self.setMinimumHeight(int(y + line + 6) if self.texts else 0)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._lay_out()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        painter.setFont(self._font)
        for i, rect in enumerate(self._boxes):
            value = self.values[i]
            if value is None:
                painter.fillRect(rect, GREY)
                painter.setPen(QColor(theme.MUTED))
            else:
                painter.fillRect(rect, heat(value))
                painter.setPen(QColor("#101010") if value > 0.55 else QColor(theme.TEXT))
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, visible(self.texts[i], 16))
            if i in self.marked:
                painter.save()
                painter.setPen(QPen(QColor(theme.MARK), 1.5))
                painter.drawRect(rect)
                painter.restore()
            if self.group and i and i % self.group == 0:
                painter.save()
                painter.setPen(QPen(QColor(theme.MUTED), 1))
                x = rect.left() - 3
                painter.drawLine(QPointF(x, rect.top()), QPointF(x, rect.bottom()))
                painter.restore()
        painter.end()

    def index_at(self, x: float, y: float) -> int | None:
        for i, rect in enumerate(self._boxes):
            if rect.contains(x, y):
                return i
        return None

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            i = self.index_at(event.pos().x(), event.pos().y())
            if i is None or i >= len(self.tips):
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), self.tips[i], self)
            return True
        return super().event(event)
