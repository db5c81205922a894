"""A conversation as a tree of messages, and the path through it that the chat shows.

Every message has a parent (None for a first message): regenerating a reply, editing a message
and branching from a token all add a sibling instead of overwriting, so every alternative is
kept. The visible conversation is the path from a root to the current leaf; at each fork the
chat shows which of the siblings is on it (◀ 2/3 ▶). Going to another sibling shows that
sibling's newest continuation (the newest child at every level below it).

Pure data and tree walks: no Qt, no database (app.chat.conversations stores it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StoredMessage:
    id: int
    role: str  # "user" | "assistant" (a reply that called tools keeps the calls and results in meta)
    content: str
    # assistant only: stop / length / cancelled / failed / interrupted; None while streaming
    finish_reason: str | None = None
    model: str | None = None
    created_at: float = 0.0
    meta: dict[str, Any] | None = None  # a reply's alternatives, kept stats, sampling settings, context cut
    parent_id: int | None = None
    token_ids: tuple[int, ...] = ()  # a reply's generated tokens (to continue it after a crash)
    updated_at: float = 0.0


@dataclass(slots=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    created_at: float
    updated_at: float
    messages: list[StoredMessage] = field(default_factory=list)  # the visible path, root first
    nodes: dict[int, StoredMessage] = field(default_factory=dict)  # every message, by id
    settings: dict[str, Any] | None = None  # the chat's structured output and tools (app.chat.chat_settings)

    # ---- the tree --------------------------------------------------------------------------
    def children(self, parent_id: int | None) -> list[StoredMessage]:
        """A message's replies or alternatives, oldest first (None: the first messages)."""
        return sorted((m for m in self.nodes.values() if m.parent_id == parent_id), key=lambda m: m.id)

    def siblings(self, message: StoredMessage) -> list[StoredMessage]:
        return self.children(message.parent_id)

    def fork_position(self, message: StoredMessage) -> tuple[int, int]:
        """(1-based position among its siblings, how many there are)."""
        siblings = self.siblings(message)
        return next(i for i, m in enumerate(siblings) if m.id == message.id) + 1, len(siblings)

    def newest_leaf(self, message_id: int) -> int:
        """The leaf reached from `message_id` by taking the newest child at every level."""
        current = message_id
        while True:
            kids = self.children(current)
            if not kids:
                return current
            current = kids[-1].id

    def path_to(self, leaf_id: int) -> list[StoredMessage]:
        path = []
        node = self.nodes.get(leaf_id)
        while node is not None:
            path.append(node)
            node = self.nodes.get(node.parent_id) if node.parent_id is not None else None
        return path[::-1]

    @property
    def leaf_id(self) -> int | None:
        return self.messages[-1].id if self.messages else None

    # ---- changes ---------------------------------------------------------------------------
    def show(self, leaf_id: int | None) -> None:
        """Make the path to `leaf_id` the visible conversation (None: nothing shown)."""
        self.messages = self.path_to(leaf_id) if leaf_id is not None else []

    def add(self, message: StoredMessage) -> None:
        """A new message under its parent; the path now ends at it."""
        self.nodes[message.id] = message
        self.show(message.id)


def default_leaf(conv: Conversation, wanted: int | None) -> int | None:
    """The leaf to show on opening: the stored current leaf when it still exists, else the
    newest leaf of the newest first message."""
    if wanted is not None and wanted in conv.nodes:
        return wanted
    roots = conv.children(None)
    return conv.newest_leaf(roots[-1].id) if roots else None
