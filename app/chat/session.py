"""What the chat's collaborators share: the session's state (the conversation on screen, the reply
streaming or being measured, this session's replies, the message being edited, the last fit) and
how they speak to the rest of the window (the controller's signals and its refreshes).

Each collaborator (app.chat.crud, branching, streaming, context, keep, pinning, transcript) is
given these explicitly, with the widgets and services it works through; none reaches further.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from app.chat.conversations import StorageError
from app.chat.reply_state import ActiveReply, ReplyPlan, ReplyRecord
from app.chat.tree import Conversation, StoredMessage
from app.chat.view import ChatPane
from engine.api import ContextFit


@dataclass(slots=True)
class ChatSession:
    """The chat's state. The conversation is None until its first message, so opening the app
    does not pile up empty conversations."""

    conversation: Conversation | None = None
    active: ActiveReply | None = None  # the reply streaming now
    preparing: ReplyPlan | None = None  # a reply being measured against the context limit
    records: dict[int, ReplyRecord] = field(default_factory=dict)  # message id -> this session's reply
    editing_id: int | None = None  # the user message a send makes a new version of
    last_fit: ContextFit | None = None  # the last count of the conversation (the meter's)

    @property
    def busy(self) -> bool:
        """A reply is streaming, or one is being measured before it starts."""
        return self.active is not None or self.preparing is not None

    @property
    def path(self) -> list[StoredMessage]:
        """The visible path of the conversation ([] before its first message)."""
        return self.conversation.messages if self.conversation is not None else []

    def message(self, message_id: int | None) -> StoredMessage | None:
        """A message of the conversation's tree, anywhere in it."""
        if self.conversation is None or message_id is None:
            return None
        return self.conversation.nodes.get(message_id)

    @property
    def editing(self) -> StoredMessage | None:
        return self.message(self.editing_id)

    def last_user_index(self) -> int | None:
        msgs = self.path
        return next((i for i in range(len(msgs) - 1, -1, -1) if msgs[i].role == "user"), None)


@dataclass(frozen=True, slots=True)
class ChatSignals:
    """How the chat's parts tell the window what happened (the controller's signals), and ask
    for the refreshes a change needs."""

    status: Callable[[str, str], None]  # a line for the status bar: text, "error" | "info"
    started: Callable[[int], None]  # a reply was submitted: its request id
    refused: Callable[[str], None]  # nothing was sent, and why
    inspected: Callable[[int | None, int | None], None]  # the token the probability panel shows
    sync: Callable[[], None]  # the controls follow the state (busy, editing, what can be done)
    measure: Callable[[], None]  # count the conversation and the draft again soon
    listed: Callable[[], None]  # the conversation list follows (a new, retitled or updated one)
    # writes a full disk refused, tried again (in order) before the next one (write_or_say)
    unsaved: list[Callable[[], object]] = field(default_factory=list)


def set_editing(session: ChatSession, pane: ChatPane, message: StoredMessage | None) -> None:
    """Edit `message` (its text in the input; sending makes a new version), or stop editing."""
    session.editing_id = message.id if message is not None else None
    pane.set_editing(message.content if message is not None else None)


def write_or_say(signals: ChatSignals, write: Callable[[], object]) -> None:
    """A database write whose failure is shown, never raised into a Qt slot. One that fails (a
    full disk) is kept and tried again, in order, before the next write: the reply on screen
    reaches the database once there is room."""
    pending = [*signals.unsaved, write]
    signals.unsaved.clear()
    for i, each in enumerate(pending):
        try:
            each()
        except StorageError as exc:
            signals.unsaved.extend(pending[i:])
            signals.status(str(exc), "error")
            return
