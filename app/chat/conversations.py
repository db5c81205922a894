"""Conversations in SQLite: every message committed as it is written, replies as they stream.

One connection, used from the GUI thread only. Each write is its own transaction (autocommit),
so an app crash loses at most what the caller had not yet handed over: the chat pane writes a
streaming reply through `ReplyCheckpoint`, at most once a second and always on finish/stop.
WAL journaling keeps those frequent small commits cheap and readers never blocked.
A second kvscope running on the same database shares it safely: WAL lets each read while the
other writes, and writers wait their turn (BUSY_TIMEOUT_S); tests/app/test_two_instances.py.

Conversations are trees (app.chat.tree); the schema and the migration of older databases are
app.chat.schema, exports and imports app.chat.exchange. A reply a crash cut off (its row still
streaming, finish reason NULL) is marked "interrupted" by `mark_interrupted` on the next start.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from app.chat.schema import SchemaError, prepare, probe
from app.chat.search import SearchHit, like_pattern, match_query, snippet_html
from app.chat.tree import Conversation, StoredMessage, default_leaf
from engine.api import create_private_file, private_dir

# Re-exported: callers import the data types with the store.
__all__ = [
    "DEFAULT_TITLE",
    "Conversation",
    "ConversationStore",
    "ConversationSummary",
    "ReplyCheckpoint",
    "SearchHit",
    "StorageError",
    "StoredMessage",
    "title_from",
]

DEFAULT_TITLE = "New conversation"
TITLE_CHARS = 60  # a sidebar row shows about this much of the first user message
BUSY_TIMEOUT_S = 10.0
INTERRUPTED = "interrupted"  # finish reason of a reply that was streaming when the app died
SEARCH_LIMIT = 50
_AT_LEAF = object()  # add_message's default parent: the end of the visible path
_COLUMNS = "id, role, content, finish_reason, model, created_at, meta, parent_id, token_ids, updated_at"


class StorageError(Exception):
    """The conversation database could not be opened or written; str() is for the user."""


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


T = TypeVar("T")


def _when_unlocked(action: Callable[[], T], wait_s: float = BUSY_TIMEOUT_S) -> T:
    """`action()`, tried again while SQLite says the database is locked, up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return action()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


READ_ONLY_BANNER = (
    "The conversation database is in a folder kvscope cannot write ({folder}): it is open read-only. "
    "Your conversations can be read and searched; new messages are not saved. Make the folder "
    "writable (or set KVSCOPE_DATA_DIR) and restart to save again."
)


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.Error) and (
        getattr(exc, "sqlite_errorname", "") == "SQLITE_FULL" or "disk is full" in str(exc)
    )


