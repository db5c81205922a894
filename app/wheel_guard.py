"""The mouse wheel scrolls panes; it changes a value only in the field the user is working in.

Qt turns a combo box, spin box or slider under the pointer with every wheel notch, so scrolling
the Controls dock past the model section once switched the weights scheme from auto to bnb-fp4.
One application-wide event filter (installed once, on the QApplication) applies the usual remedy
to every such widget the app makes, in docks and dialogs alike:

- each one, when first polished, takes focus by click or Tab only (StrongFocus), never by the
  wheel (Qt's default WheelFocus would focus it on the first notch, and the next would turn it);
- a wheel event over one that does not have focus never reaches it: it goes to the nearest
  scrolling pane around it, which scrolls as if the pointer were over its empty background.

A focused field still takes the wheel, as the user asked for by clicking into it.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QAbstractSlider,
    QAbstractSpinBox,
    QApplication,
    QComboBox,
    QScrollBar,
    QWidget,
)

# The widgets whose value a wheel notch changes (a scroll bar's value is the scrolling itself).
GUARDED = (QComboBox, QAbstractSpinBox, QAbstractSlider)


def is_guarded(widget: QObject) -> bool:
    return isinstance(widget, GUARDED) and not isinstance(widget, QScrollBar)


class WheelGuard(QObject):
    """The filter itself; `install_wheel_guard` puts one on the application."""

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt's name
        kind = event.type()
        if kind == QEvent.Type.Polish and is_guarded(watched):
            assert isinstance(watched, QWidget)
            if watched.focusPolicy() == Qt.FocusPolicy.WheelFocus:
                watched.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
            return False
        if kind != QEvent.Type.Wheel or not isinstance(watched, QWidget):
            return False
        field = _guarded_owner(watched)
        if field is None or field.hasFocus():
            return False
        area = _scroll_area_around(field)
        if area is not None:
            # sent to the pane's viewport, the notch scrolls the pane and nothing else
            QApplication.sendEvent(area.viewport(), event)
        event.accept()
        return True


def _guarded_owner(widget: QWidget) -> QWidget | None:
    """The combo box, spin box or slider `widget` belongs to (a spin box's line edit, a combo's
    own editor), or None."""
    w: QWidget | None = widget
    while w is not None and not w.isWindow():
        if is_guarded(w):
            return w
        w = w.parentWidget()
    return None


def _scroll_area_around(widget: QWidget) -> QAbstractScrollArea | None:
    """The nearest scrolling pane holding `widget` whose scroll bars can move; None when none does
    (a field in a plain dialog: the notch does nothing)."""
    w = widget.parentWidget()
    while w is not None:
        if isinstance(w, QAbstractScrollArea) and not is_guarded(w):
            bars = (w.verticalScrollBar(), w.horizontalScrollBar())
            if any(bar.maximum() > bar.minimum() for bar in bars):
                return w
        if w.isWindow():
            return None
        w = w.parentWidget()
    return None


def install_wheel_guard(app: QApplication | None = None) -> WheelGuard:
    """The application's guard, installed on first call (later calls return the same one)."""
    app = app or QApplication.instance()
    assert isinstance(app, QApplication), "the wheel guard needs the QApplication"
    guard = app.findChild(WheelGuard, "kvscopeWheelGuard")
    if guard is None:
        guard = WheelGuard(app)
        guard.setObjectName("kvscopeWheelGuard")
        app.installEventFilter(guard)
    return guard
