"""A conversation database that cannot be opened: a dialog with the reason, then either the file
set aside untouched and a fresh database, or quit; scripted runs keep the one-line error."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

from app.chat.conversations import ConversationStore, StorageError
from app.chat.db_recovery import QUIT, SET_ASIDE, ask_with_dialog, open_conversations

JUNK = b"SQLite format 2? no: these are not the bytes of a database " * 50


@pytest.fixture
def broken(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    path.write_bytes(JUNK)
    (tmp_path / "conversations.sqlite3-wal").write_bytes(b"wal bytes")
    return path


def test_set_aside_keeps_the_file_untouched_and_starts_fresh(broken):
    asked, told = [], []
    store = open_conversations(broken, True, ask=lambda r, p: asked.append(r) or SET_ASIDE, tell=told.append)
    assert "Cannot open the conversation database" in asked[0] and "not a database" in asked[0]
    kept = [p for p in broken.parent.iterdir() if ".unreadable-" in p.name]
    main = next(p for p in kept if p.suffix == ".sqlite3")
    assert main.read_bytes() == JUNK  # the bytes, untouched
    assert next(p for p in kept if p.name.endswith("-wal")).read_bytes() == b"wal bytes"
    assert str(main) in told[0]
    conv = store.create()
    store.add_message(conv.id, "user", "a fresh start")
    store.close()
    assert [m.content for m in ConversationStore(broken).load(conv.id).messages] == ["a fresh start"]


def test_quit_leaves_everything_as_it_was(broken):
    assert open_conversations(broken, True, ask=lambda r, p: QUIT) is None
    assert broken.read_bytes() == JUNK
    assert sorted(p.name for p in broken.parent.iterdir()) == [
        "conversations.sqlite3",
        "conversations.sqlite3-wal",
    ]


def test_a_scripted_run_gets_the_error_not_a_dialog(broken):
    with pytest.raises(StorageError, match="not a database"):
        open_conversations(broken, False, ask=lambda r, p: pytest.fail("no dialog in a scripted run"))


def test_the_dialog_shows_the_reason_and_offers_both_ways(qtbot, broken):
    seen = []

    def answer():
        box = next(w for w in QApplication.topLevelWidgets() if isinstance(w, QMessageBox) and w.isVisible())
        seen.append((box.text(), box.informativeText(), [b.text() for b in box.buttons()]))
        next(b for b in box.buttons() if b.text().startswith("Set it aside")).click()

    QTimer.singleShot(200, answer)
    assert (
        ask_with_dialog("Cannot open the conversation database at X: file is not a database", broken)
        == SET_ASIDE
    )
    text, info, buttons = seen[0]
    assert "file is not a database" in text and "untouched" in info
    assert sorted(buttons) == ["Quit", "Set it aside and start fresh"]
