"""The chat controller's ways to make a reply, every one a new branch of the conversation tree
instead of an overwrite: send (or edit-and-resend), regenerate (with the current settings or
the reply's own), branch from any token of a reply (cut there, put another candidate there,
generate on through the prefix cache), and continue a reply that was cut off.

A mixin of ChatController (app.chat.controller); each builds a ReplyPlan for `_prepare`.
"""

from __future__ import annotations

import dataclasses
import math

from app.chat.crud import CONTINUABLE
from app.chat.reply_state import ReplyPlan
from app.chat.reply_stats import stored_sampling
from app.chat.rich_text import ReplyToken
from app.chat.tree import StoredMessage
from app.chat.view import MessageBubble
from engine.config import SamplingParams

SINGLE_NOTE = "Continued as one reply: n samples and beams apply to new replies, not to a branch"


class Branching:
    # ---- sending ---------------------------------------------------------------------------
    def send(self, text: str) -> bool:
        """Send `text` after the visible path, or as a new version of the message being edited.
        False when nothing can start now (busy, no model): the text stays in the input."""
        if self.busy or not text.strip():
            return False
        conv = self.conversation
        editing = conv.nodes.get(self._editing_id) if conv and self._editing_id is not None else None
        if editing is not None:
            path = conv.messages
            history = path[: path.index(editing)] if editing in path else conv.path_to(editing.id)[:-1]
            parent = editing.parent_id
        else:
            history = list(conv.messages) if conv else []
            parent = history[-1].id if history else None
        plan = ReplyPlan("send", history, self._sampling(), user_text=text, parent_id=parent)
        started = self._prepare(plan)
        if started:
            self._skip_pending_calls()  # calls still waiting for approval are not run now
        return started

    def regenerate(self) -> bool:
        """A new version of the last reply (current settings); the old one stays as a sibling."""
        path = self.conversation.messages if self.conversation else []
        last = path[-1] if path else None
        if last is None:
            return False
        if last.role == "assistant":
            return self.regenerate_message(last.id)
        return self._prepare(ReplyPlan("regenerate", list(path), self._sampling()))

    def regenerate_message(self, message_id: int, same_settings: bool = False) -> bool:
        """A new sibling of a reply anywhere on the path, with the current settings or with the
        ones it was made with."""
        conv = self.conversation
        msg = conv.nodes.get(message_id) if conv else None
        if self.busy or msg is None or msg.role != "assistant" or msg.parent_id is None:
            return False
        sampling = self._sampling()
        if same_settings:
            sampling = stored_sampling(msg.meta)
            if sampling is None:
                self.status_message.emit(
                    "This reply was made before kvscope kept each reply's settings.", "error"
                )
                return False
            sampling = dataclasses.replace(sampling, snapshot_top_n=self._sampling().snapshot_top_n)
        history = conv.path_to(msg.parent_id)
        return self._prepare(ReplyPlan("regenerate", history, sampling))

    # ---- editing ---------------------------------------------------------------------------
    def edit_last(self) -> None:
        last = self._last_user_index()
        if not self.busy and last is not None:
            self.edit_message(self.conversation.messages[last].id)

    def edit_message(self, message_id: int) -> None:
        """Put a user message in the input; sending makes a new version beside it."""
        conv = self.conversation
        msg = conv.nodes.get(message_id) if conv else None
        if self.busy or msg is None or msg.role != "user":
            return
        self._set_editing(msg)
        self.sync_state()

    def cancel_edit(self) -> None:
        if self.pane.editing:
            self._set_editing(None)
            self.pane.input.clear()
            self.sync_state()

    def _set_editing(self, msg: StoredMessage | None) -> None:
        self._editing_id = msg.id if msg is not None else None
        self.pane.set_editing(msg.content if msg is not None else None)

    def _last_user_index(self) -> int | None:
        msgs = self.conversation.messages if self.conversation else []
        return next((i for i in range(len(msgs) - 1, -1, -1) if msgs[i].role == "user"), None)

    # ---- branching from a token --------------------------------------------------------------
    def branch_from_token(self, request_id: int, index: int, token_id: int) -> bool:
        """Cut the reply that `request_id` streamed at token `index`, put `token_id` there (any
        candidate, drawn or not) and generate the rest with the current settings, as a new
        sibling of that reply. Its prefix is in the prefix cache: only the new tokens are
        computed. False (with a message) when the token is not one of this chat's replies."""
        found = self._reply_of_request(request_id)
        if found is None:
            return False
        msg, record = found
        if self.busy:
            self.status_message.emit("Wait for the reply to finish (or stop it), then branch.", "error")
            return False
        position = next(
            (p for p, t in enumerate(record.tokens) if t.request_id == request_id and t.index == index), None
        )
        if position is None:
            self.status_message.emit("That token is not in the reply any more.", "error")
            return False
        token = self.host.live.token(request_id, index)
        prob = _candidate_prob(token.snapshot, token_id) if token is not None else None
        logprob = math.log(prob) if prob else -math.inf
        before_ids = tuple(record.token_ids[:position])
        prefix_tokens = [*record.tokens[:position], ReplyToken(index, "", logprob, request_id)]
        sampling, note = self._single(self._sampling())
        plan = ReplyPlan(
            "branch",
            self.conversation.path_to(msg.parent_id),
            sampling,
            prefix_ids=(*before_ids, token_id),
            prefix_tokens=prefix_tokens,
            prefix_text="".join(t.text_delta for t in record.tokens[:position]),
            chosen=(token_id,),
            note=note,
        )
        return self._prepare(plan)

    def _reply_of_request(self, request_id: int):
        """(message, record) of this chat's reply streamed by `request_id` on the running engine,
        as a branch point: a plain reply on the visible path, with its tokens."""
        for message_id, record in self._records.items():
            tokens_here = any(t.request_id == request_id for t in record.tokens)
            if record.generation != self.host.generation or not tokens_here:
                continue
            msg = self.conversation.nodes.get(message_id) if self.conversation else None
            if msg is None or message_id not in {m.id for m in self.conversation.messages}:
                self.status_message.emit("Show that reply (◀ ▶) to branch from its tokens.", "error")
                return None
            return msg, record
        self.status_message.emit(
            "Branching continues a plain reply of this chat from the running model; choose one of its tokens.",
            "error",
        )
        return None

    @staticmethod
    def _single(params: SamplingParams) -> tuple[SamplingParams, str]:
        if params.group_size == 1:
            return params, ""
        return dataclasses.replace(params, n=1, num_beams=1), SINGLE_NOTE

    # ---- continuing --------------------------------------------------------------------------
    def continue_reply(self, message_id: int) -> bool:
        """More of a reply that ended early (interrupted by a crash, stopped, at its token limit),
        appended to the same message, from its stored tokens."""
        conv = self.conversation
        msg = conv.nodes.get(message_id) if conv else None
        if self.busy or msg is None or msg.role != "assistant" or msg.finish_reason not in CONTINUABLE:
            return False
        record = self._records.get(msg.id)
        this_engine = record is not None and record.generation == self.host.generation
        ids = tuple(record.token_ids) if this_engine else msg.token_ids
        if not ids and msg.content:
            self.status_message.emit(
                "This reply was saved without its tokens (an older kvscope): regenerate it instead.", "error"
            )
            return False
        sampling, note = self._single(self._sampling())
        plan = ReplyPlan(
            "continue",
            conv.path_to(msg.parent_id),
            sampling,
            prefix_ids=ids,
            prefix_tokens=list(record.tokens) if this_engine else [],
            prefix_text=msg.content,
            target=msg,
            note=note,
        )
        return self._prepare(plan)

    # ---- a message's menu --------------------------------------------------------------------
    def on_message_action(self, bubble: MessageBubble, name: str) -> None:
        message_id = bubble.message_id
        if message_id is None:
            return
        if name == "copy":
            from PySide6.QtGui import QGuiApplication

            QGuiApplication.clipboard().setText(bubble.text)
            self.status_message.emit("Copied to the clipboard", "info")
        elif self.busy:
            self.status_message.emit("Wait for the reply to finish (or stop it) first.", "error")
        elif name == "edit":
            self.edit_message(message_id)
        elif name == "regenerate":
            self.regenerate_message(message_id)
        elif name == "regenerate_same":
            self.regenerate_message(message_id, same_settings=True)
        elif name == "continue":
            self.continue_reply(message_id)


def _candidate_prob(snapshot, token_id: int) -> float | None:
    """The chosen candidate's probability where the reply was cut (final stage, else raw)."""
    if snapshot is None or token_id not in snapshot.candidate_ids:
        return None
    i = snapshot.candidate_ids.index(token_id)
    return snapshot.stages[-1].probs[i] or snapshot.stages[0].probs[i] or None
