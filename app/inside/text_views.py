"""Scoring a pasted text and steering the pinned token's distribution: the panels' questions asked
of the engine (EngineClient.score_text, read_control_vector, contrast_vector, steer), one at a
time, the newest waiting (app.inside.latest)."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Slot
from PySide6.QtWidgets import QFileDialog, QWidget

from app.engine_host import EngineHost
from app.inside.latest import LatestCall
from app.inside.token_views import PinnedToken, cost_text
from engine.inside import ControlVector, Steered, TextScore
from widgets.score_view import ScorePanel
from widgets.steering_view import SteeringPanel


class ScoreController(QObject):
    def __init__(self, host: EngineHost, panel: ScorePanel, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.host, self.panel = host, panel
        self._scoring = LatestCall(host, "scoring a text", self)
        panel.score_requested.connect(self.score)

    @Slot(str)
    def score(self, text: str) -> None:
        self._scoring.ask(lambda engine: engine.score_text(text), self._show, self.panel.show_error)

    def _show(self, score: TextScore) -> None:
        started = time.perf_counter()
        self.panel.show_score(score)
        self.panel.tokens.repaint()
        self.panel.summary.setText(
            self.panel.summary.text() + cost_text(score.seconds, time.perf_counter() - started)
        )


class SteeringController(QObject):
    def __init__(
        self,
        host: EngineHost,
        panel: SteeringPanel,
        token: Callable[[], PinnedToken | None],
        dialog_parent: QWidget,
        parent: QObject | None = None,
    ) -> None:
        """`token()`: the pinned token whose distribution is steered (None: none pinned)."""
        super().__init__(parent)
        self.host, self.panel, self.token, self.dialog_parent = host, panel, token, dialog_parent
        self._vector_call = LatestCall(host, "a control vector", self)
        self._steer_call = LatestCall(host, "steering", self)
        panel.load_requested.connect(self.choose_file)
        panel.contrast_requested.connect(self.contrast)
        panel.steer_requested.connect(self.steer)

    @Slot()
    def choose_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self.dialog_parent,
            "Load a control vector",
            "",
            "llama.cpp control vectors (*.gguf);;All files (*)",
        )
        if path:
            self.load(path)

    def load(self, path: str) -> None:
        self.panel.show_waiting(f"reading {path} …")
        self._vector_call.ask(
            lambda engine: engine.read_control_vector(path), self._loaded, self.panel.show_error
        )

    @Slot(str, str)
    def contrast(self, positive: str, negative: str) -> None:
        self._vector_call.ask(
            lambda engine: engine.contrast_vector(positive, negative), self._loaded, self.panel.show_error
        )

    def _loaded(self, vector: ControlVector) -> None:
        self.panel.set_vector(vector)  # asks for the distribution with it (steer_requested)

    @Slot(object, float)
    def steer(self, layer: int | None, strength: float) -> None:
        vector, token = self.panel.vector, self.token()
        if vector is None:
            return
        if token is None:
            self.panel.show_waiting("Pin a token of a reply (click it): its distribution is the one steered.")
            return
        self.panel.show_waiting("computing the steered distribution on the engine…")
        self._steer_call.ask(
            lambda engine: engine.steer(token.request, token.output_ids, vector, layer, strength),
            lambda steered: self._show(steered, token),
            self.panel.show_error,
        )

    def _show(self, steered: Steered, token: PinnedToken) -> None:
        started = time.perf_counter()
        self.panel.show_steered(steered, token.text)
        self.panel.status.setText(
            self.panel.status.text() + cost_text(steered.seconds, time.perf_counter() - started)
        )

    def token_changed(self) -> None:
        """Another token pinned: its distribution, steered as set."""
        if self.panel.vector is not None:
            self.steer(self.panel.layer_value(), self.panel.strength_value())
