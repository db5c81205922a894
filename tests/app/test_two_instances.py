"""Two kvscope processes on one conversation database: both write at once, nothing is lost, no
"database is locked"; a writer waits out another's lock instead of failing."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

from app.chat.conversations import ConversationStore

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = 60

# One instance: open the store, wait until the other instance has too (so they overlap), then
# write a conversation message by message, reading the other's conversations as it goes.
INSTANCE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from app.chat.conversations import ConversationStore

    db, name, me, other, count = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
    store = ConversationStore(db)
    me.touch()
    deadline = time.monotonic() + 60
    while not other.exists():
        if time.monotonic() > deadline:
            sys.exit("the other instance never started")
        time.sleep(0.01)
    conv = store.create(title=name)
    for i in range(count):
        store.add_message(conv.id, "user" if i % 2 == 0 else "assistant", f"{name} {i}")
        store.summaries()  # reads while the other writes
    store.close()
    """
)


def test_two_instances_write_one_database_at_the_same_time(tmp_path):
    db = tmp_path / "conversations.sqlite3"
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", INSTANCE, str(db), name, str(ready[i]), str(ready[1 - i]), str(MESSAGES)],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, name in enumerate(("first", "second"))
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    store = ConversationStore(db)
    try:
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        by_title = {s.title: s for s in store.summaries()}
        assert set(by_title) == {"first", "second"}
        for name, summary in by_title.items():
            texts = [m.content for m in store.load(summary.id).messages]
            assert texts == [f"{name} {i}" for i in range(MESSAGES)]
    finally:
        store.close()


@contextlib.contextmanager
def committed_soon(other: sqlite3.Connection, after_s: float) -> Iterator[None]:
    """Another instance's open write transaction, committed (and its connection closed) from a
    thread `after_s` seconds into the block."""
    releaser = threading.Timer(after_s, lambda: other.execute("COMMIT"))
    releaser.start()
    try:
        yield
    finally:
        releaser.join()
        other.close()


def test_a_writer_waits_for_another_instances_lock(tmp_path):
    db = tmp_path / "conversations.sqlite3"
    store = ConversationStore(db)
    conv = store.create()
    # The other instance, mid-write: it holds the write lock until released.
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('other', 0, 0)")
    with committed_soon(other, after_s=0.5):
        # Without a busy timeout this raises StorageError("database is locked") at once.
        message = store.add_message(conv.id, "user", "written after the other's commit")
    assert store.load(conv.id).messages[-1].id == message.id
    assert {s.title for s in store.summaries()} >= {"other"}
    store.close()


def test_opening_waits_out_another_instance_that_is_creating_the_same_database(tmp_path):
    """Two instances starting together on a new file: while one holds the write lock, the other's
    switch to WAL gets "database is locked" at once from SQLite (no busy wait, which could
    deadlock); the store retries it instead of refusing to open."""
    db = tmp_path / "conversations.sqlite3"
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # the other instance, mid-way through creating the schema
    other.execute("CREATE TABLE IF NOT EXISTS being_created (x)")
    plain = sqlite3.connect(db, isolation_level=None, timeout=5.0)
    try:
        plain.execute("PRAGMA journal_mode=WAL")
        raise AssertionError("SQLite waited: the case this test stands for no longer arises")
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc)  # at once, though the connection would wait 5 s for a write
    finally:
        plain.close()
    with committed_soon(other, after_s=0.3):
        store = ConversationStore(db)
    try:
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store.create(title="opened").title == "opened"
    finally:
        store.close()
