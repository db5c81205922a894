"""A row of widgets that wraps onto further lines when it is narrower than the whole row: a window
on a small screen (960x540 logical, a 1920x1080 screen at 200%) keeps every button whole and in
reach instead of holding the window wider than the screen."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtWidgets import QLayout, QLayoutItem, QWidget, QWidgetItem


class FlowRow(QLayout):
    """Left to right, then onto the next line: as wide as its widest item at the least (its
    minimum width), one line where there is room (its size hint), and as tall as the lines it
    needs at a given width (height for width, so the layout above it makes room)."""

    def __init__(self, parent: QWidget | None = None, spacing: int = 6):
        super().__init__(parent)
        self._items: list[QLayoutItem] = []
        self.one_line = False  # True: no wrapping, at least the whole row wide
        self.setContentsMargins(0, 0, 0, 0)
        self.setSpacing(spacing)

    def addItem(self, item: QLayoutItem) -> None:  # noqa: N802 - Qt's name
        self._items.append(item)

    def add_widgets(self, *widgets: QWidget) -> None:
        for widget in widgets:
            self.addChildWidget(widget)
            self.addItem(QWidgetItem(widget))

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int) -> QLayoutItem | None:  # noqa: N802 - Qt's name
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int) -> QLayoutItem | None:  # noqa: N802 - Qt's name
        return self._items.pop(index) if 0 <= index < len(self._items) else None

    def expandingDirections(self) -> Qt.Orientation:  # noqa: N802 - Qt's name
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:  # noqa: N802 - Qt's name
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802 - Qt's name
        return self._place(QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QRect) -> None:  # noqa: N802 - Qt's name
        super().setGeometry(rect)
        needed = self._place(rect, move=True)
        # The lines it needs at this width as its widget's least height: a box layout above it
        # squeezed by a short window otherwise gives it one line, and the second is drawn over
        # whatever is below (the chat's tools row over its transcript at 960x540).
        owner = self.parentWidget()
        if owner is not None and owner.layout() is self and owner.minimumHeight() != needed:
            owner.setMinimumHeight(needed)

    def _shown(self) -> list[QLayoutItem]:
        return [item for item in self._items if not item.isEmpty()]  # a hidden widget takes no room

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        """All on one line."""
        hints = [item.sizeHint() for item in self._shown()]
        width = sum(h.width() for h in hints) + self.spacing() * max(0, len(hints) - 1)
        return QSize(width, max((h.height() for h in hints), default=0))

    def minimumSize(self) -> QSize:  # noqa: N802 - Qt's name
        """The widest item: the rest go onto lines of their own (unless `one_line`)."""
        if self.one_line:
            return self.sizeHint()
        size = QSize()
        for item in self._shown():
            size = size.expandedTo(item.minimumSize())
        return size

    def _place(self, rect: QRect, move: bool) -> int:
        """Lay the items out in lines within `rect` (moving them when `move`, each centred in its
        line's height); the height the lines take."""
        lines: list[list[QLayoutItem]] = [[]]
        x = 0
        for item in self._shown():
            width = item.sizeHint().width()
            if lines[-1] and x + width > rect.width():  # this line is full: the next one
                lines.append([])
                x = 0
            lines[-1].append(item)
            x += width + self.spacing()
        y = rect.y()
        for line in lines:
            height = max((item.sizeHint().height() for item in line), default=0)
            x = rect.x()
            for item in line:
                hint = item.sizeHint()
                if move:
                    top = y + (height - hint.height()) // 2
                    item.setGeometry(
                        QRect(QPoint(x, top), QSize(min(hint.width(), rect.width()), hint.height()))
                    )
                x += hint.width() + self.spacing()
            y += height + self.spacing()
        return max(0, y - self.spacing() - rect.y())
