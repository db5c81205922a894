"""Answers the probability panel's what-ifs: a token's stages under other settings, recomputed
exactly on the engine thread (EngineClient.what_if) from the request the host remembers and the
reply's tokens before it (its TokenGenerated events); the banner says on which logits (the step's
own, kept for the token, or recomputed through the engine's paged forward).

One recomputation runs at a time; while it runs, only the latest question waits (a slider
dragged through ten values costs two recomputations at most, and the engine keeps the tokens'
logits, so each re-runs only the stages).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Slot

from app.engine_host import EngineHost
from app.workers import EngineCall
from engine.api import what_if_notes
from engine.config import SamplingParams
from widgets.probability_panel import ProbabilityPanel

Question = tuple[int, int, SamplingParams]  # request id, token index, settings


class WhatIfController(QObject):
    def __init__(self, host: EngineHost, panel: ProbabilityPanel, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.host, self.panel = host, panel
        self.call: EngineCall | None = None
        self._waiting: Question | None = None
        panel.what_if_requested.connect(self.ask)

    @Slot(int, int, object)
    def ask(self, request_id: int, index: int, params: SamplingParams) -> None:
        self._waiting = (request_id, index, params)
        if self.call is None or not self.call.running:
            self._next()

    def _next(self) -> None:
        question, self._waiting = self._waiting, None
        if question is None:
            return
        request_id, index, params = question
        request = self.host.request(request_id)
        view = self.host.live.requests.get(request_id)
        token = self.host.live.token(request_id, index)
        if request is None or view is None or token is None or token.snapshot is None:
            self.panel.show_what_if(*question, None, "this token's request is no longer known to the engine")
            self._next()
            return
        output_ids = [t.token_id for t in view.tokens[:index]]
        recorded = token.snapshot
        self.call = self.host.ask(
            lambda engine: engine.what_if(request, output_ids, recorded, params), name="what-if"
        )
        notes = what_if_notes(params)
        self.call.returned.connect(
            lambda answer: self.panel.show_what_if(*question, answer.snapshot, "", notes, answer.how)
        )
        self.call.errored.connect(lambda message: self.panel.show_what_if(*question, None, message))
        self.call.finished.connect(self._next)
