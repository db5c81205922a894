"""Conversations in SQLite: every message committed as it is written, replies as they stream.

One connection, used from the GUI thread only. Each write is its own transaction (autocommit),
so an app crash loses at most what the caller had not yet handed over: the chat pane writes a
streaming reply through `ReplyCheckpoint`, at most once a second and always on finish/stop.
WAL journaling keeps those frequent small commits cheap and readers never blocked.
A second kvscope running on the same database shares it safely: WAL lets each read while the
other writes, and writers wait their turn (BUSY_TIMEOUT_S); tests/app/test_two_instances.py.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_TITLE = "New conversation"
TITLE_CHARS = 60  # a sidebar row shows about this much of the first user message
BUSY_TIMEOUT_S = 10.0

# `meta`: JSON about a message beyond its text (a reply's alternatives: app.chat.group_reply); NULL
# for most. Added after the first release: older databases get the column by ALTER TABLE (see
# `_migrate`), which keeps every row.
# AUTOINCREMENT: a deleted message's id (regenerate, edit-and-resend) is never handed out
# again, so an id names one message for good (in exports, and in the app's in-memory maps).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    finish_reason TEXT,
    model TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    meta TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


class StorageError(Exception):
    """The conversation database could not be opened or written; str() is for the user."""


@dataclass(slots=True)
class StoredMessage:
    id: int
    role: str  # "user" | "assistant"
    content: str
    finish_reason: str | None = (
        None  # assistant only: stop / length / cancelled / failed / None while streaming
    )
    model: str | None = None
    created_at: float = 0.0
    meta: dict | None = None  # e.g. the alternatives of an n-sample / beam-search reply


@dataclass(slots=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    created_at: float
    updated_at: float
    messages: list[StoredMessage] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ConversationSummary:
    id: int
    title: str
    updated_at: float
    message_count: int


def title_from(text: str) -> str:
    """A sidebar title from the first user message: its first line, shortened at a word."""
    line = " ".join(text.strip().split())
    if len(line) <= TITLE_CHARS:
        return line or DEFAULT_TITLE
    cut = line[:TITLE_CHARS].rsplit(" ", 1)[0] or line[:TITLE_CHARS]
    return cut + "…"


class ConversationStore:
    def __init__(self, path: Path | str, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self._clock = clock
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # timeout: a second kvscope on the same database (WAL: readers never wait, writers
            # take turns) waits this long for the other's write to end instead of failing at once
            # with "database is locked". Each write is one small autocommit, held for milliseconds.
            self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=BUSY_TIMEOUT_S)
            self._db.execute("PRAGMA journal_mode=WAL")
            # In WAL mode NORMAL still survives an application crash (every commit is in the
            # log before execute() returns); it only skips the fsync per commit, which on a
            # busy disk can stall the GUI thread for a visible fraction of a second.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            # One instance at a time creates or migrates the schema (two starting together would
            # both see an old table and both ALTER it).
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    self._db.execute(statement)
                self._migrate()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except (OSError, sqlite3.Error) as exc:
            raise StorageError(f"Cannot open the conversation database at {self.path}: {exc}") from exc

    def close(self) -> None:
        self._db.close()

    def _migrate(self) -> None:
        """Bring a database made by an older kvscope up to the current schema, keeping its rows."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(messages)")}
        if "meta" not in columns:
            self._db.execute("ALTER TABLE messages ADD COLUMN meta TEXT")

    # ---- conversations ---------------------------------------------------------------------
    def create(self, system_prompt: str = "", title: str = DEFAULT_TITLE) -> Conversation:
        now = self._clock()
        cur = self._write(
            "INSERT INTO conversations (title, system_prompt, created_at, updated_at) VALUES (?, ?, ?, ?)",
            (title, system_prompt, now, now),
        )
        return Conversation(cur.lastrowid, title, system_prompt, now, now)

    def summaries(self) -> list[ConversationSummary]:
        """Newest first, as the sidebar lists them."""
        rows = self._db.execute(
            "SELECT c.id, c.title, c.updated_at, COUNT(m.id) FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id "
            "ORDER BY c.updated_at DESC, c.id DESC"
        ).fetchall()
        return [ConversationSummary(*row) for row in rows]

    def load(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute(
            "SELECT id, title, system_prompt, created_at, updated_at FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        if row is None:
            return None
        conv = Conversation(*row)
        conv.messages = [
            StoredMessage(*m[:-1], meta=_meta_from_json(m[-1]))
            for m in self._db.execute(
                "SELECT id, role, content, finish_reason, model, created_at, meta FROM messages "
                "WHERE conversation_id = ? ORDER BY id",
                (conversation_id,),
            )
        ]
        return conv

    def rename(self, conversation_id: int, title: str) -> None:
        self._write("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self._write("UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, conversation_id))

    def delete(self, conversation_id: int) -> None:
        self._write("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ---- messages --------------------------------------------------------------------------
    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        finish_reason: str | None = None,
        model: str | None = None,
        meta: dict | None = None,
    ) -> StoredMessage:
        now = self._clock()
        cur = self._write(
            "INSERT INTO messages (conversation_id, role, content, finish_reason, model, created_at, updated_at, "
            "meta) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (conversation_id, role, content, finish_reason, model, now, now, _meta_to_json(meta)),
        )
        self._touch(conversation_id, now)
        return StoredMessage(cur.lastrowid, role, content, finish_reason, model, now, meta)

    def update_message(
        self, message_id: int, content: str, finish_reason: str | None = None, meta: dict | None = None
    ) -> None:
        """Rewrite a message's text, finish reason and metadata (all three: pass what it has)."""
        now = self._clock()
        self._write(
            "UPDATE messages SET content = ?, finish_reason = ?, meta = ?, updated_at = ? WHERE id = ?",
            (content, finish_reason, _meta_to_json(meta), now, message_id),
        )

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Drop a message and everything after it (edit-and-resend, regenerate)."""
        self._write(
            "DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id)
        )
        self._touch(conversation_id, self._clock())

    # ---- internals -------------------------------------------------------------------------
    def _touch(self, conversation_id: int, now: float) -> None:
        self._write("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))

    def _write(self, sql: str, params: tuple) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, params)
        except sqlite3.Error as exc:
            raise StorageError(f"Could not save to the conversation database ({self.path}): {exc}") from exc


def _meta_to_json(meta: dict | None) -> str | None:
    return None if meta is None else json.dumps(meta, ensure_ascii=False)


def _meta_from_json(raw: str | None) -> dict | None:
    """A row's metadata; unreadable JSON (a damaged row) reads as none rather than failing the load."""
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


class ReplyCheckpoint:
    """Writes a streaming reply to the database at most once per `interval_s`, and always on
    `finish`: a crash loses at most the last interval of text, at one small commit a second."""

    def __init__(
        self,
        store: ConversationStore,
        message_id: int,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._store = store
        self.message_id = message_id
        self._interval = interval_s
        self._clock = clock
        self._last_write = clock()
        self._written: tuple[str, dict | None] = ("", None)
        self.writes = 0

    def update(self, text: str, meta: dict | None = None) -> bool:
        """Offer the reply so far (and its metadata); returns True when it was written."""
        now = self._clock()
        if (text, meta) == self._written or now - self._last_write < self._interval:
            return False
        self._write(text, None, meta, now)
        return True

    def finish(self, text: str, finish_reason: str, meta: dict | None = None) -> None:
        self._write(text, finish_reason, meta, self._clock())

    def _write(self, text: str, finish_reason: str | None, meta: dict | None, now: float) -> None:
        self._store.update_message(self.message_id, text, finish_reason, meta)
        self._written = (text, meta)
        self._last_write = now
        self.writes += 1


# ---- export --------------------------------------------------------------------------------
def export_markdown(conv: Conversation) -> str:
    parts = [f"# {conv.title}", ""]
    if conv.system_prompt:
        parts += ["**System**", "", conv.system_prompt, ""]
    for msg in conv.messages:
        label = "User" if msg.role == "user" else "Assistant"
        if msg.role == "assistant" and msg.finish_reason not in (None, "stop"):
            label += f" ({msg.finish_reason})"
        parts += [f"**{label}**", "", msg.content, ""]
    return "\n".join(parts).rstrip() + "\n"


def export_json(conv: Conversation) -> str:
    data = {
        "id": conv.id,
        "title": conv.title,
        "system_prompt": conv.system_prompt,
        "created_at": conv.created_at,
        "updated_at": conv.updated_at,
        "messages": [asdict(m) for m in conv.messages],
    }
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"
