"""Conversations as trees in SQLite: branches kept, the visible path remembered, a first-release
database migrated in place, full-text search, exports of the tree or the path and an import
that round-trips, and replies a crash cut off marked interrupted."""

from __future__ import annotations

import json
import sqlite3

import pytest

from app.chat.conversations import INTERRUPTED, ConversationStore, StorageError
from app.chat.exchange import ImportFailed, export_json, export_markdown, import_json
from app.chat.schema import SCHEMA_VERSION
from app.chat.search import match_query


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        self.t += 1.0
        return self.t


@pytest.fixture
def store(tmp_path):
    s = ConversationStore(tmp_path / "c.sqlite3", clock=Clock())
    yield s
    s.close()


def branched(store):
    """user 'Q' -> reply A (stop) | reply B -> user 'more' -> reply C; B's line is shown."""
    conv = store.create(system_prompt="Be kind.", title="Trees")
    q = store.add_message(conv.id, "user", "Q", parent_id=None)
    a = store.add_message(conv.id, "assistant", "Answer A about paging", "stop", parent_id=q.id)
    b = store.add_message(
        conv.id, "assistant", "Answer B", "stop", model="tiny", parent_id=q.id, token_ids=[5, 6]
    )
    more = store.add_message(conv.id, "user", "more", parent_id=b.id)
    c = store.add_message(
        conv.id, "assistant", "C", "length", parent_id=more.id, meta={"stats": {"tokens": 1}}
    )
    return conv.id, (q, a, b, more, c)


def test_branches_are_kept_and_the_shown_path_is_remembered(store, tmp_path):
    conv_id, (q, a, b, more, c) = branched(store)
    conv = store.load(conv_id)
    assert [m.id for m in conv.messages] == [q.id, b.id, more.id, c.id]
    assert len(conv.nodes) == 5
    assert conv.fork_position(b) == (2, 2) and conv.fork_position(conv.nodes[a.id]) == (1, 2)
    assert conv.fork_position(conv.nodes[q.id]) == (1, 1)

    store.set_current_leaf(conv_id, conv.newest_leaf(a.id))
    store.close()
    again = ConversationStore(tmp_path / "c.sqlite3")
    shown = again.load(conv_id)
    assert [m.content for m in shown.messages] == ["Q", "Answer A about paging"]
    assert shown.nodes[b.id].token_ids == (5, 6) and shown.nodes[c.id].meta == {"stats": {"tokens": 1}}
    again.close()


def test_deleting_a_branch_keeps_its_siblings(store):
    conv_id, (q, a, b, more, c) = branched(store)
    store.delete_messages_from(conv_id, b.id)
    conv = store.load(conv_id)
    assert set(conv.nodes) == {q.id, a.id}
    assert [m.id for m in conv.messages] == [q.id, a.id]
    assert store.search("more") == []  # the deleted branch's words left the index too


# The tables exactly as the first release made them (the meta column came later by ALTER TABLE).
FIRST_RELEASE = """
CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')), content TEXT NOT NULL,
    finish_reason TEXT, model TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL, meta TEXT);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
INSERT INTO conversations VALUES (1, 'First', '', 1.0, 5.0), (2, 'Second', 'sys', 2.0, 6.0);
INSERT INTO messages VALUES (1, 1, 'user', 'What is a KV cache?', NULL, NULL, 1, 1, NULL);
INSERT INTO messages VALUES (2, 2, 'user', 'Hello', NULL, NULL, 2, 2, NULL);
INSERT INTO messages VALUES (3, 1, 'assistant', 'It stores attention keys and values.', 'stop', 'm', 3, 3, NULL);
INSERT INTO messages VALUES (4, 1, 'user', 'Why pages?', NULL, NULL, 4, 4, NULL);
INSERT INTO messages VALUES (5, 1, 'assistant', 'Fragmentation.', 'length', 'm', 5, 5, '{"note": 1}');
INSERT INTO messages VALUES (6, 2, 'assistant', 'Hi!', 'stop', 'm', 6, 6, NULL);
"""