class ConversationStore:
    def __init__(self, path: Path | str, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self._clock = clock
        # An existing database in a folder (or a file) this user cannot write: opened read-only,
        # the app says so in a banner (READ_ONLY_BANNER) instead of refusing to start.
        self.read_only = self.path.is_file() and not (
            os.access(self.path.parent, os.W_OK) and os.access(self.path, os.W_OK)
        )
        if self.read_only:
            self._open_read_only()
            return
        try:
            private_dir(self.path.parent)
            # created 0600 before SQLite opens it (its -wal and -shm files take its permissions)
            create_private_file(self.path)
            probe(self.path)
            # timeout: a second kvscope on the same database (WAL: readers never wait, writers
            # take turns) waits this long for the other's write to end instead of failing at once
            # with "database is locked". Each write is one small autocommit, held for milliseconds.
            self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=BUSY_TIMEOUT_S)
        except (OSError, sqlite3.Error, SchemaError) as exc:
            raise StorageError(f"Cannot open the conversation database at {self.path}: {exc}") from exc
        try:
            # Switching to WAL takes an exclusive lock, and SQLite answers "database is locked" at
            # once, without its busy wait, when another instance is opening the same new file
            # (waiting could deadlock the two): retry for as long as a write would wait.
            _when_unlocked(lambda: self._db.execute("PRAGMA journal_mode=WAL"))
            # In WAL mode NORMAL still survives an application crash (every commit is in the
            # log before execute() returns); it only skips the fsync per commit, which on a
            # busy disk can stall the GUI thread for a visible fraction of a second.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self.full_text_search = _when_unlocked(lambda: prepare(self._db))
        except (sqlite3.Error, SchemaError) as exc:
            self._db.close()
            raise StorageError(f"Cannot open the conversation database at {self.path}: {exc}") from exc

    def _open_read_only(self) -> None:
        """SQLite's read-only mode; a WAL database whose -shm cannot be made in a read-only
        folder opens as immutable (nothing can write it meanwhile: the folder is read-only)."""
        uri = self.path.resolve().as_uri()
        last: Exception | None = None
        for query in ("mode=ro", "mode=ro&immutable=1"):
            try:
                probe(self.path)
                db = sqlite3.connect(f"{uri}?{query}", uri=True, isolation_level=None, timeout=BUSY_TIMEOUT_S)
                db.execute("SELECT COUNT(*) FROM conversations").fetchone()
            except (OSError, sqlite3.Error, SchemaError) as exc:
                last = exc
                continue
            self._db = db
            self.full_text_search = bool(
                db.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'").fetchone()
            )
            return
        raise StorageError(f"Cannot open the conversation database at {self.path} (read-only): {last}")

    @property
    def read_only_banner(self) -> str:
        return READ_ONLY_BANNER.format(folder=self.path.parent) if self.read_only else ""

    def close(self) -> None:
        self._db.close()

    # ---- conversations ---------------------------------------------------------------------
    def create(self, system_prompt: str = "", title: str = DEFAULT_TITLE) -> Conversation:
        now = self._clock()
        cur = self._write(
            "INSERT INTO conversations (title, system_prompt, created_at, updated_at) VALUES (?, ?, ?, ?)",
            (title, system_prompt, now, now),
        )
        return Conversation(_row_id(cur), title, system_prompt, now, now)

    def summaries(self) -> list[ConversationSummary]:
        """Newest first, as the sidebar lists them; counts are of every message, all branches."""
        rows = self._db.execute(
            "SELECT c.id, c.title, c.updated_at, COUNT(m.id) FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id "
            "ORDER BY c.updated_at DESC, c.id DESC"
        ).fetchall()
        return [ConversationSummary(*row) for row in rows]

    def load(self, conversation_id: int) -> Conversation | None:
        """The conversation with its whole tree, showing the path to its current leaf."""
        row = self._db.execute(
            "SELECT id, title, system_prompt, created_at, updated_at, current_leaf_id, settings "
            "FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        if row is None:
            return None
        conv = Conversation(*row[:5])
        conv.settings = _from_json(row[6])
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        )
        conv.nodes = {m.id: m for m in map(_message, rows)}
        conv.show(default_leaf(conv, row[5]))
        return conv

    def rename(self, conversation_id: int, title: str) -> None:
        self._write("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self._write("UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, conversation_id))

    def set_settings(self, conversation_id: int, settings: dict[str, Any] | None) -> None:
        """The chat's structured output and tools (app.chat.chat_settings), as JSON."""
        self._write(
            "UPDATE conversations SET settings = ? WHERE id = ?", (_to_json(settings), conversation_id)
        )

    def set_current_leaf(self, conversation_id: int, leaf_id: int | None) -> None:
        """Which path the conversation shows when it is opened again."""
        self._write("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf_id, conversation_id))

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
        meta: dict[str, Any] | None = None,
        parent_id: int | None | object = _AT_LEAF,
        token_ids: Sequence[int] = (),
    ) -> StoredMessage:
        """A message under `parent_id` (by default the end of the visible path, None for a first
        message); the visible path then ends at it."""
        now = self._clock()
        parent: int | None
        if parent_id is _AT_LEAF:
            row = self._db.execute(
                "SELECT current_leaf_id FROM conversations WHERE id = ?", (conversation_id,)
            ).fetchone()
            parent = row[0] if row else None
        else:
            assert parent_id is None or isinstance(parent_id, int), "a parent is a message id or None"
            parent = parent_id
        cur = self._write(
            "INSERT INTO messages (conversation_id, role, content, finish_reason, model, created_at, updated_at, "
            "meta, parent_id, token_ids) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                conversation_id,
                role,
                content,
                finish_reason,
                model,
                now,
                now,
                _to_json(meta),
                parent,
                _ids_to_json(token_ids),
            ),
        )
        message_id = _row_id(cur)
        self._write(
            "UPDATE conversations SET updated_at = ?, current_leaf_id = ? WHERE id = ?",
            (now, message_id, conversation_id),
        )
        return StoredMessage(
            message_id, role, content, finish_reason, model, now, meta, parent, tuple(token_ids), now
        )

    def update_message(
        self,
        message_id: int,
        content: str,
        finish_reason: str | None = None,
        meta: dict[str, Any] | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Rewrite a message's text, finish reason and metadata (all three: pass what it has),
        and its token ids when given."""
        now = self._clock()
        self._write(
            "UPDATE messages SET content = ?, finish_reason = ?, meta = ?, updated_at = ?, "
            "token_ids = COALESCE(?, token_ids) WHERE id = ?",
            (content, finish_reason, _to_json(meta), now, _ids_to_json(token_ids), message_id),
        )

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Drop a message and everything under it (its branch); the conversation then shows
        the newest remaining continuation of its parent."""
        row = self._db.execute("SELECT parent_id FROM messages WHERE id = ?", (message_id,)).fetchone()
        self._write(
            "DELETE FROM messages WHERE conversation_id = ? AND id = ?", (conversation_id, message_id)
        )
        conv = self.load(conversation_id)
        if conv is not None:
            parent = row[0] if row else None
            leaf = conv.newest_leaf(parent) if parent in conv.nodes else default_leaf(conv, None)
            self._write(
                "UPDATE conversations SET updated_at = ?, current_leaf_id = ? WHERE id = ?",
                (self._clock(), leaf, conversation_id),
            )

    def mark_interrupted(self) -> int:
        """Replies still streaming in the database belong to a session that died (a crash, a
        kill): mark them interrupted so they do not look finished. Returns how many."""
        cur = self._write(
            "UPDATE messages SET finish_reason = ? WHERE role = 'assistant' AND finish_reason IS NULL",
            (INTERRUPTED,),
        )
        return cur.rowcount

    # ---- search ----------------------------------------------------------------------------
    def search(self, text: str, limit: int = SEARCH_LIMIT) -> list[SearchHit]:
        """Messages of every conversation and branch holding all the words of `text` (the last
        one as a prefix, for search as you type), best match first."""
        if self.full_text_search:
            query = match_query(text)
            if not query:
                return []
            rows = self._db.execute(
                "SELECT m.conversation_id, c.title, m.id, m.role, "
                "snippet(messages_fts, 0, char(2), char(3), '…', 12) FROM messages_fts "
                "JOIN messages m ON m.id = messages_fts.rowid JOIN conversations c ON c.id = m.conversation_id "
                "WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?",
                (query, limit),
            ).fetchall()
        else:
            words = text.split()
            if not words:
                return []
            where = " AND ".join("m.content LIKE ? ESCAPE '\\'" for _ in words)
            rows = self._db.execute(
                f"SELECT m.conversation_id, c.title, m.id, m.role, m.content FROM messages m "
                f"JOIN conversations c ON c.id = m.conversation_id WHERE {where} ORDER BY m.id DESC LIMIT ?",
                (*map(like_pattern, words), limit),
            ).fetchall()
        return [SearchHit(cid, title, mid, role, snippet_html(snip)) for cid, title, mid, role, snip in rows]

    # ---- import ----------------------------------------------------------------------------
    def insert_tree(
        self,
        title: str,
        system_prompt: str,
        created_at: float,
        updated_at: float,
        messages: Sequence[StoredMessage],
        current: int | None,
        settings: dict[str, Any] | None = None,
    ) -> int:
        """A whole conversation in one transaction (an import). `messages` are in creation
        order, each parent before its children; their ids and `current` are the caller's own
        numbering, mapped to new rows. Returns the new conversation's id."""
        self._check_writable()
        try:
            self._db.execute("BEGIN IMMEDIATE")
            cur = self._db.execute(
                "INSERT INTO conversations (title, system_prompt, created_at, updated_at, settings) "
                "VALUES (?, ?, ?, ?, ?)",
                (title, system_prompt, created_at, updated_at, _to_json(settings)),
            )
            conversation_id = _row_id(cur)
            new_ids: dict[int, int] = {}
            for m in messages:
                cur = self._db.execute(
                    "INSERT INTO messages (conversation_id, role, content, finish_reason, model, created_at, "
                    "updated_at, meta, parent_id, token_ids) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        conversation_id,
                        m.role,
                        m.content,
                        m.finish_reason,
                        m.model,
                        m.created_at,
                        m.updated_at,
                        _to_json(m.meta),
                        new_ids[m.parent_id] if m.parent_id is not None else None,
                        _ids_to_json(m.token_ids),
                    ),
                )
                new_ids[m.id] = _row_id(cur)
            self._db.execute(
                "UPDATE conversations SET current_leaf_id = ? WHERE id = ?",
                (new_ids.get(current) if current is not None else None, conversation_id),
            )
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._db.execute("ROLLBACK")
            raise StorageError(f"Could not save the imported conversation ({self.path}): {exc}") from exc
        return conversation_id

    # ---- internals -------------------------------------------------------------------------
    def _check_writable(self) -> None:
        if self.read_only:
            raise StorageError(
                f"Not saved: the conversation database is read-only (its folder {self.path.parent} "
                "cannot be written)."
            )

    def _write(self, sql: str, params: tuple[object, ...]) -> sqlite3.Cursor:
        self._check_writable()
        try:
            return self._db.execute(sql, params)
        except sqlite3.Error as exc:
            if is_disk_full(exc):
                raise StorageError(
                    f"The disk is full: the reply could not be saved to {self.path}. It stays on "
                    "screen, and what was saved before is intact; free some space and it is saved "
                    "with the next change."
                ) from exc
            raise StorageError(f"Could not save to the conversation database ({self.path}): {exc}") from exc


