"""The conversation store and the app's data folder are the user's alone: folders 0700, the
database and SQLite's -wal/-shm beside it 0600 (engine.private)."""

from __future__ import annotations

import stat
from pathlib import Path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_conversation_store_and_its_wal_are_private(tmp_path):
    from app.chat.conversations import ConversationStore

    store = ConversationStore(tmp_path / "data" / "kvscope" / "conversations.sqlite3")
    conv = store.create()
    store.add_message(conv.id, "user", "a private thought")
    folder = tmp_path / "data" / "kvscope"
    assert mode(tmp_path / "data") == 0o700 and mode(folder) == 0o700
    files = sorted(folder.iterdir())
    assert {p.name for p in files} >= {"conversations.sqlite3", "conversations.sqlite3-wal"}
    assert all(mode(p) == 0o600 for p in files), [(p.name, oct(mode(p))) for p in files]
    store.close()


def test_the_app_data_folder_is_created_private(tmp_path, monkeypatch):
    from app.paths import data_dir

    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path / "x" / "data"))
    assert mode(data_dir()) == 0o700 and mode(tmp_path / "x") == 0o700
