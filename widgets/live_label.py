"""A rich-text label for figures that change several times a second.

QLabel.setText always asks the parent layout to recompute (updateGeometry): with word wrap that
means measuring the text again, and inside a dock it re-runs the dock's and the main window's
layout. For a readout that changes every frame during generation that was ~15% of the GUI
thread's time (py-spy over `python -m tools.measure_app`). LiveLabel lays its text out once per
change and asks for a new layout only when its height changes; otherwise it just repaints.

It stays a QLabel so the panels' style sheets (colour, background) apply to it as before.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QSize
from PySide6.QtGui import QAbstractTextDocumentLayout, QPainter, QPalette, QTextDocument
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


class LiveLabel(QLabel):
    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._html = ""
        self._doc = QTextDocument(self)
        self._doc.setDocumentMargin(0)
        self._height = 0
        policy = QSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        policy.setHeightForWidth(True)
        self.setSizePolicy(policy)
        self.setText(text)

    # ---- QLabel's text API, without QLabel's relayout -------------------------------------
    def setText(self, text: str) -> None:  # noqa: N802 - QLabel's name
        if text == self._html:
            return
        self._html = text
        self._doc.setDefaultFont(self.font())
        self._doc.setHtml(text)
        self._relayout()
        self.update()

    def text(self) -> str:
        return self._html

    # ---- geometry --------------------------------------------------------------------------
    def hasHeightForWidth(self) -> bool:  # noqa: N802 - Qt override
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802 - Qt override
        self._doc.setTextWidth(max(1, width))
        height = math.ceil(self._doc.size().height())
        self._doc.setTextWidth(max(1, self.width()))
        return height

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt override
        return QSize(max(1, math.ceil(self._doc.idealWidth())), self._height)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt override
        return QSize(0, self._height)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._relayout()

    def _relayout(self) -> None:
        self._doc.setTextWidth(max(1, self.width()))
        height = math.ceil(self._doc.size().height()) if self._html else 0
        if height != self._height:
            self._height = height
            self.updateGeometry()

    # ---- painting --------------------------------------------------------------------------
    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().paintEvent(event)  # background and frame from the style sheet (QLabel's own text is empty)
        painter = QPainter(self)
        context = QAbstractTextDocumentLayout.PaintContext()
        context.palette.setColor(QPalette.ColorRole.Text, self.palette().color(QPalette.ColorRole.WindowText))
        self._doc.documentLayout().draw(painter, context)
        painter.end()
