"""The chat's ways to make a reply, every one a new branch of the conversation tree instead of
an overwrite: send (or edit-and-resend), regenerate (with the current settings or the reply's
own), branch from any token of a reply (cut there, put another candidate there, generate on
through the prefix cache), and continue a reply that was cut off. Each builds a ReplyPlan for
ReplyStreaming.prepare."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from PySide6.QtGui import QGuiApplication

from app.chat.bubble import MessageBubble
from app.chat.reply_state import ReplyPlan, ReplyRecord
from app.chat.reply_stats import stored_sampling
from app.chat.rich_text import ReplyToken
from app.chat.session import ChatSession, ChatSignals, set_editing
from app.chat.streaming import ReplyStreaming
from app.chat.transcript import CONTINUABLE
from app.chat.tree import StoredMessage
from app.chat.view import ChatPane
from app.engine_host import EngineHost
from engine.config import SamplingParams
from engine.events import TokenSnapshot

SINGLE_NOTE = "Continued as one reply: n samples and beams apply to new replies, not to a branch"


class Branching:
    def __init__(
        self,
        pane: ChatPane,
        host: EngineHost,
        session: ChatSession,
        signals: ChatSignals,
        streaming: ReplyStreaming,
        sampling: Callable[[], SamplingParams],
        on_sent: Callable[[], None] = lambda: None,
    ) -> None:
        self.pane, self.host, self.session, self.signals = pane, host, session, signals
        self.streaming, self._sampling = streaming, sampling
        self._on_sent = on_sent  # a new message is on its way (tool calls still waiting are skipped)

    # ---- sending ---------------------------------------------------------------------------
    def send(self, text: str) -> bool:
        """Send `text` after the visible path, or as a new version of the message being edited.
        False when nothing can start now (busy, no model): the text stays in the input."""
        session = self.session
        if session.busy or not text.strip():
            return False
        conv, editing = session.conversation, session.editing
        if conv is not None and editing is not None:
            path = conv.messages
            history = path[: path.index(editing)] if editing in path else conv.path_to(editing.id)[:-1]
            parent = editing.parent_id
        else:
            history = list(session.path)
            parent = history[-1].id if history else None
        plan = ReplyPlan("send", history, self._sampling(), user_text=text, parent_id=parent)
        started = self.streaming.prepare(plan)
        if started:
            self._on_sent()
        return started

    def regenerate(self) -> bool:
        """A new version of the last reply (current settings); the old one stays as a sibling."""
        path = self.session.path
        last = path[-1] if path else None
        if last is None:
            return False
        if last.role == "assistant":
            return self.regenerate_message(last.id)
        return self.streaming.prepare(ReplyPlan("regenerate", list(path), self._sampling()))

    def regenerate_message(self, message_id: int, same_settings: bool = False) -> bool:
        """A new sibling of a reply anywhere on the path, with the current settings or with the
        ones it was made with."""
        session = self.session
        conv, msg = session.conversation, session.message(message_id)
        if session.busy or conv is None or msg is None or msg.role != "assistant" or msg.parent_id is None:
            return False
        sampling: SamplingParams | None = self._sampling()
        if same_settings:
            sampling = stored_sampling(msg.meta)
            if sampling is None:
                self.signals.status("This reply was made before kvscope kept each reply's settings.", "error")
                return False
            sampling = dataclasses.replace(sampling, snapshot_top_n=self._sampling().snapshot_top_n)
        assert sampling is not None
        history = conv.path_to(msg.parent_id)
        return self.streaming.prepare(ReplyPlan("regenerate", history, sampling))

    # ---- editing ---------------------------------------------------------------------------
    def edit_last(self) -> None:
        last = self.session.last_user_index()
        if not self.session.busy and last is not None:
            self.edit_message(self.session.path[last].id)

    def edit_message(self, message_id: int) -> None:
        """Put a user message in the input; sending makes a new version beside it."""
        msg = self.session.message(message_id)
        if self.session.busy or msg is None or msg.role != "user":
            return
        set_editing(self.session, self.pane, msg)
        self.signals.sync()

    def cancel_edit(self) -> None:
        if self.pane.editing:
            set_editing(self.session, self.pane, None)
            self.pane.input.clear()
            self.signals.sync()

    # ---- branching from a token --------------------------------------------------------------
    def branch_from_token(self, request_id: int, index: int, token_id: int) -> bool:
        """Cut the reply that `request_id` streamed at token `index`, put `token_id` there (any
        candidate, drawn or not) and generate the rest with the current settings, as a new
        sibling of that reply. Its prefix is in the prefix cache: only the new tokens are
        computed. False (with a message) when the token is not one of this chat's replies."""
        found = self._reply_of_request(request_id)
        conv = self.session.conversation
        if found is None or conv is None:
            return False
        msg, record = found
        if self.session.busy:
            self.signals.status("Wait for the reply to finish (or stop it), then branch.", "error")
            return False
        position = next(
            (p for p, t in enumerate(record.tokens) if t.request_id == request_id and t.index == index), None
        )
        if position is None or msg.parent_id is None:
            self.signals.status("That token is not in the reply any more.", "error")
            return False
        token = self.host.live.token(request_id, index)
        sampling, note = _single(self._sampling())
        made = self.host.request(request_id)
        same_grammar = made is not None and made.sampling.grammar == sampling.grammar
        if token is not None and same_grammar and _cut_by_grammar(token.snapshot, token_id):
            self.signals.status(
                "The chat's structured output does not allow that token there (its mask cut it): "
                "choose one it allows, or change the structured output first.",
                "error",
            )
            return False
        prob = _candidate_prob(token.snapshot, token_id) if token is not None else None
        logprob = math.log(prob) if prob else -math.inf
        before_ids = tuple(record.token_ids[:position])
        prefix_tokens = [*record.tokens[:position], ReplyToken(index, "", logprob, request_id)]
        plan = ReplyPlan(
            "branch",
            conv.path_to(msg.parent_id),
            sampling,
            prefix_ids=(*before_ids, token_id),
            prefix_tokens=prefix_tokens,
            prefix_text="".join(t.text_delta for t in record.tokens[:position]),
            chosen=(token_id,),
            note=note,
        )
        return self.streaming.prepare(plan)

    def _reply_of_request(self, request_id: int) -> tuple[StoredMessage, ReplyRecord] | None:
        """(message, record) of this chat's reply streamed by `request_id` on the running engine,
        as a branch point: a plain reply on the visible path, with its tokens."""
        for message_id, record in self.session.records.items():
            tokens_here = any(t.request_id == request_id for t in record.tokens)
            if record.generation != self.host.generation or not tokens_here:
                continue
            msg = self.session.message(message_id)
            if msg is None or message_id not in {m.id for m in self.session.path}:
                self.signals.status("Show that reply (◀ ▶) to branch from its tokens.", "error")
                return None
            return msg, record
        self.signals.status(
            "Branching continues a plain reply of this chat from the running model; choose one of its tokens.",
            "error",
        )
        return None

    # ---- continuing --------------------------------------------------------------------------
    def continue_reply(self, message_id: int) -> bool:
        """More of a reply that ended early (interrupted by a crash, stopped, at its token limit),
        appended to the same message, from its stored tokens."""
        session = self.session
        conv, msg = session.conversation, session.message(message_id)
        if session.busy or conv is None or msg is None or msg.role != "assistant":
            return False
        if msg.finish_reason not in CONTINUABLE or msg.parent_id is None:
            return False
        record = session.records.get(msg.id)
        this_engine = record is not None and record.generation == self.host.generation
        ids = tuple(record.token_ids) if record is not None and this_engine else msg.token_ids
        if not ids and msg.content:
            self.signals.status(
                "This reply was saved without its tokens (an older kvscope): regenerate it instead.", "error"
            )
            return False
        sampling, note = _single(self._sampling())
        plan = ReplyPlan(
            "continue",
            conv.path_to(msg.parent_id),
            sampling,
            prefix_ids=ids,
            prefix_tokens=list(record.tokens) if record is not None and this_engine else [],
            prefix_text=msg.content,
            target=msg,
            note=note,
        )
        return self.streaming.prepare(plan)

    # ---- a message's menu --------------------------------------------------------------------
    def on_message_action(self, bubble: MessageBubble, name: str) -> None:
        message_id = bubble.message_id
        if message_id is None:
            return
        if name == "copy":
            clipboard = QGuiApplication.clipboard()
            clipboard.setText(bubble.text)
            self.signals.status("Copied to the clipboard", "info")
        elif self.session.busy:
            self.signals.status("Wait for the reply to finish (or stop it) first.", "error")
        elif name == "edit":
            self.edit_message(message_id)
        elif name == "regenerate":
            self.regenerate_message(message_id)
        elif name == "regenerate_same":
            self.regenerate_message(message_id, same_settings=True)
        elif name == "continue":
            self.continue_reply(message_id)


