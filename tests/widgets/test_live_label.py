"""LiveLabel: QLabel's text API, but a change of text relayouts the parent only when the
label's height changes."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from widgets.live_label import LiveLabel


class LayoutRequests(QObject):
    def __init__(self):
        super().__init__()
        self.count = 0

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.LayoutRequest:
            self.count += 1
        return False


def test_same_height_changes_only_repaint_and_a_taller_text_relayouts(qtbot):
    parent = QWidget()
    qtbot.addWidget(parent)
    label = LiveLabel("tokens/s <b>12.3</b>")
    layout = QVBoxLayout(parent)
    layout.addWidget(label)
    layout.addStretch(1)  # as in the panels: the plot below takes the spare height
    parent.resize(240, 200)
    parent.show()
    qtbot.waitExposed(parent)
    qtbot.wait(50)  # the first layout passes of a new window settle
    one_line = label.height()
    requests = LayoutRequests()
    parent.installEventFilter(requests)

    for value in ("12.4", "13.0", "9.8"):
        label.setText(f"tokens/s <b>{value}</b>")
        qtbot.wait(5)
    assert label.text() == "tokens/s <b>9.8</b>"
    assert requests.count == 0

    # A plain QLabel asks for a new layout on every change (what LiveLabel avoids).
    layout.addWidget(plain := QLabel("12.3"))
    qtbot.wait(50)
    requests.count = 0
    plain.setText("12.4")
    qtbot.wait(5)
    assert requests.count >= 1
    requests.count = 0

    label.setText(" ".join(["a long readout that wraps"] * 8))
    qtbot.waitUntil(lambda: label.height() > one_line)
    assert requests.count >= 1
    assert label.heightForWidth(label.width()) == label.height()
