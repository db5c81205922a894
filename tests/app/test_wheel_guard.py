"""The mouse wheel over a combo box, spin box or slider it has not been clicked into scrolls the pane
around it and leaves the value alone, in a plain scroll area and in the real Controls dock."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QDoubleSpinBox,
    QScrollArea,
    QSlider,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.wheel_guard import install_wheel_guard, is_guarded

NOTCH = -120  # one notch down


def wheel(widget: QWidget, notches: int = 1) -> None:
    centre = QPointF(widget.rect().center())
    for _ in range(notches):
        event = QWheelEvent(
            centre,
            QPointF(widget.mapToGlobal(centre.toPoint())),
            QPoint(0, 0),
            QPoint(0, NOTCH),
            Qt.MouseButton.NoButton,
            Qt.KeyboardModifier.NoModifier,
            Qt.ScrollPhase.NoScrollPhase,
            False,
        )
        QApplication.sendEvent(widget, event)


def value_of(widget: QWidget):
    return widget.currentIndex() if isinstance(widget, QComboBox) else widget.value()


def every_kind() -> list[QWidget]:
    combo = QComboBox()
    combo.addItems(["auto", "none", "int8", "bnb-fp4"])
    spin = QSpinBox()
    spin.setRange(0, 100)
    spin.setValue(50)
    double = QDoubleSpinBox()
    double.setRange(0.0, 2.0)
    double.setValue(1.0)
    slider = QSlider(Qt.Orientation.Horizontal)
    slider.setRange(0, 100)
    slider.setValue(50)
    return [combo, spin, double, slider]


@pytest.fixture
def pane(qtbot):
    install_wheel_guard()
    area = QScrollArea()
    area.setWidgetResizable(True)
    inner = QWidget()
    layout = QVBoxLayout(inner)
    fields = every_kind()
    for field in fields:
        layout.addWidget(field)
        layout.addSpacing(400)  # taller than the pane: it has somewhere to scroll
    area.setWidget(inner)
    area.resize(300, 300)
    qtbot.addWidget(area)
    area.show()
    qtbot.waitExposed(area)
    return area, fields


def test_the_wheel_scrolls_the_pane_over_each_kind_of_field(pane):
    area, fields = pane
    bar = area.verticalScrollBar()
    assert bar.maximum() > 0
    area.setFocus()  # shown, the first field would have the focus
    for field in fields:
        assert not field.hasFocus()
        before, scrolled = value_of(field), bar.value()
        wheel(field, notches=2)
        assert value_of(field) == before, type(field).__name__
        assert bar.value() > scrolled, f"the pane did not scroll over a {type(field).__name__}"
        assert field.focusPolicy() == Qt.FocusPolicy.StrongFocus  # a notch never focuses it


@pytest.mark.parametrize("index", range(4))
def test_a_field_clicked_into_takes_the_wheel(pane, qtbot, index):
    """The control: the same events do turn a focused field (so the check above can fail)."""
    area, fields = pane
    field = fields[index]
    area.ensureWidgetVisible(field)
    field.setFocus()
    qtbot.waitUntil(field.hasFocus)
    before = value_of(field)
    wheel(field)
    assert value_of(field) != before


def test_no_field_of_the_main_window_turns_under_the_wheel(make_window, qtbot):
    window = make_window(start=False)
    window.resize(1366, 768)
    controls = window.controls
    guarded = [w for w in controls.findChildren(QWidget) if is_guarded(w) and w.isVisibleTo(controls)]
    kinds = {type(w).__name__ for w in guarded}
    assert {"QComboBox", "QSpinBox", "QDoubleSpinBox"} <= kinds, kinds
    window.setFocus()
    for field in guarded:
        before = value_of(field)
        wheel(field, notches=3)
        assert value_of(field) == before, f"{field.objectName() or type(field).__name__} turned"
    assert controls.scroll.verticalScrollBar().value() > 0  # the notches scrolled the dock instead
    controls.model.wait_for_estimate()
