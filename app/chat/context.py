"""The chat controller's context meter: the conversation and the message being typed counted by
the engine (a quarter second after the typing pauses), the reply's tokens as they stream, the
KV pool's fill at every step.

A mixin of ChatController (app.chat.controller).
"""

from __future__ import annotations

from app.chat.reply_state import ReplyPlan
from engine.api import ContextFit

MEASURE_DELAY_MS = 250  # after the last keystroke: one count per pause, not per key


class ContextTracking:
    def schedule_measure(self) -> None:
        """Count the conversation and the draft again soon (the text, path or model changed)."""
        self._measure_timer.start()

    def measure_now(self) -> None:
        if self.busy:
            return  # the reply's own counts are shown while it runs
        if self._measuring:
            self._measure_again = True
            return
        if not self.host.status().ready:
            self.pane.meter.show_unavailable("no model loaded")
            return
        if not self.calls.local:
            self.pane.meter.show_unavailable("not counted here: the engine runs on a server")
            return
        draft = self.pane.input.toPlainText().strip()
        conv = self.conversation
        editing = conv.nodes.get(self._editing_id) if conv and self._editing_id is not None else None
        history = list(conv.messages) if conv else []
        if editing is not None and editing in history:
            history = history[: history.index(editing)]
        plan = ReplyPlan("send", history, self._sampling(), user_text=draft)
        head, before, tail, _ = self._prompt_parts(plan)
        tail = tail if draft else []
        policy, max_new = self.context_policy(), plan.sampling.max_new_tokens

        self._measuring = True
        self.calls.ask(
            lambda engine: engine.fit_context(head, before, tail, max_new, policy),
            self._on_measured,
            self._on_measure_failed,
        )

    def _on_measured(self, fit: ContextFit) -> None:
        self._measuring = False
        if self._measure_again:
            self._measure_again = False
            self.measure_now()
            return
        if not self.busy:
            self.show_measured(fit)

    def _on_measure_failed(self, message: str) -> None:
        self._measuring = self._measure_again = False
        self.pane.meter.show_unavailable(message)

    def show_measured(self, fit: ContextFit) -> None:
        self.last_fit = fit
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
        fit = self.last_fit
        need = fit.prompt_tokens + self.pane.meter.generated if fit is not None else None
        if stats is not None:
            self.pane.meter.show_pool(stats.used_slots, stats.num_blocks * stats.block_size, need)
        elif live.loaded is not None:
            self.pane.meter.show_pool(0, live.loaded.kv_num_blocks * live.loaded.kv_block_size, need)
