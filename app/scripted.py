"""A scripted session: wait for the model, send one prompt through the chat, wait for the whole
reply, save a screenshot of the window and (optionally) quit with a status code.

It drives the same objects a person does (the chat controller, the engine host, the panels), so
it doubles as the end-to-end check of the app's own path.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal, Slot
from PySide6.QtWidgets import QApplication

from app.window import MainWindow
from live.state import DIRTY_KEYS

# After the reply ends, let this many milliseconds of render and status ticks pass so every
# panel (and the status bar's slow timer) has drawn the final state before the capture.
SETTLE_MS = 800


def most_uncertain_token(tokens) -> int | None:
    """Index of the reply token whose final distribution had the highest entropy: the most
    telling one to show in the probability panel of a screenshot."""
    best, best_entropy = None, -math.inf
    for tok in tokens:
        if tok.snapshot is not None and tok.snapshot.entropy > best_entropy:
            best, best_entropy = tok.index, tok.snapshot.entropy
    return best


def most_cut_token(tokens) -> int | None:
    """Under a grammar: the token where its mask took the most of the raw mass while leaving a
    choice (not forced), the one that shows the grammar's stage best."""
    best, best_removed = None, -1.0
    for tok in tokens:
        g = tok.snapshot.grammar if tok.snapshot is not None else None
        if g is not None and g.allowed > 1 and g.removed_mass > best_removed:
            best, best_removed = tok.index, g.removed_mass
    return best


class ScriptedRun(QObject):
    """Emits `done(exit_code)` once; the entry point connects it to the application's exit
    (left to the caller so that tests can run a script without ending their Qt application)."""

    done = Signal(int)

    def __init__(
        self,
        window: MainWindow,
        prompt: str,
        screenshot: Path | None,
        quit_after_reply: bool,
        timeout_s: float,
        parent: QObject | None = None,
    ):
        super().__init__(parent)
        self.window = window
        self.prompt = prompt
        self.screenshot = screenshot
        self.quit_after_reply = quit_after_reply
        self.exit_code = 0
        self.request_id: int | None = None
        self._sent = False
        self.reply: str | None = None
        self.finished = False
        host = window.host
        host.model_loaded.connect(self._on_loaded)
        host.model_load_failed.connect(self._on_load_failed)
        host.request_finished.connect(self._on_request_finished)
        host.request_failed.connect(self._on_request_failed)
        self._deadline = QTimer(self)
        self._deadline.setSingleShot(True)
        self._deadline.setInterval(round(timeout_s * 1000))
        self._deadline.timeout.connect(self._on_timeout)
        self._deadline.start()

    # ---- steps -----------------------------------------------------------------------------
    @Slot(object)
    def _on_loaded(self, _event) -> None:
        if self.request_id is not None or self._sent:
            return
        self._sent = True
        controller = self.window.controller
        controller.new_conversation()
        # The chat measures the prompt against the context on the engine thread first: the
        # request id arrives with reply_started (or the reason with reply_refused).
        controller.reply_started.connect(self._on_reply_started)
        controller.reply_refused.connect(self._on_reply_refused)
        if not controller.send(self.prompt):
            self._fail("the prompt could not be sent to the engine")

    @Slot(int)
    def _on_reply_started(self, request_id: int) -> None:
        if self.request_id is None:
            self.request_id = request_id

    @Slot(str)
    def _on_reply_refused(self, message: str) -> None:
        if self.request_id is None:
            self._fail(f"the prompt was not sent: {message}")

    @Slot(object)
    def _on_request_finished(self, event) -> None:
        if event.request_id != self.request_id:
            return
        self.reply = event.text
        if event.finish_reason == "cancelled":
            self._fail("the reply was cancelled before it finished")
            return
        view = self.window.host.live.requests.get(event.request_id)
        cut = most_cut_token(view.tokens) if view is not None else None
        index = cut if cut is not None else (most_uncertain_token(view.tokens) if view is not None else None)
        if index is not None:
            self.window.controller.inspect_token(event.request_id, index)
        if cut is not None:  # a reply under a grammar: the panel shows what its mask did
            self.window.panels.probabilities.select_stage("grammar")
        QTimer.singleShot(SETTLE_MS, self._capture)

    @Slot(object)
    def _on_request_failed(self, event) -> None:
        if event.request_id == self.request_id:
            self._fail(f"the reply failed: {event.message}")

    @Slot(str)
    def _on_load_failed(self, message: str) -> None:
        self._fail(f"the model failed to load: {message}")

    @Slot()
    def _on_timeout(self) -> None:
        stage = "the model to load" if self.request_id is None else "the reply"
        self._fail(f"gave up waiting for {stage} after {self._deadline.interval() / 1000:.0f} s")

    @Slot()
    def _capture(self) -> None:
        window = self.window
        window.host.render_tick()
        window.panels.refresh_all(set(DIRTY_KEYS))
        window.refresh_status()
        QApplication.processEvents()
        if self.screenshot is not None:
            self.screenshot.parent.mkdir(parents=True, exist_ok=True)
            if not window.grab().save(str(self.screenshot)):
                self._fail(f"could not write the screenshot to {self.screenshot}")
                return
            print(f"kvscope: screenshot saved to {self.screenshot}", file=sys.stderr)
        self._finish(0)

    # ---- ending ----------------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        print(f"kvscope: {message}", file=sys.stderr)
        self._finish(1)

    def _finish(self, code: int) -> None:
        if self.finished:
            return
        self.finished = True
        self.exit_code = code
        self._deadline.stop()
        if self.quit_after_reply or code != 0:
            self.window.close()
            self.done.emit(code)