def test_a_first_release_database_is_migrated_in_place_without_loss(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(FIRST_RELEASE)
    before = old.execute(
        "SELECT id, conversation_id, role, content, finish_reason, meta FROM messages"
    ).fetchall()
    old.close()

    store = ConversationStore(path)
    first, second = store.load(1), store.load(2)
    assert [m.id for m in first.messages] == [1, 3, 4, 5]  # each message answers the one before
    assert [m.parent_id for m in first.messages] == [None, 1, 3, 4]
    assert [m.id for m in second.messages] == [2, 6] and second.system_prompt == "sys"
    assert first.messages[-1].meta == {"note": 1} and first.messages[-1].finish_reason == "length"
    assert [h.message_id for h in store.search("pages")] == [4]  # old text is in the new index
    store.close()

    raw = sqlite3.connect(path)
    after = raw.execute(
        "SELECT id, conversation_id, role, content, finish_reason, meta FROM messages"
    ).fetchall()
    assert sorted(after) == sorted(before)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()
    reopened = ConversationStore(path)  # a second open migrates nothing again
    assert [m.parent_id for m in reopened.load(1).messages] == [None, 1, 3, 4]
    reopened.close()


def test_a_database_from_a_newer_kvscope_is_refused_untouched(tmp_path):
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(StorageError, match="newer kvscope"):
        ConversationStore(path)


def test_a_file_that_is_not_a_database_is_a_storage_error(tmp_path):
    path = tmp_path / "junk.sqlite3"
    path.write_bytes(b"this is not an SQLite file" * 100)
    with pytest.raises(StorageError, match="Cannot open the conversation database"):
        ConversationStore(path)
    assert path.read_bytes() == b"this is not an SQLite file" * 100


def test_search_finds_a_word_from_an_old_reply_in_any_branch(store):
    conv_id, (q, a, b, more, c) = branched(store)
    other = store.create(title="Other")
    store.add_message(other.id, "user", "Nothing about that")
    hits = store.search("paging")
    assert [(h.conversation_id, h.message_id, h.role) for h in hits] == [(conv_id, a.id, "assistant")]
    assert "<b>paging</b>" in hits[0].snippet and hits[0].title == "Trees"
    assert [h.message_id for h in store.search("pag")] == [a.id]  # the last word is a prefix
    assert [h.message_id for h in store.search("answer paging")] == [a.id]  # every word must occur
    # Typed text is never query syntax: quotes, operators and stars are plain characters.
    for text in ['"', "AND OR NOT", "a*b", "NEAR(", "-x", "col:umn", "   "]:
        store.search(text)
    assert match_query('say "hi"') == '"say" """hi"""*'


def test_a_streaming_reply_is_searchable_as_it_is_saved(store):
    conv = store.create()
    reply = store.add_message(conv.id, "assistant", "")
    store.update_message(reply.id, "the quick zebra", None)
    assert [h.message_id for h in store.search("zebra")] == [reply.id]
    store.update_message(reply.id, "the quick fox", None)
    assert store.search("zebra") == []


def test_export_import_round_trips_exactly(store):
    conv_id, _ = branched(store)
    exported = export_json(store.load(conv_id))
    imported_id = import_json(store, exported)
    assert imported_id != conv_id
    assert export_json(store.load(imported_id)) == exported
    data = json.loads(exported)
    assert data["scope"] == "tree" and len(data["messages"]) == 5
    assert [m["parent"] for m in data["messages"]] == [None, 1, 1, 3, 4]


def test_the_visible_path_exports_alone_and_in_markdown(store):
    conv_id, _ = branched(store)
    conv = store.load(conv_id)
    path = json.loads(export_json(conv, scope="path"))
    assert [m["content"] for m in path["messages"]] == ["Q", "Answer B", "more", "C"]
    assert [m["parent"] for m in path["messages"]] == [None, 1, 2, 3] and path["current"] == 4
    line_id = import_json(store, export_json(conv, scope="path"))
    assert [m.content for m in store.load(line_id).messages] == ["Q", "Answer B", "more", "C"]
    md = export_markdown(conv)
    assert "**Assistant — version 2 of 2**\n\nAnswer B" in md and "Answer A" not in md
    assert "**Assistant (length)**\n\nC" in md


def test_a_first_release_export_imports_as_one_line(store):
    old = {
        "id": 7,
        "title": "Old",
        "system_prompt": "",
        "created_at": 1.0,
        "updated_at": 2.0,
        "messages": [
            {
                "id": 3,
                "role": "user",
                "content": "hi",
                "finish_reason": None,
                "model": None,
                "created_at": 1.0,
            },
            {
                "id": 4,
                "role": "assistant",
                "content": "yo",
                "finish_reason": "stop",
                "model": "m",
                "created_at": 2.0,
            },
        ],
    }
    conv = store.load(import_json(store, json.dumps(old)))
    assert [(m.role, m.content) for m in conv.messages] == [("user", "hi"), ("assistant", "yo")]


@pytest.mark.parametrize(
    "text, says",
    [
        ("not json", "not JSON"),
        ("[]", "no list of messages"),
        ('{"format": "other", "version": 1, "messages": []}', "format"),
        ('{"format": "kvscope-conversation", "version": 99, "messages": []}', "newer kvscope"),
        (
            '{"format": "kvscope-conversation", "version": 2, "messages": [{"id": 1, "role": "robot"}]}',
            "role",
        ),
        (
            '{"format": "kvscope-conversation", "version": 2, "messages": '
            '[{"id": 1, "parent": 2, "role": "user", "content": "x"}]}',
            "comes later",
        ),
    ],
)
def test_an_import_that_is_not_a_conversation_says_why_and_stores_nothing(store, text, says):
    with pytest.raises(ImportFailed, match=says):
        import_json(store, text)
    assert store.summaries() == []


def test_replies_left_streaming_by_a_crash_are_marked_interrupted(store):
    conv = store.create()
    store.add_message(conv.id, "user", "go")
    cut = store.add_message(conv.id, "assistant", "half a rep")  # finish reason NULL: streaming
    done = store.add_message(conv.id, "assistant", "whole", "stop")
    assert store.mark_interrupted() == 1
    nodes = store.load(conv.id).nodes
    assert nodes[cut.id].finish_reason == INTERRUPTED and nodes[cut.id].content == "half a rep"
    assert nodes[done.id].finish_reason == "stop"
    assert store.mark_interrupted() == 0
