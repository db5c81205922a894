"""The painted bar chart of the probability panel: one row per candidate token.

Each row: the token text, a solid bar for its probability after the chosen stage, an outline
("ghost") for its raw probability, and the percentage. Rows a stage removed are greyed and
struck through, with a dashed line where a cut begins. The drawn token's row is highlighted.
When a quality run measured it, a tick marks the full-precision reference's raw probability.
QPainter rather than a plot: text-heavy rows read better than axis ticks at small sizes.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFontMetricsF, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from widgets import theme
from widgets.probability_rows import BarRow, cut_lines, stage_label

MIN_ROW_PX = 15.0
MAX_ROW_PX = 24.0
MARGIN = 6.0
REFERENCE_COLOUR = "#ff79c6"  # the full-precision reference's tick: distinct from every bar colour


def percent(p: float) -> str:
    if p == 0.0:
        return "0%"
    if p < 0.001:
        return "<0.1%"
    return f"{p * 100:.1f}%"


class ProbabilityBars(QWidget):
    row_clicked = Signal(int)  # a candidate chosen (to continue the reply from)
    row_double_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.chosen_row: int | None = None  # outlined: the candidate "continue from here" would use
        # paintEvent fills the whole rect first: nothing beneath needs repainting.
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.rows: list[BarRow] = []
        self.stage_names: tuple[str, ...] = ()
        self.message = ""
        self._row_px = MIN_ROW_PX
        self._top = MARGIN
        self._font = theme.mono_font(9.0)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setMinimumSize(220, 120)

    def set_rows(self, rows: list[BarRow], stage_names: tuple[str, ...]) -> None:
        self.rows, self.stage_names, self.message = rows, stage_names, ""
        self.update()

    def choose_row(self, index: int | None) -> None:
        if index != self.chosen_row:
            self.chosen_row = index
            self.update()

    def set_message(self, message: str) -> None:
        self.rows, self.message = [], message
        self.update()

    def visible_row_count(self) -> int:
        """Rows that fit; the rest are summarised in a '+n more' line."""
        height = self.height() - 2 * MARGIN
        fit = int(height // MIN_ROW_PX)
        if fit >= len(self.rows):
            return len(self.rows)
        return max(1, fit - 1)

    # ---- painting --------------------------------------------------------------------------
    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        painter.setFont(self._font)
        if self.message or not self.rows:
            painter.setPen(QColor(theme.MUTED))
            painter.drawText(
                self.rect().adjusted(12, 12, -12, -12),
                Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap,
                self.message,
            )
            painter.end()
            return
        self._paint_rows(painter)
        painter.end()

    def _paint_rows(self, painter: QPainter) -> None:
        metrics = QFontMetricsF(self._font)
        shown = self.visible_row_count()
        rows = self.rows[:shown]
        height = self.height() - 2 * MARGIN
        self._row_px = min(MAX_ROW_PX, max(MIN_ROW_PX, height / max(1, len(self.rows))))
        self._top = MARGIN
        width = float(self.width())
        label_w = min(width * 0.34, max(metrics.horizontalAdvance(r.text) for r in rows) + 22.0)
        value_w = metrics.horizontalAdvance("100.0%") + 8.0
        bar_x = MARGIN + label_w + 6.0
        bar_w = max(10.0, width - bar_x - value_w - MARGIN)
        scale = max(max(r.prob, r.raw_prob, r.reference_prob or 0.0) for r in rows) or 1.0
        bar_h = max(4.0, self._row_px * 0.62)

        for i, row in enumerate(rows):
            y = self._top + i * self._row_px
            mid = y + self._row_px / 2
            if row.drawn:
                painter.fillRect(QRectF(0, y, width, self._row_px), QColor(240, 180, 41, 38))
            if i == self.chosen_row:
                painter.setPen(QPen(QColor(theme.SERIES["stage"]), 1.5))
                painter.setBrush(Qt.BrushStyle.NoBrush)
                painter.drawRect(QRectF(1, y + 0.5, width - 2, self._row_px - 1))
            # token text, right-aligned against the bars
            removed = row.removed_by is not None
            color = QColor(theme.MUTED) if removed else QColor(theme.TEXT)
            if row.drawn:
                color = QColor(theme.MARK)
            font = self._font
            if removed:
                font = type(self._font)(self._font)
                font.setStrikeOut(True)
            painter.setFont(font)
            painter.setPen(color)
            text = metrics.elidedText(row.text, Qt.TextElideMode.ElideRight, label_w - 14.0)
            painter.drawText(
                QRectF(MARGIN, y, label_w, self._row_px),
                Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                text,
            )
            if row.drawn:
                painter.drawText(QRectF(MARGIN - 2, y, 12, self._row_px), Qt.AlignmentFlag.AlignVCenter, "▶")
            painter.setFont(self._font)
            # solid bar: the shown stage
            top = mid - bar_h / 2
            if row.prob > 0:
                fill = QColor(theme.MARK) if row.drawn else QColor(theme.SERIES["stage"])
                painter.fillRect(QRectF(bar_x, top, bar_w * row.prob / scale, bar_h), fill)
            # ghost: the raw distribution (hatched when this row has been cut)
            ghost = QRectF(bar_x, top, max(1.0, bar_w * row.raw_prob / scale), bar_h)
            if removed:
                painter.fillRect(ghost, QBrush(QColor(theme.MUTED), Qt.BrushStyle.BDiagPattern))
            painter.setPen(QPen(QColor(170, 176, 188), 1.0, Qt.PenStyle.SolidLine))
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawRect(ghost)
            if row.reference_prob is not None:  # the reference's raw probability: a tick
                x = bar_x + bar_w * row.reference_prob / scale
                painter.setPen(QPen(QColor(REFERENCE_COLOUR), 2.0))
                painter.drawLine(QPointF(x, y + 1), QPointF(x, y + self._row_px - 1))
            # value
            painter.setPen(color)
            painter.drawText(
                QRectF(bar_x + bar_w + 4, y, value_w, self._row_px),
                Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                "cut" if removed and row.prob == 0 else percent(row.prob),
            )

        for index, stage in cut_lines(rows):
            y = self._top + index * self._row_px
            painter.setPen(QPen(QColor(theme.MARK), 1.0, Qt.PenStyle.DashLine))
            painter.drawLine(QPointF(MARGIN, y), QPointF(width - MARGIN, y))
            painter.setPen(QColor(theme.MARK))
            label = f"✂ {stage_label(stage)}"
            lw = metrics.horizontalAdvance(label) + 6
            painter.fillRect(
                QRectF(width - MARGIN - value_w - lw, y - metrics.height() + 2, lw, metrics.height()),
                QColor(theme.BACKGROUND),
            )
            painter.drawText(QPointF(width - MARGIN - value_w - lw + 3, y - 3), label)

        hidden = len(self.rows) - shown
        if hidden > 0:
            painter.setPen(QColor(theme.MUTED))
            y = self._top + shown * self._row_px
            painter.drawText(
                QRectF(MARGIN, y, width - 2 * MARGIN, MIN_ROW_PX),
                Qt.AlignmentFlag.AlignCenter,
                f"+{hidden} more candidates (enlarge the panel)",
            )

    # ---- tooltip: every stage's probability for the hovered token ---------------------------
    def row_at(self, y: float) -> int | None:
        if not self.rows:
            return None
        index = int((y - self._top) // self._row_px)
        return index if 0 <= index < self.visible_row_count() else None

    def tooltip_for(self, index: int) -> str:
        row = self.rows[index]
        lines = [f"<b>{row.text}</b> (token id {row.token_id}){' — drawn' if row.drawn else ''}"]
        for name, p in zip(self.stage_names, row.stage_probs):
            lines.append(f"{stage_label(name)}: {percent(p)}")
        if row.removed_by:
            lines.append(f"removed by {stage_label(row.removed_by)}")
        if row.reference_prob is not None:
            lines.append(f"full-precision reference (raw): {percent(row.reference_prob)}")
        lines.append("<i>click to choose it, double-click to continue the reply from it</i>")
        return "<br>".join(lines)

    def mousePressEvent(self, event) -> None:  # noqa: N802 - Qt override
        index = self.row_at(event.position().y())
        if index is not None and event.button() == Qt.MouseButton.LeftButton:
            self.row_clicked.emit(index)
        super().mousePressEvent(event)

    def mouseDoubleClickEvent(self, event) -> None:  # noqa: N802 - Qt override
        index = self.row_at(event.position().y())
        if index is not None and event.button() == Qt.MouseButton.LeftButton:
            self.row_double_clicked.emit(index)

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            index = self.row_at(event.pos().y())
            if index is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), self.tooltip_for(index), self)
            return True
        return super().event(event)
