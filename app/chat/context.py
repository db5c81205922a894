"""The chat's context meter: the conversation and the message being typed counted by the engine
(a quarter second after the typing pauses; EngineClient.fit_context), the reply's tokens as they
stream, the KV pool's fill at every step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PySide6.QtCore import QObject, QTimer

from app.chat.reply_state import ReplyPlan, prompt_parts
from app.chat.session import ChatSession
from app.chat.view import ChatPane
from app.engine_calls import EngineCalls
from app.engine_host import EngineHost
from engine.api import ContextFit
from engine.config import SamplingParams
from engine.request import ToolSpec

MEASURE_DELAY_MS = 250  # after the last keystroke: one count per pause, not per key


class ContextTracking:
    def __init__(
        self,
        pane: ChatPane,
        host: EngineHost,
        calls: EngineCalls,
        session: ChatSession,
        sampling: Callable[[], SamplingParams],
        policy: Callable[[], str],
        parent: QObject,
        tools: Callable[[ReplyPlan], Sequence[ToolSpec]] = lambda _plan: (),
    ) -> None:
        self.pane, self.host, self.calls, self.session = pane, host, calls, session
        self._sampling, self._policy = sampling, policy
        self._tools = tools  # the tools a reply would offer: their rendering is in its prompt too
        self._measuring = self._again = False
        self._timer = QTimer(parent)
        self._timer.setSingleShot(True)
        self._timer.setInterval(MEASURE_DELAY_MS)
        self._timer.timeout.connect(self.measure_now)

    def schedule(self) -> None:
        """Count the conversation and the draft again soon (the text, path or model changed)."""
        self._timer.start()

    def measure_now(self) -> None:
        session = self.session
        if session.busy:
            return  # the reply's own counts are shown while it runs
        if self._measuring:
            self._again = True
            return
        meter = self.pane.meter
        if not self.host.status().ready:
            meter.show_unavailable("no model loaded")
            return
        if not self.calls.local:
            meter.show_unavailable("not counted here: the engine runs on a server")
            return
        draft = self.pane.input.toPlainText().strip()
        history = list(session.path)
        editing = session.editing
        if editing is not None and editing in history:
            history = history[: history.index(editing)]
        plan = ReplyPlan("send", history, self._sampling(), user_text=draft)
        head, before, tail, _ = prompt_parts(self.pane.system_prompt.toPlainText().strip(), plan)
        tail = tail if draft else []
        policy, max_new = self._policy(), plan.sampling.max_new_tokens
        tools = tuple(self._tools(plan))
        self._measuring = True
        self.calls.ask(
            lambda engine: engine.fit_context(head, before, tail, max_new, policy, tools=tools),
            self._on_measured,
            self._on_failed,
        )

    def _on_measured(self, fit: ContextFit) -> None:
        self._measuring = False
        if self._again:
            self._again = False
            self.measure_now()
            return
        if not self.session.busy:
            self.show_measured(fit)

    def _on_failed(self, message: str) -> None:
        self._measuring = self._again = False
        self.pane.meter.show_unavailable(message)

    def show_measured(self, fit: ContextFit) -> None:
        self.session.last_fit = fit
        self.pane.meter.show_fit(fit, fit.sent_tokens)
        self._show_pool()

    def show_generated(self, generated: int) -> None:
        self.pane.meter.show_generated(generated)

    def refresh_pool(self, dirty: set[str]) -> None:
        if "kv" in dirty or "model" in dirty:
            self._show_pool()

    def _show_pool(self) -> None:
        live = self.host.live
        stats = live.kv_stats
        fit = self.session.last_fit
        need = fit.prompt_tokens + self.pane.meter.generated if fit is not None else None
        if stats is not None:
            self.pane.meter.show_pool(stats.used_slots, stats.num_blocks * stats.block_size, need)
        elif live.loaded is not None:
            self.pane.meter.show_pool(0, live.loaded.kv_num_blocks * live.loaded.kv_block_size, need)
