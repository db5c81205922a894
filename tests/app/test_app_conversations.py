"""Conversation storage: what is written is what a relaunch reads back, and exports are faithful."""

from __future__ import annotations

import json
import sqlite3

import pytest

from app.chat.conversations import (
    DEFAULT_TITLE,
    ConversationStore,
    ReplyCheckpoint,
    StorageError,
    title_from,
)
from app.chat.exchange import export_json, export_markdown


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "conversations.sqlite3"


def test_messages_survive_reopening_the_database(db_path):
    store = ConversationStore(db_path)
    conv = store.create(system_prompt="Be brief.")
    store.add_message(conv.id, "user", "Hi 👋")
    reply = store.add_message(conv.id, "assistant", "", model="tiny")
    store.update_message(reply.id, "Hello!", "stop")
    store.close()

    reopened = ConversationStore(db_path).load(conv.id)
    assert reopened.system_prompt == "Be brief."
    assert [(m.role, m.content, m.finish_reason, m.model) for m in reopened.messages] == [
        ("user", "Hi 👋", None, None),
        ("assistant", "Hello!", "stop", "tiny"),
    ]


def test_each_write_is_committed_at_once(db_path):
    """A second connection (as after a crash) sees every write without any close or flush."""
    store = ConversationStore(db_path)
    conv = store.create()
    msg = store.add_message(conv.id, "assistant", "")
    store.update_message(msg.id, "partial repl", None)
    other = sqlite3.connect(db_path)
    assert other.execute("SELECT content FROM messages WHERE id = ?", (msg.id,)).fetchone() == (
        "partial repl",
    )


def test_summaries_are_newest_first_with_counts(db_path):
    clock = FakeClock()
    store = ConversationStore(db_path, clock=clock)
    older = store.create(title="older")
    clock.t += 10
    newer = store.create(title="newer")
    clock.t += 10
    store.add_message(older.id, "user", "bump")  # a new message makes it the most recent
    summaries = store.summaries()
    assert [(s.id, s.title, s.message_count) for s in summaries] == [
        (older.id, "older", 1),
        (newer.id, "newer", 0),
    ]


def test_delete_messages_from_drops_the_tail_only(db_path):
    store = ConversationStore(db_path)
    conv = store.create()
    ids = [
        store.add_message(conv.id, role, text).id
        for role, text in (("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))
    ]
    store.delete_messages_from(conv.id, ids[2])
    assert [m.content for m in store.load(conv.id).messages] == ["a", "b"]


def test_deleting_a_conversation_deletes_its_messages(db_path):
    store = ConversationStore(db_path)
    conv = store.create()
    store.add_message(conv.id, "user", "x")
    store.delete(conv.id)
    assert store.load(conv.id) is None
    assert store._db.execute("SELECT COUNT(*) FROM messages").fetchone() == (0,)


def test_unopenable_database_is_a_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match="Cannot open the conversation database"):
        ConversationStore(blocker / "conversations.sqlite3")


def test_reply_checkpoint_writes_at_most_once_per_interval_and_always_at_finish(db_path):
    store = ConversationStore(db_path)
    conv = store.create()
    msg = store.add_message(conv.id, "assistant", "")
    clock = FakeClock(0.0)
    checkpoint = ReplyCheckpoint(store, msg.id, interval_s=1.0, clock=clock)

    clock.t = 0.5
    assert not checkpoint.update("He")  # too soon after the row was created
    clock.t = 1.0
    assert checkpoint.update("Hello")
    clock.t = 1.9
    assert not checkpoint.update("Hello wor")
    assert store.load(conv.id).messages[0].content == "Hello"  # what a crash now would keep
    clock.t = 2.0
    assert checkpoint.update("Hello world")
    clock.t = 2.1
    checkpoint.finish("Hello world!", "stop")  # finish writes regardless of the interval
    saved = store.load(conv.id).messages[0]
    assert (saved.content, saved.finish_reason) == ("Hello world!", "stop")
    assert checkpoint.writes == 3


def test_title_from_first_message():
    assert title_from("  What is a KV cache?\nExplain.") == "What is a KV cache? Explain."
    long = "word " * 40
    title = title_from(long)
    assert title.endswith("…") and len(title) <= 61 and not title[:-1].endswith(" ")
    assert title_from("   ") == DEFAULT_TITLE


def test_exports_hold_every_message(db_path):
    store = ConversationStore(db_path)
    conv = store.create(system_prompt="You are terse.", title="Paging")
    store.add_message(conv.id, "user", "What is paging?")
    reply = store.add_message(conv.id, "assistant", "")
    store.update_message(reply.id, "Fixed-size blocks.\n\n```py\nx = 1\n```", "cancelled")
    conv = store.load(conv.id)

    md = export_markdown(conv)
    assert md.startswith("# Paging\n")
    assert "**System**\n\nYou are terse." in md
    assert "**User**\n\nWhat is paging?" in md
    assert "**Assistant (cancelled)**\n\nFixed-size blocks.\n\n```py\nx = 1\n```" in md

    data = json.loads(export_json(conv))
    assert data["title"] == "Paging" and data["system_prompt"] == "You are terse."
    assert [(m["role"], m["content"], m["finish_reason"]) for m in data["messages"]] == [
        ("user", "What is paging?", None),
        ("assistant", "Fixed-size blocks.\n\n```py\nx = 1\n```", "cancelled"),
    ]
