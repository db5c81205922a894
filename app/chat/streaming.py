"""The chat controller's replies: from a plan, measured against the context limit on the engine
thread, to a request, then the engine's tokens streaming into the transcript and the database,
and the finished reply stored with its kept stats and settings.

Every reply goes the same way (a sent message, a regenerated or branched reply, a continued
one): `_prepare(plan)` asks the engine to count the prompt (app.chat.context_fit) and, for a
branch, to decode the chosen token after the prefix; `_launch` then stores the new messages
and submits the request, or says why it cannot (the context limit under the "refuse" setting).
A mixin of ChatController (app.chat.controller).
"""

from __future__ import annotations

from app.chat.context_fit import refusal
from app.chat.conversations import DEFAULT_TITLE, ReplyCheckpoint, StorageError, title_from
from app.chat.group_reply import GroupReply
from app.chat.reply_state import ActiveReply, ReplyPlan, ReplyRecord
from app.chat.reply_stats import KeptStats, with_reply_facts
from app.chat.rich_text import ReplyToken
from app.chat.tree import StoredMessage
from app.workers import gather
from engine.api import ContextFit
from engine.config import ConfigError
from engine.events import RequestFailed, RequestFinished, TokenGenerated
from engine.request import ChatMessage, Request


class ReplyStreaming:
    @property
    def busy(self) -> bool:
        """A reply is streaming, or one is being measured before it starts."""
        return self.active is not None or self.preparing is not None

    # ---- a plan, measured -------------------------------------------------------------------
    def _prompt_parts(self, plan: ReplyPlan):
        """(head, history, tail) as ChatMessages, and the stored messages behind `history`."""
        system = self.pane.system_prompt.toPlainText().strip()
        head = (ChatMessage("system", system),) if system else ()
        sent = [m for m in plan.history if m.content]
        if plan.kind == "send":
            tail_messages, before = [ChatMessage("user", plan.user_text)], sent
        else:
            tail_messages = [ChatMessage(m.role, m.content) for m in sent[-1:]]
            before = sent[:-1]
        history = [ChatMessage(m.role, m.content) for m in before]
        return head, history, tail_messages, before

    def _prepare(self, plan: ReplyPlan) -> bool:
        if self.busy:
            return False
        if not self.host.status().ready:
            self._refuse("No model is loaded: load one in the Controls panel first.")
            return False
        if not self.calls.local:
            return self._prepare_remote(plan)
        head, history, tail, _ = self._prompt_parts(plan)
        policy, prefix, chosen = self.context_policy(), plan.prefix_ids, plan.chosen
        before = prefix[: len(prefix) - len(chosen)]
        max_new = plan.sampling.max_new_tokens

        tail_is_new = plan.kind == "send"

        def ask(engine):
            fit = engine.fit_context(head, history, tail, max_new, policy, prefix, tail_is_new)
            return gather(fit, engine.decode(chosen, after=before)) if chosen else gather(fit)

        self.preparing = plan
        self.sync_state()
        self.calls.ask(
            ask, lambda answers: self._on_prepared(plan, *answers), lambda m: self._on_unprepared(plan, m)
        )
        return True

    def _prepare_remote(self, plan: ReplyPlan) -> bool:
        """A remote server: nothing here can count its tokens or decode them, so the whole
        conversation is sent as it is (the server applies its own limit and says so)."""
        if plan.prefix_ids:
            self._refuse(
                "Branching and continuing need the engine in this app (it continues from token ids)."
            )
            return False
        self.pane.meter.show_unavailable("not counted here: the engine runs on a server")
        self._launch(plan, None)
        return True

    def _on_prepared(self, plan: ReplyPlan, fit: ContextFit, chosen_text: str = "") -> None:
        if self.preparing is not plan:
            return
        self.preparing = None
        self.show_measured(fit)
        if not fit.fits:
            self._refuse(refusal(fit))
            return
        plan.prefix_text += chosen_text
        if plan.chosen and plan.prefix_tokens:
            last = plan.prefix_tokens[-1]
            plan.prefix_tokens[-1] = ReplyToken(last.index, chosen_text, last.logprob, last.request_id)
        self._launch(plan, fit)

    def _on_unprepared(self, plan: ReplyPlan, message: str) -> None:
        if self.preparing is plan:
            self.preparing = None
            self._refuse(f"Could not start the reply: {message}")

    def _refuse(self, message: str) -> None:
        """Nothing was sent; what the user typed stays in the input."""
        self.status_message.emit(message, "error")
        self.reply_refused.emit(message)
        self.sync_state()

    # ---- a plan, started ------------------------------------------------------------------
    def _launch(self, plan: ReplyPlan, fit: ContextFit | None) -> None:
        """Store and submit the plan; `fit` None: not measured (a remote server's engine)."""
        head, _, tail, before = self._prompt_parts(plan)
        dropped = fit.dropped if fit is not None else 0
        kept = before[dropped:]
        first_kept = plan.history.index(kept[0]) if kept else len(plan.history) - (plan.kind != "send")
        messages = head + tuple(ChatMessage(m.role, m.content) for m in kept) + tuple(tail)
        context = None
        if dropped:
            context = {"first_kept": first_kept, "prompt_tokens": fit.prompt_tokens, "limit": fit.limit}
        request_id = stored_user = None
        try:
            conv = self._conversation_for(plan)
            if plan.kind == "send":
                answered = stored_user = self._store_user_message(conv, plan)
            else:
                answered = plan.history[-1]
            request_id = self.host.submit(
                Request(messages=messages, sampling=plan.sampling, reply_prefix_ids=plan.prefix_ids)
            )
            if plan.target is not None:
                msg = plan.target
                conv.show(msg.id)
            else:
                msg = self.store.add_message(
                    conv.id,
                    "assistant",
                    plan.prefix_text,
                    model=self.host.model_name,
                    parent_id=answered.id,
                    token_ids=plan.prefix_ids,
                )
                conv.add(msg)
        except (RuntimeError, ConfigError, StorageError) as exc:
            if request_id is not None:
                self.host.cancel(request_id)
            if stored_user is not None:  # kept, and shown: the input can be cleared
                self._set_editing(None)
                self.pane.input.clear()
                self._render_transcript()
            self._refuse(f"Could not start the reply: {exc}")
            return
        if plan.kind == "send":
            self._set_editing(None)
            self.pane.input.clear()
        record = ReplyRecord(
            self.host.generation,
            request_id,
            tokens=list(plan.prefix_tokens),
            token_ids=list(plan.prefix_ids),
            lead_text="" if plan.prefix_tokens else plan.prefix_text,
        )
        self._records[msg.id] = record
        sampling = plan.sampling
        live_group = ("beams" if sampling.beam_search else "samples", sampling.group_size)
        bubble = self._sync_path_bubbles(msg, live_group if sampling.group_size > 1 else None)
        bubble.set_meta("generating…", "live")
        group_card = bubble if sampling.group_size > 1 else None
        checkpoint = ReplyCheckpoint(self.store, msg.id)
        self.active = ActiveReply(
            msg, bubble, checkpoint, record, plan, plan.prefix_text, context, group_card
        )
        self._mark_context()
        self._unpin()
        self.token_inspected.emit(None, None)  # follow the newest token
        if plan.note:
            self.status_message.emit(plan.note, "info")
        self.refresh_sidebar()
        self.sync_state()
        self.reply_started.emit(request_id)

    def _conversation_for(self, plan: ReplyPlan):
        if self.conversation is None:
            self.conversation = self.store.create(self.pane.system_prompt.toPlainText())
        return self.conversation

    def _store_user_message(self, conv, plan: ReplyPlan) -> StoredMessage:
        if conv.title == DEFAULT_TITLE and not conv.nodes:
            conv.title = title_from(plan.user_text)
            self.store.rename(conv.id, conv.title)
        msg = self.store.add_message(conv.id, "user", plan.user_text, parent_id=plan.parent_id)
        conv.add(msg)
        return msg

    def _sync_path_bubbles(self, reply: StoredMessage, live_group: tuple[str, int] | None):
        """Make the transcript show the conversation's path: append what is new when the shown
        bubbles are its beginning, else draw it again. Returns the reply's bubble."""
        path = self.conversation.messages
        shown = [b.message_id for b in self.pane.transcript.bubbles]
        if shown != [m.id for m in path[: len(shown)]] or reply.id in shown:
            self._unpin()
            self.pane.transcript.clear()
            shown = []
        for msg in path[len(shown) :]:
            self._add_bubble(msg, live_group if msg.id == reply.id else None)
        return self.pane.transcript.bubbles[-1]

    # ---- the reply streaming in ----------------------------------------------------------------
    def stop(self) -> None:
        if self.active is not None:
            self.host.cancel(self.active.record.request_id)

    def _is_active(self, request_id: int) -> bool:
        a = self.active
        return (
            a is not None
            and a.record.request_id == request_id
            and a.record.generation == self.host.generation
        )

    def _on_tokens(self, request_id: int, events: list[TokenGenerated]) -> None:
        if not self._is_active(request_id):
            return
        a = self.active
        if a.group is not None:
            self._on_sample_tokens(a, events)
            return
        new = [ReplyToken(e.index, e.text_delta, e.logprob, e.request_id) for e in events]
        a.record.tokens.extend(new)
        a.record.token_ids.extend(e.token_id for e in events)
        a.text += "".join(e.text_delta for e in events)
        a.bubble.add_tokens(new, a.text)
        generated = len(a.record.token_ids) - len(a.plan.prefix_ids)
        a.bubble.set_meta(f"generating… {generated} tokens", "live")
        self.show_generated(generated)
        self._write(lambda: a.checkpoint.update(a.text, a.message.meta, a.record.token_ids))

    def _on_sample_tokens(self, a: ActiveReply, events: list[TokenGenerated]) -> None:
        """n samples: each token extends its own sample's column (TokenGenerated.branch)."""
        for e in events:
            a.sample_texts[e.branch] = a.sample_texts.get(e.branch, "") + e.text_delta
            a.sample_tokens[e.branch] = a.sample_tokens.get(e.branch, 0) + 1
        for branch in {e.branch for e in events}:
            a.group.set_sample_text(branch, a.sample_texts[branch], a.sample_tokens[branch])
        a.text = a.sample_texts.get(0, "")
        a.bubble.set_meta(f"generating… {sum(a.sample_tokens.values())} tokens", "live")
        self.show_generated(max(a.sample_tokens.values(), default=0))
        partial = GroupReply.streaming(a.sample_texts, a.group.size)
        self._write(lambda: a.checkpoint.update(a.text, partial.to_meta()))

    def _on_frame(self, dirty: set[str]) -> None:
        if self.active is not None and self.active.group is not None:
            self.active.group.refresh(dirty)
        self.refresh_pool(dirty)

    def _on_finished(self, event: RequestFinished) -> None:
        if not self._is_active(event.request_id):
            return
        a = self.active
        a.record.stats = event.stats
        loaded = self.host.live.loaded
        kept = KeptStats.from_engine(event.stats, loaded.info if loaded else None, self.host.config)
        if a.group is None:
            text = a.plan.prefix_text + event.text
            ids = [*a.plan.prefix_ids, *event.token_ids]
            meta = with_reply_facts(self._own_meta(a), kept, a.plan.sampling, a.context)
            self._end_reply(text, event.finish_reason, meta, ids)
            return
        a.group.refresh({"groups"})
        reply = GroupReply.from_finished(event, a.group.kind)
        a.group.show_results(reply)
        meta = with_reply_facts(reply.to_meta(), kept, a.plan.sampling, a.context)
        self._end_reply(reply.kept_text, event.finish_reason, meta, list(event.token_ids))

    def _on_failed(self, event: RequestFailed) -> None:
        if self._is_active(event.request_id):
            self.status_message.emit(f"The reply failed: {event.message}", "error")
            a = self.active
            partial = GroupReply.streaming(a.sample_texts, a.group.size).to_meta() if a.sample_texts else None
            meta = with_reply_facts(partial or self._own_meta(a), None, a.plan.sampling, a.context)
            self._end_reply(a.text, "failed", meta, a.record.token_ids)

    @staticmethod
    def _own_meta(a: ActiveReply) -> dict | None:
        """What a continued reply already kept beyond stats and settings (a fresh one: nothing)."""
        return dict(a.message.meta) if a.plan.kind == "continue" and a.message.meta else None

    def _end_reply(self, text: str, finish_reason: str, meta: dict | None, token_ids) -> None:
        a, self.active = self.active, None
        a.message.content, a.message.finish_reason, a.message.meta = text, finish_reason, meta
        a.message.token_ids = tuple(token_ids)
        a.bubble.set_text(text)
        self._write(lambda: a.checkpoint.finish(text, finish_reason, meta, token_ids))
        self._decorate(a.bubble, a.message)
        self._mark_context()
        self.refresh_sidebar()
        self.sync_state()
        self.schedule_measure()

    def _write(self, write) -> None:
        """A database write whose failure is shown, never raised into a Qt slot."""
        try:
            write()
        except StorageError as exc:
            self.status_message.emit(str(exc), "error")
