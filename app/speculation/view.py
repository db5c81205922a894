"""Wires speculative decoding into the window: the controls' Apply restarts the engine with the
chosen SpeculativeConfig (keeping the loaded model), the chat's draft marks and the panel read
the live state, the panel's draft texts are decoded by the engine's tokenizer on the engine
thread, and "Measure speedup" replays the conversation's last prompt there too (EngineClient.measure_speedup,
engine.core.speedup): the engine's model is the engine thread's, so nothing else runs on it
meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from PySide6.QtCore import QObject, Signal, Slot

from app.chat.controller import ChatController
from app.chat.tabs import ChatTabs
from app.engine_host import EngineHost
from app.sampling_controls import SamplingControls
from app.speculation.controls import SpeculationControls
from app.workers import EngineCall
from engine.api import SpeedupResult
from engine.config import EngineConfig, SpeculativeConfig
from engine.request import ChatMessage, Request
from widgets.speculation_panel import SpeculationPanel

JOIN_TIMEOUT_S = 60.0  # a measurement is two short generations; closing waits for it


class SpeculationController(QObject):
    measured = Signal(object)  # SpeedupResult, once shown

    def __init__(
        self,
        host: EngineHost,
        chat: ChatController,
        tabs: ChatTabs | None,
        sampling: SamplingControls,
        controls: SpeculationControls,
        panel: SpeculationPanel,
        start_engine: Callable[..., None],
        parent: QObject | None = None,
    ):
        super().__init__(parent)
        self.host, self.chat, self.sampling, self.controls, self.panel = host, chat, sampling, controls, panel
        self._start_engine = start_engine
        self.applied: SpeculativeConfig | None = None  # what the running engine was started with
        self.call: EngineCall | None = None  # the speedup measurement in flight
        self.controls.apply_requested.connect(self.apply)
        self.panel.measure_requested.connect(self.measure)
        self.panel.texts_needed.connect(self._decode)
        self.chat.token_inspected.connect(self.panel.show_token)
        self.host.model_loaded.connect(self._on_model_loaded)
        live = self.host.live

        def mark_of(request_id: int, index: int) -> str:
            token = live.token(request_id, index)
            return token.spec if token is not None else ""

        self._mark_of = mark_of
        chat.pane.set_spec_mark_source(mark_of)
        # Extra chat tabs: their tokens select rounds too, and each new tab's pane shows marks.
        self._tabs = tabs
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
        """Restart the engine with `spec`, reusing the loaded model when there is one (asked of
        the engine thread, which holds it)."""
        self.applied = spec
        config = self.host.config
        if config is None:
            return  # no engine yet: the next model load starts with it
        if self.chat.active is not None:
            self.chat.stop()
        restart = replace(config, speculative=spec)
        if not self.host.status().ready:
            self._start_engine(restart)  # nothing loaded to keep: load again
            return
        call = self.host.ask(lambda engine: engine.loaded_model(), name="the loaded model")
        call.returned.connect(lambda loaded: self._start_engine(restart, loaded=loaded))
        call.errored.connect(lambda _message: self._start_engine(restart))

    @Slot(object)
    def _on_model_loaded(self, _event) -> None:
        self.panel.clear_token_texts()

    @Slot(object)
    def _decode(self, token_ids: tuple[int, ...]) -> None:
        """The draft tokens' texts, decoded by the engine's own tokenizer on its thread."""
        call = self.host.ask(lambda engine: engine.tokens_of(token_ids), name="draft texts")
        call.returned.connect(
            lambda tokens: self.panel.add_token_texts(
                {i: t.texts[0] for i, t in zip(token_ids, tokens, strict=True)}
            )
        )

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
        if self.call is not None and self.call.running:
            return
        spec = self.applied
        request = self.replay_request()
        config = self.host.config
        if spec is None:
            self.panel.show_measure_error("speculation is off: choose a proposer and apply it first")
            return
        if config is None or not self.host.status().ready:
            self.panel.show_measure_error("no model is loaded")
            return
        if request is None:
            self.panel.show_measure_error("send a message first: the measurement replays your last prompt")
            return
        self.panel.set_measuring("starting (replies wait until it is done)")
        self.call = self.host.ask(
            lambda engine, progress: engine.measure_speedup(request, spec, progress),
            name="speedup",
            progress=True,
        )
        self.call.progress.connect(self.panel.set_measuring)
        self.call.returned.connect(self._on_measured)
        self.call.errored.connect(self._on_measure_failed)
        self.call.cancelled.connect(lambda: self.panel.set_measuring(None))

    @Slot(object)
    def _on_measured(self, result: SpeedupResult) -> None:
        self.panel.set_measuring(None)
        self.panel.show_speedup(result)
        self.measured.emit(result)

    @Slot(str)
    def _on_measure_failed(self, message: str) -> None:
        self.panel.set_measuring(None)
        self.panel.show_measure_error(message)

    def shutdown(self) -> None:
        if self._tabs is not None:  # the tabs may emit while the closed window is torn down
            self._tabs.currentChanged.disconnect(self._mark_every_tab)
        if self.call is not None:
            self.call.cancel()
            self.call.wait(JOIN_TIMEOUT_S)
