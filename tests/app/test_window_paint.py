"""The window paints outside Python: no Python frame of the window's own code wraps Qt's paint of
its widgets. Python around a paint holds the interpreter's lock for all of it (Qt paints every
widget under the window inside the window's event), and the engine's thread needs that lock
between its kernels: a `MainWindow.event` override held it through every frame's paint."""

from __future__ import annotations

import sys

from PySide6.QtGui import QPaintEvent
from PySide6.QtWidgets import QWidget


class _StackProbe(QWidget):
    """Records, at each of its paints, the files of the Python frames beneath the paint."""

    def __init__(self) -> None:
        super().__init__()
        self.setMinimumSize(20, 20)
        self.stacks: list[list[str]] = []

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 - Qt's name
        frame, files = sys._getframe(1), []
        while frame is not None:
            files.append(frame.f_code.co_filename)
            frame = frame.f_back
        self.stacks.append(files)


def test_no_python_of_the_window_wraps_a_paint_of_its_widgets(make_window, qtbot):
    window = make_window(start=False)
    probe = _StackProbe()
    window.statusBar().addPermanentWidget(probe)
    qtbot.waitUntil(lambda: probe.stacks != [])  # painted with the window, from the event loop
    probe.stacks.clear()
    window.update()  # the whole window again
    qtbot.waitUntil(lambda: probe.stacks != [])
    for files in probe.stacks:
        wrapping = [f for f in files if f.replace("\\", "/").endswith("app/window.py")]
        assert wrapping == [], f"Python of the window under a widget's paint: {wrapping}"
