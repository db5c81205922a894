"""Wires speculative decoding into the window: the controls' Apply restarts the engine with the
chosen SpeculativeConfig (keeping the loaded model), the chat's draft marks and the panel read
the live state, and "Measure speedup" replays the conversation's last prompt on a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from PySide6.QtCore import QObject, Slot

from app.speculation.measure import measure_speedup
from engine.config import EngineConfig, SpeculativeConfig
from engine.request import ChatMessage, Request
from widgets.background_job import BackgroundJob

JOIN_TIMEOUT_S = 60.0  # a measurement is two short generations; closing waits for it


class SpeculationController(QObject):
    def __init__(self, window, start_engine: Callable[..., None], parent: QObject | None = None):
        super().__init__(parent)
        self.host = window.host
        self.chat = window.controller
        self.sampling = window.controls.sampling
        self.controls = window.controls.speculation
        self.panel = window.panels.speculation
        self._start_engine = start_engine
        self.applied: SpeculativeConfig | None = None  # what the running engine was started with
        self.job = BackgroundJob("kvscope-speculation", self)
        self.job.progress.connect(self.panel.set_measuring)
        self.job.succeeded.connect(self._on_measured)
        self.job.failed.connect(self._on_measure_failed)
        self.job.cancelled.connect(lambda: self.panel.set_measuring(None))
        self.controls.apply_requested.connect(self.apply)
        self.panel.measure_requested.connect(self.measure)
        self.chat.token_inspected.connect(self.panel.show_token)
        self.host.model_loaded.connect(self._on_model_loaded)
        live = self.host.live

        def mark_of(request_id: int, index: int) -> str:
            token = live.token(request_id, index)
            return token.spec if token is not None else ""

        self._mark_of = mark_of
        window.chat.set_spec_mark_source(mark_of)
        # Extra chat tabs: their tokens select rounds too, and each new tab's pane shows marks.
        self._tabs = getattr(window, "chat_tabs", None)
        if self._tabs is not None:
            self._tabs.token_inspected.connect(self.panel.show_token)
            self._tabs.currentChanged.connect(self._mark_every_tab)

    @Slot()
    def _mark_every_tab(self, _index: int = 0) -> None:
        for controller in self._tabs.controllers:
            controller.pane.set_spec_mark_source(self._mark_of)  # unchanged panes do not redraw

    def with_speculation(self, config: EngineConfig) -> EngineConfig:
        """A model load keeps the speculation last applied."""
        return replace(config, speculative=self.applied)

    @Slot(object)
    def apply(self, spec: SpeculativeConfig | None) -> None:
        """Restart the engine with `spec`, reusing the loaded model when there is one."""
        self.applied = spec
        if self.host.config is None:
            return  # no engine yet: the next model load starts with it
        loaded = self._loaded_model()
        if self.chat.active is not None:
            self.chat.stop()
        self._start_engine(replace(self.host.config, speculative=spec), loaded=loaded)

    def _loaded_model(self):
        engine = self.host.engine
        if engine is None or not self.host.status().ready or engine.core is None:
            return None
        return engine.core.loaded

    @Slot(object)
    def _on_model_loaded(self, _event) -> None:
        tokenizer = self.host.engine.tokenizer if self.host.engine is not None else None
        if tokenizer is not None:
            self.panel.set_token_text(lambda token_id: tokenizer.decode([token_id]))

    # ---- speedup ---------------------------------------------------------------------------
    def replay_request(self) -> Request | None:
        """The conversation up to its last user message, under the current sampling settings."""
        conv = self.chat.conversation
        if conv is None:
            return None
        messages = [ChatMessage(m.role, m.content) for m in conv.messages if m.content]
        while messages and messages[-1].role != "user":
            messages.pop()
        if not messages:
            return None
        system = self.chat.pane.system_prompt.toPlainText().strip()
        head = (ChatMessage("system", system),) if system else ()
        return Request(messages=head + tuple(messages), sampling=self.sampling.params())

    @Slot()
    def measure(self) -> None:
        if self.job.running:
            return
        spec = self.applied
        loaded = self._loaded_model()
        request = self.replay_request()
        if spec is None:
            self.panel.show_measure_error("speculation is off: choose a proposer and apply it first")
            return
        if loaded is None:
            self.panel.show_measure_error("no model is loaded")
            return
        if request is None:
            self.panel.show_measure_error("send a message first: the measurement replays your last prompt")
            return
        config = self.host.config
        self.panel.set_measuring("starting")
        self.job.start(lambda progress: measure_speedup(loaded, config, spec, request, progress))

    @Slot(object)
    def _on_measured(self, result) -> None:
        self.panel.set_measuring(None)
        self.panel.show_speedup(result)

    @Slot(str)
    def _on_measure_failed(self, message: str) -> None:
        self.panel.set_measuring(None)
        self.panel.show_measure_error(message)

    def shutdown(self) -> None:
        self.job.cancel()
        self.job.wait(JOIN_TIMEOUT_S)
