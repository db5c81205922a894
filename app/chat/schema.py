"""The conversation database's schema, and the in-place migration of databases older kvscopes made.

Versions (`PRAGMA user_version`):
  0  the first release: linear conversations; later ones added `messages.meta` (a reply's
     alternatives) by ALTER TABLE, still at version 0.
  2  conversations are trees: `messages.parent_id` (None for a first message), the visible
     path's `conversations.current_leaf_id`, a reply's `messages.token_ids`, and an FTS5 index
     of every message's text for search.
Columns added in place later, within version 2 (an older kvscope reads its own columns and leaves
these be): `conversations.settings`, a chat's structured output and tools (JSON).
A version-0 database is migrated in one transaction, keeping every row: each message's parent
becomes the message before it in its conversation (its line becomes one branch), and the
current leaf its last message. A database from a newer kvscope is refused, not guessed at.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA_VERSION = 2

# AUTOINCREMENT: a deleted message's id is never handed out again, so an id names one message
# for good (in exports, and in the app's in-memory maps).
_TABLES = (
    """CREATE TABLE IF NOT EXISTS conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        current_leaf_id INTEGER,
        settings TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
        content TEXT NOT NULL,
        finish_reason TEXT,
        model TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        meta TEXT,
        parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
        token_ids TEXT
    )""",
)
# Columns later than the first release's tables, in the order they were added.
_ADDED_COLUMNS = (
    ("messages", "meta", "TEXT"),
    ("messages", "parent_id", "INTEGER REFERENCES messages(id) ON DELETE CASCADE"),
    ("messages", "token_ids", "TEXT"),
    ("conversations", "current_leaf_id", "INTEGER"),
    ("conversations", "settings", "TEXT"),
)
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id)",
    "CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(parent_id)",
)
# External-content FTS5 over messages.content, kept in step by triggers (a streaming reply's
# checkpoint is an UPDATE of content: its words are searchable as they are saved).
_FTS = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(content, content='messages', "
    "content_rowid='id', tokenize='unicode61 remove_diacritics 2')",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE OF content ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
)


class SchemaError(Exception):
    """The database cannot be brought to this version's schema; str() is for the user."""


def probe(path: Path) -> None:
    """Check an existing file is a database this version can read, through a read-only
    connection: one that fails leaves the file and its WAL as they were (a read-write
    connection's close would checkpoint or delete the WAL of a file it could not read).
    Raises sqlite3.Error or SchemaError."""
    if not path.exists() or path.stat().st_size == 0:
        return
    # immutable: no locks and no shared-memory file either; the header is all it reads.
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
    try:
        _check_version(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def _check_version(version: int) -> None:
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"it was written by a newer kvscope (schema version {version}; this one reads up to "
            f"{SCHEMA_VERSION}): update kvscope to open it"
        )


def prepare(db: sqlite3.Connection) -> bool:
    """Create or migrate the schema (one transaction); True when full-text search is available
    (an SQLite built without FTS5 still stores conversations; search then scans the text)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    _check_version(version)
    db.execute("BEGIN IMMEDIATE")
    try:
        for sql in _TABLES:
            db.execute(sql)
        added = _add_missing_columns(db)
        if version < SCHEMA_VERSION and ("messages", "parent_id") in added:
            _link_linear_conversations(db)
        for sql in _INDEXES:
            db.execute(sql)
        fts = _create_fts(db)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return fts


def fts_available(db: sqlite3.Connection) -> bool:
    row = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'").fetchone()
    return row is not None


def _add_missing_columns(db: sqlite3.Connection) -> set[tuple[str, str]]:
    added = set()
    for table, column, decl in _ADDED_COLUMNS:
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            added.add((table, column))
    return added


def _link_linear_conversations(db: sqlite3.Connection) -> None:
    """A first-release conversation is a line: each message answers the one before it."""
    db.execute(
        "UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p "
        "WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id)"
    )
    db.execute(
        "UPDATE conversations SET current_leaf_id = "
        "(SELECT MAX(m.id) FROM messages m WHERE m.conversation_id = conversations.id)"
    )


def _create_fts(db: sqlite3.Connection) -> bool:
    if fts_available(db):
        return True
    try:
        db.execute(_FTS[0])
    except sqlite3.OperationalError as exc:
        if "fts5" in str(exc).lower():
            return False
        raise
    for sql in _FTS[1:]:
        db.execute(sql)
    db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
    return True