def _row_id(cursor: sqlite3.Cursor) -> int:
    row_id = cursor.lastrowid
    assert row_id is not None, "an INSERT gives its row an id"
    return row_id


def _message(row: tuple[Any, ...]) -> StoredMessage:
    mid, role, content, finish, model, created, meta, parent, token_ids, updated = row
    return StoredMessage(
        mid,
        role,
        content,
        finish,
        model,
        created,
        _from_json(meta),
        parent,
        _ids_from_json(token_ids),
        updated,
    )


def _to_json(meta: dict[str, Any] | None) -> str | None:
    return None if meta is None else json.dumps(meta, ensure_ascii=False)


def _from_json(raw: str | None) -> dict[str, Any] | None:
    """A row's metadata; unreadable JSON (a damaged row) reads as none rather than failing the load."""
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _ids_to_json(ids: Sequence[int] | None) -> str | None:
    return None if ids is None else json.dumps(list(ids))


def _ids_from_json(raw: str | None) -> tuple[int, ...]:
    if not raw:
        return ()
    try:
        ids = json.loads(raw)
    except ValueError:
        return ()
    return tuple(i for i in ids if isinstance(i, int)) if isinstance(ids, list) else ()


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
        self._written: tuple[str, dict[str, Any] | None, int] = ("", None, 0)
        self.writes = 0

    def update(
        self, text: str, meta: dict[str, Any] | None = None, token_ids: Sequence[int] | None = None
    ) -> bool:
        """Offer the reply so far (its metadata and tokens); returns True when it was written."""
        now = self._clock()
        count = len(token_ids) if token_ids is not None else self._written[2]
        if (text, meta, count) == self._written or now - self._last_write < self._interval:
            return False
        self._write(text, None, meta, token_ids, now)
        return True

    def finish(
        self,
        text: str,
        finish_reason: str,
        meta: dict[str, Any] | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        self._write(text, finish_reason, meta, token_ids, self._clock())

    def _write(
        self,
        text: str,
        finish_reason: str | None,
        meta: dict[str, Any] | None,
        token_ids: Sequence[int] | None,
        now: float,
    ) -> None:
        self._store.update_message(self.message_id, text, finish_reason, meta, token_ids)
        count = len(token_ids) if token_ids is not None else self._written[2]
        self._written = (text, meta, count)
        self._last_write = now
        self.writes += 1
