"""FlowRow: a row of buttons that wraps holds the height of its lines, so a box layout squeezed by
a short window shrinks what is below it rather than drawing the second line over it."""

from PySide6.QtWidgets import QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from widgets.flow_row import FlowRow


def test_a_wrapped_row_keeps_the_height_of_its_lines_in_a_squeezed_column(qtbot):
    column = QWidget()
    qtbot.addWidget(column)
    layout = QVBoxLayout(column)
    row = QWidget()
    buttons = [QPushButton(f"a button named {i}") for i in range(4)]
    FlowRow(row).add_widgets(*buttons)
    below = QPlainTextEdit()
    below.setMinimumHeight(10)
    layout.addWidget(row)
    layout.addWidget(below, 1)
    one_line = max(b.sizeHint().height() for b in buttons)
    column.resize(buttons[0].sizeHint().width() + 30, 4 * one_line)  # a line per button, barely room
    column.show()
    qtbot.waitExposed(column)
    qtbot.waitUntil(lambda: row.minimumHeight() > 2 * one_line)  # the lines it needs at this width
    # the column lays out again with it: the row whole, and what is below it below it
    qtbot.waitUntil(lambda: row.geometry().bottom() < below.geometry().top())
    assert max(b.geometry().bottom() for b in buttons) < row.height(), "a line of the row lies outside it"