def _single(params: SamplingParams) -> tuple[SamplingParams, str]:
    """One sequence: a branch or a continuation goes on as one reply."""
    if params.group_size == 1:
        return params, ""
    return dataclasses.replace(params, n=1, num_beams=1), SINGLE_NOTE


def _cut_by_grammar(snapshot: TokenSnapshot | None, token_id: int) -> bool:
    """The grammar's mask removed `token_id` at this token (as recorded: among the candidates
    with nothing left after the grammar stage, or among the likeliest tokens it cut)."""
    if snapshot is None or snapshot.grammar is None:
        return False
    if token_id in snapshot.grammar.cut_ids:
        return True
    stage = next((s for s in snapshot.stages if s.name == "grammar"), None)
    if stage is None or token_id not in snapshot.candidate_ids:
        return False
    return stage.probs[snapshot.candidate_ids.index(token_id)] == 0.0


def _candidate_prob(snapshot: TokenSnapshot | None, token_id: int) -> float | None:
    """The chosen candidate's probability where the reply was cut (final stage, else raw)."""
    if snapshot is None or token_id not in snapshot.candidate_ids:
        return None
    i = snapshot.candidate_ids.index(token_id)
    return snapshot.stages[-1].probs[i] or snapshot.stages[0].probs[i] or None
