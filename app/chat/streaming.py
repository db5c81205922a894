"""The chat's replies: from a plan, measured against the context limit on the engine thread, to a
request, then the engine's tokens streaming into the transcript and the database, and the
finished reply stored with its kept stats and settings.

Every reply goes the same way (a sent message, a regenerated or branched reply, a continued
one): `prepare(plan)` asks the engine to fit the prompt into its limits (EngineClient.fit_context)
and, for a branch, to decode the chosen token after the prefix; `_launch` then stores the new
messages and submits the request, or says why it cannot (the context limit under "refuse").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from app.chat.chat_options import ChatOptions
from app.chat.context import ContextTracking
from app.chat.context_fit import refusal
from app.chat.conversations import DEFAULT_TITLE, ConversationStore, ReplyCheckpoint, StorageError, title_from
from app.chat.group_reply import GroupReply
from app.chat.group_reply_view import GroupReplyCard
from app.chat.pinning import TokenPinning
from app.chat.reply_state import ActiveReply, ReplyPlan, ReplyRecord, kept_after, prompt_parts
from app.chat.reply_stats import KeptStats, with_reply_facts
from app.chat.rich_text import ReplyToken
from app.chat.session import ChatSession, ChatSignals, set_editing, write_or_say
from app.chat.tool_rounds import ToolRounds
from app.chat.tool_turns import expand
from app.chat.transcript import Transcript
from app.chat.tree import Conversation, StoredMessage
from app.chat.view import ChatPane
from app.engine_calls import EngineCalls
from app.engine_host import EngineHost
from app.workers import gather
from engine.api import ContextFit, EngineClient
from engine.config import ConfigError
from engine.events import RequestFailed, RequestFinished, TokenGenerated
from engine.request import Request


class ReplyStreaming:
    def __init__(
        self,
        pane: ChatPane,
        store: ConversationStore,
        host: EngineHost,
        calls: EngineCalls,
        session: ChatSession,
        signals: ChatSignals,
        transcript: Transcript,
        context: ContextTracking,
        pinning: TokenPinning,
        policy: Callable[[], str],
        options: ChatOptions,
        tool_rounds: ToolRounds,
    ) -> None:
        self.pane, self.store, self.host, self.calls = pane, store, host, calls
        self.session, self.signals = session, signals
        self.transcript, self.context, self.pinning = transcript, context, pinning
        self._policy = policy
        self.options, self.tool_rounds = options, tool_rounds

    def _system(self) -> str:
        return self.pane.system_prompt.toPlainText().strip()

    # ---- a plan, measured -------------------------------------------------------------------
    def prepare(self, plan: ReplyPlan) -> bool:
        session = self.session
        if session.busy:
            return False
        tools = self.options.tool_offer(plan)[0]
        if plan.sampling.group_size > 1 and tools:
            plan.sampling = dataclasses.replace(plan.sampling, n=1, num_beams=1)
            plan.note = "One reply at a time while tools are on: n samples and beams do not call tools"
        if not self.host.status().ready:
            self._refuse("No model is loaded: load one in the Controls panel first.")
            return False
        if not self.calls.local:
            return self._prepare_remote(plan)
        head, history, tail, _ = prompt_parts(self._system(), plan)
        policy, prefix, chosen = self._policy(), plan.prefix_ids, plan.chosen
        before = prefix[: len(prefix) - len(chosen)]
        max_new = plan.sampling.max_new_tokens
        tail_is_new = plan.kind == "send"

        def ask(engine: EngineClient) -> Future[tuple[Any, ...]]:
            fit = engine.fit_context(head, history, tail, max_new, policy, prefix, tail_is_new, tools)
            return gather(fit, engine.decode(chosen, after=before)) if chosen else gather(fit)

        session.preparing = plan
        self.signals.sync()
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
        if self.session.preparing is not plan:
            return
        self.session.preparing = None
        self.context.show_measured(fit)
        if not fit.fits:
            self._refuse(refusal(fit))
            return
        plan.prefix_text += chosen_text
        if plan.chosen and plan.prefix_tokens:
            last = plan.prefix_tokens[-1]
            plan.prefix_tokens[-1] = ReplyToken(last.index, chosen_text, last.logprob, last.request_id)
        self._launch(plan, fit)

    def _on_unprepared(self, plan: ReplyPlan, message: str) -> None:
        if self.session.preparing is plan:
            self.session.preparing = None
            self._refuse(f"Could not start the reply: {message}")

    def _refuse(self, message: str) -> None:
        """Nothing was sent; what the user typed stays in the input."""
        self.signals.status(message, "error")
        self.signals.refused(message)
        self.signals.sync()

    # ---- a plan, started ------------------------------------------------------------------
    def _launch(self, plan: ReplyPlan, fit: ContextFit | None) -> None:
        """Store and submit the plan; `fit` None: not measured (a remote server's engine)."""
        session = self.session
        head, _, tail, before = prompt_parts(self._system(), plan)
        dropped = fit.dropped if fit is not None else 0
        kept = kept_after(before, dropped)
        first_kept = plan.history.index(kept[0]) if kept else len(plan.history) - (plan.kind != "send")
        messages = head + tuple(turn for m in kept for turn in expand(m)) + tuple(tail)
        tools, tool_choice, tool_name = self.options.tool_offer(plan)
        context = None
        if dropped and fit is not None:
            context = {"first_kept": first_kept, "prompt_tokens": fit.prompt_tokens, "limit": fit.limit}
        request_id: int | None = None
        stored_user: StoredMessage | None = None
        try:
            conv = self._conversation_for()
            if plan.kind == "send":
                answered = stored_user = self._store_user_message(conv, plan)
            else:
                answered = plan.history[-1]
            request_id = self.host.submit(
                Request(
                    messages=messages,
                    sampling=plan.sampling,
                    reply_prefix_ids=plan.prefix_ids,
                    tools=tools,
                    tool_choice=tool_choice,
                    tool_name=tool_name,
                )
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
                set_editing(session, self.pane, None)
                self.pane.input.clear()
                self.transcript.render()
            self._refuse(f"Could not start the reply: {exc}")
            return
        if plan.kind == "send":
            set_editing(session, self.pane, None)
            self.pane.input.clear()
        assert request_id is not None, "submitted above"
        record = ReplyRecord(
            self.host.generation,
            request_id,
            tokens=list(plan.prefix_tokens),
            token_ids=list(plan.prefix_ids),
            lead_text="" if plan.prefix_tokens else plan.prefix_text,
        )
        session.records[msg.id] = record
        sampling = plan.sampling
        live_group = ("beams" if sampling.beam_search else "samples", sampling.group_size)
        bubble = self.transcript.sync_path(msg, live_group if sampling.group_size > 1 else None)
        bubble.set_meta("generating…", "live")
        group_card = bubble if isinstance(bubble, GroupReplyCard) and sampling.group_size > 1 else None
        checkpoint = ReplyCheckpoint(self.store, msg.id)
        session.active = ActiveReply(
            msg, bubble, checkpoint, record, plan, plan.prefix_text, context, group_card
        )
        self.transcript.mark_context()
        self.pinning.unpin()
        self.signals.inspected(None, None)  # follow the newest token
        if plan.note:
            self.signals.status(plan.note, "info")
        self.signals.listed()
        self.signals.sync()
        self.signals.started(request_id)

    def _conversation_for(self) -> Conversation:
        session = self.session
        if session.conversation is None:
            session.conversation = self.store.create(self.pane.system_prompt.toPlainText())
            self.options.save()  # the chat's setting, shown before its first message, is kept
        return session.conversation

    def _store_user_message(self, conv: Conversation, plan: ReplyPlan) -> StoredMessage:
        text = plan.user_text or ""
        if conv.title == DEFAULT_TITLE and not conv.nodes:
            conv.title = title_from(text)
            self.store.rename(conv.id, conv.title)
        msg = self.store.add_message(conv.id, "user", text, parent_id=plan.parent_id)
        conv.add(msg)
        return msg

    # ---- the reply streaming in ----------------------------------------------------------------
    def stop(self) -> None:
        if self.session.active is not None:
            self.host.cancel(self.session.active.record.request_id)

    def _active_for(self, request_id: int) -> ActiveReply | None:
        """The reply streaming now, when `request_id` is its request on the running engine."""
        a = self.session.active
        if (
            a is not None
            and a.record.request_id == request_id
            and a.record.generation == self.host.generation
        ):
            return a
        return None

    def on_tokens(self, request_id: int, events: list[TokenGenerated]) -> None:
        a = self._active_for(request_id)
        if a is None:
            return
        if a.group is not None:
            self._on_sample_tokens(a, events)
            return
        if a.plan.kind == "tool_results" and not a.blocks_asked:
            self.tool_rounds.measure_result_blocks(a)  # its prompt, the results among it, is cached now
        new = [ReplyToken(e.index, e.text_delta, e.logprob, e.request_id) for e in events]
        a.record.tokens.extend(new)
        a.record.token_ids.extend(e.token_id for e in events)
        a.text += "".join(e.text_delta for e in events)
        a.bubble.add_tokens(new, a.text)
        generated = len(a.record.token_ids) - len(a.plan.prefix_ids)
        a.bubble.set_meta(f"generating… {generated} tokens", "live")
        self.context.show_generated(generated)
        write_or_say(self.signals, lambda: a.checkpoint.update(a.text, a.message.meta, a.record.token_ids))

    def _on_sample_tokens(self, a: ActiveReply, events: list[TokenGenerated]) -> None:
        """n samples: each token extends its own sample's column (TokenGenerated.branch)."""
        group = a.group
        assert group is not None, "samples stream into their card"
        for e in events:
            a.sample_texts[e.branch] = a.sample_texts.get(e.branch, "") + e.text_delta
            a.sample_tokens[e.branch] = a.sample_tokens.get(e.branch, 0) + 1
        for branch in {e.branch for e in events}:
            group.set_sample_text(branch, a.sample_texts[branch], a.sample_tokens[branch])
        a.text = a.sample_texts.get(0, "")
        a.bubble.set_meta(f"generating… {sum(a.sample_tokens.values())} tokens", "live")
        self.context.show_generated(max(a.sample_tokens.values(), default=0))
        partial = GroupReply.streaming(a.sample_texts, group.num_sequences)
        write_or_say(self.signals, lambda: a.checkpoint.update(a.text, partial.to_meta()))

    def on_frame(self, dirty: set[str]) -> None:
        a = self.session.active
        if a is not None and a.group is not None:
            a.group.refresh(dirty)
        self.context.refresh_pool(dirty)

    def on_finished(self, event: RequestFinished) -> None:
        a = self._active_for(event.request_id)
        if a is None:
            return
        a.record.stats = event.stats
        if event.note:  # why it ended, when that needs words (the grammar's dead end)
            self.signals.status(f"The reply ended: {event.note}", "info")
        loaded = self.host.live.loaded
        kept = KeptStats.from_engine(event.stats, loaded.info if loaded else None, self.host.config)
        if a.group is None:
            text = a.plan.prefix_text + event.text
            ids = [*a.plan.prefix_ids, *event.token_ids]
            meta = self.tool_rounds.with_tool_calls(
                a, with_reply_facts(self._own_meta(a), kept, a.plan.sampling, a.context)
            )
            self._end_reply(text, event.finish_reason, meta, ids)
            self.tool_rounds.start_round(a.message)
            return
        a.group.refresh({"groups"})
        reply = GroupReply.from_finished(event, a.group.kind)
        a.group.show_results(reply)
        meta = with_reply_facts(reply.to_meta(), kept, a.plan.sampling, a.context)
        self._end_reply(reply.kept_text, event.finish_reason, meta, list(event.token_ids))

    def on_failed(self, event: RequestFailed) -> None:
        a = self._active_for(event.request_id)
        if a is None:
            return
        self.signals.status(f"The reply failed: {event.message}", "error")
        partial = (
            GroupReply.streaming(a.sample_texts, a.group.num_sequences).to_meta()
            if a.sample_texts and a.group is not None
            else None
        )
        meta = with_reply_facts(partial or self._own_meta(a), None, a.plan.sampling, a.context)
        self._end_reply(a.text, "failed", meta, a.record.token_ids)

    @staticmethod
    def _own_meta(a: ActiveReply) -> dict[str, Any] | None:
        """What a continued reply already kept beyond stats and settings (a fresh one: nothing)."""
        return dict(a.message.meta) if a.plan.kind == "continue" and a.message.meta else None

    def _end_reply(
        self, text: str, finish_reason: str, meta: dict[str, Any] | None, token_ids: Sequence[int]
    ) -> None:
        a, self.session.active = self.session.active, None
        assert a is not None, "a reply ends once"
        a.message.content, a.message.finish_reason, a.message.meta = text, finish_reason, meta
        a.message.token_ids = tuple(token_ids)
        a.bubble.set_text(text)
        write_or_say(self.signals, lambda: a.checkpoint.finish(text, finish_reason, meta, token_ids))
        self.transcript.decorate(a.bubble, a.message)
        if a.group is None:
            self.tool_rounds.show_cards(a.bubble, a.message)
        self.transcript.mark_context()
        self.signals.listed()
        self.signals.sync()
        self.signals.measure()
