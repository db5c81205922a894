"""The app under faults (issue 24): the disk filling while a reply is saved, the conversation
database in a read-only folder, a remote engine that vanishes mid-reply. (kill -9 during a Hub
download: tests/engine/test_hub_kill.py.)"""

from __future__ import annotations

import os
import sqlite3
import threading

import pytest
from app_windows import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, StepGate

from app.chat.conversations import ConversationStore
from app.paths import conversations_db_path
from app.remote.target import RemoteTarget
from engine.config import EngineConfig, SamplingParams


def use_params(window, **kw) -> None:
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, ignore_eos=True, **kw))


class FullDisk:
    """The store's connection as SQLite answers on a full disk: every write raises 'database
    or disk is full' (SQLITE_FULL), reads go on."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.full = db, True

    def execute(self, sql: str, params=()):
        if self.full and sql.lstrip().split()[0].upper() in ("INSERT", "UPDATE", "DELETE", "BEGIN"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, params)

    def __getattr__(self, name):
        return getattr(self.db, name)


def fill_the_disk(store: ConversationStore) -> FullDisk:
    disk = store._db = FullDisk(store._db)
    return disk


def free_the_disk(store: ConversationStore) -> None:
    store._db.full = False


def test_a_full_disk_while_a_reply_is_saved_says_so_and_keeps_the_conversation(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=48)
    messages: list[tuple[str, str]] = []
    window.controller.status_message.connect(lambda text, kind: messages.append((kind, text)))
    gate = StepGate(window.host.engine.core, after_steps=4)
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.send("Tell me something long " * 40)  # enough text to need new pages
        qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
        conv_id = window.controller.conversation.id
        before = [(m.role, m.content) for m in window.conversations.load(conv_id).messages]
        fill_the_disk(window.conversations)
        gate.release()
    text = finished.args[0].text
    qtbot.waitUntil(lambda: window.controller.active is None, timeout=REPLY_TIMEOUT_MS)
    errors = [t for kind, t in messages if kind == "error"]
    assert errors and "disk is full" in errors[-1] and "stays on screen" in errors[-1]
    assert "Traceback" not in errors[-1]
    assert window.chat.transcript.bubbles[-1].text == text, "the whole reply stays on screen"
    stored = [(m.role, m.content) for m in window.conversations.load(conv_id).messages]
    assert stored[0] == before[0] and stored[1][1] == before[1][1], "what was saved is intact"
    assert window.conversations._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert window.controller.conversation.messages[-1].content == text, "nor lost in memory"
    free_the_disk(window.conversations)
    use_params(window, max_new_tokens=4)
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        window.controller.send("and now?")
    qtbot.waitUntil(lambda: window.controller.active is None, timeout=REPLY_TIMEOUT_MS)
    stored = [(m.role, m.content) for m in window.conversations.load(conv_id).messages]
    assert stored[1] == ("assistant", text), "the reply the full disk refused is saved once there is room"
    assert stored[2][1] == "and now?" and len(stored) == 4


def test_sqlites_own_full_disk_is_named_and_leaves_the_database_intact(tmp_path):
    """A real SQLITE_FULL (a page limit the database has reached) rather than the stand-in."""
    from app.chat.conversations import StorageError

    store = ConversationStore(tmp_path / "c.sqlite3")
    conv = store.create()
    kept = store.add_message(conv.id, "user", "kept")
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(StorageError, match="The disk is full"):
        store.add_message(conv.id, "assistant", "x" * 200_000)
    assert [m.id for m in store.load(conv.id).messages] == [kept.id]
    assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store.close()


def test_a_read_only_database_folder_opens_read_only_with_a_banner(make_window, qtbot, monkeypatch, tmp_path):
    path = conversations_db_path()
    store = ConversationStore(path)
    conv = store.create(title="Kept")
    store.add_message(conv.id, "user", "an old question")
    store.add_message(conv.id, "assistant", "an old answer", finish_reason="stop")
    store.close()
    folder = path.parent
    # The folder read-only as its user sees it (tests may run as root, whom permissions do not
    # stop): os.access says it cannot be written, and making a file in it fails.
    access, temporary = os.access, __import__("tempfile").TemporaryFile

    def no_write_access(p, mode):
        return False if mode == os.W_OK and str(p).startswith(str(folder)) else access(p, mode)

    def no_files_in_folder(**kw):
        if str(kw.get("dir", "")) == str(folder):
            raise PermissionError(13, "Permission denied")
        return temporary(**kw)

    monkeypatch.setattr(os, "access", no_write_access)
    monkeypatch.setattr("app.paths.tempfile.TemporaryFile", no_files_in_folder)
    assert conversations_db_path() == path, (
        "a read-only data folder that holds the database is still its place"
    )
    window = make_window()
    assert window.conversations.read_only
    banner = window.chat.banner.text
    assert "read-only" in banner and str(folder) in banner
    summaries = window.conversations.summaries()
    assert [s.title for s in summaries] == ["Kept"]
    loaded = window.conversations.load(summaries[0].id)
    assert [m.content for m in loaded.messages] == ["an old question", "an old answer"]
    assert window.conversations.search("question"), "search works read-only"
    messages: list[tuple[str, str]] = []
    window.controller.status_message.connect(lambda text, kind: messages.append((kind, text)))
    use_params(window, max_new_tokens=3)
    window.controller.new_conversation()
    window.controller.send("a new question")
    qtbot.waitUntil(lambda: any("read-only" in t for _, t in messages), timeout=REPLY_TIMEOUT_MS)
    qtbot.waitUntil(lambda: window.controller.active is None, timeout=REPLY_TIMEOUT_MS)
    with sqlite3.connect(path) as db:  # nothing was written
        assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 2


def test_a_remote_engine_that_vanishes_mid_reply_keeps_the_partial_reply_and_offers_reattach(
    make_window, qtbot, tiny_loaded
):
    from engine.serve.server import BackgroundServer

    server = BackgroundServer(EngineConfig(block_size=4, num_blocks=128), loaded=tiny_loaded).start()
    port = int(server.url.rsplit(":", 1)[1])
    window = make_window(start=False)
    try:
        use_params(window, max_new_tokens=400)
        window.remote_views.attach(RemoteTarget.parse(server.url))
        qtbot.waitUntil(lambda: window.host.status().ready, timeout=LOAD_TIMEOUT_MS)
        window.controller.new_conversation()
        gate = StepGate(server.bridge.engine.core, after_steps=8)  # the server stops mid-reply
        window.controller.send("Hello")
        qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
        qtbot.waitUntil(
            lambda: window.controller.active is not None and bool(window.controller.active.text),
            timeout=REPLY_TIMEOUT_MS,
        )
        server._server.should_exit = True  # the server goes away: its HTTP side first...
        server._thread.join(30)
        gate.release()
        server.bridge.shutdown()  # ...then its engine
        qtbot.waitUntil(lambda: window.controller.active is None, timeout=REPLY_TIMEOUT_MS)
        reply = window.conversations.load(window.controller.conversation.id).messages[-1]
        assert reply.role == "assistant" and reply.content and reply.finish_reason == "failed"
        assert window.chat.transcript.bubbles[-1].text == reply.content, "the partial reply is kept"
        qtbot.waitUntil(lambda: "stopped answering" in window.chat.banner.text, timeout=REPLY_TIMEOUT_MS)
        assert window.chat.banner.action.text() == "Reattach" and window.chat.banner.action.isVisible()
        server = BackgroundServer(
            EngineConfig(block_size=4, num_blocks=128), loaded=tiny_loaded, port=port
        ).start()
        window.chat.banner.action.click()
        qtbot.waitUntil(lambda: window.host.attached and window.host.status().ready, timeout=LOAD_TIMEOUT_MS)
        assert not window.chat.banner.isVisible()
        use_params(window, max_new_tokens=3)
        with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
            window.controller.send("Are you back?")
    finally:
        server.stop()
        for thread in threading.enumerate():  # the picker's look at the model (slow on a busy machine)
            if thread.name == "kvscope-inspect":
                thread.join(120)
