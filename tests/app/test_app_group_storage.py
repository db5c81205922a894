"""A reply's alternatives are stored with it, and a database from before the `meta` column
opens with every conversation intact."""

from __future__ import annotations

import sqlite3

from app.chat.conversations import ConversationStore, ReplyCheckpoint
from app.chat.exchange import export_json
from app.chat.group_reply import Alternative, GroupReply

# The messages table as kvscope created it before replies carried metadata.
OLD_SCHEMA = """
CREATE TABLE conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')), content TEXT NOT NULL,
    finish_reason TEXT, model TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);
INSERT INTO conversations VALUES (1, 'Old chat', 'Be brief.', 1.0, 2.0);
INSERT INTO messages VALUES (1, 1, 'user', 'Hello', NULL, NULL, 1.0, 1.0);
INSERT INTO messages VALUES (2, 1, 'assistant', 'Hi!', 'stop', 'tiny', 2.0, 2.0);
"""


def test_an_older_database_gains_the_meta_column_and_keeps_its_messages(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(OLD_SCHEMA)
    old.close()

    store = ConversationStore(path)
    conv = store.load(1)
    assert (conv.title, conv.system_prompt) == ("Old chat", "Be brief.")
    assert [(m.id, m.role, m.content, m.finish_reason, m.model, m.meta) for m in conv.messages] == [
        (1, "user", "Hello", None, None, None),
        (2, "assistant", "Hi!", "stop", "tiny", None),
    ]
    store.update_message(2, "Hi!", "stop", {"note": 1})
    store.close()
    assert ConversationStore(path).load(1).messages[1].meta == {"note": 1}  # and opens again


def test_a_group_reply_is_stored_with_its_alternatives(tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    conv = store.create()
    msg = store.add_message(conv.id, "assistant", "")
    checkpoint = ReplyCheckpoint(store, msg.id, interval_s=0.0)
    assert checkpoint.update("par", GroupReply.streaming({0: "par", 1: "tia"}, 2).to_meta())
    mid = GroupReply.from_meta(store.load(conv.id).messages[0].meta)
    assert [a.text for a in mid.alternatives] == ["par", "tia"] and mid.kept is None

    reply = GroupReply(
        "beams", [Alternative(0, "best", -0.2, "stop", 2), Alternative(1, "next", -0.4, "length", 3)], 0
    )
    checkpoint.finish(reply.kept_text, "stop", reply.to_meta())
    stored = store.load(conv.id)
    assert stored.messages[0].content == "best" and GroupReply.from_meta(stored.messages[0].meta) == reply
    assert '"next"' in export_json(stored)  # the alternatives travel with a JSON export
    assert GroupReply.from_meta({"something": "else"}) is None
