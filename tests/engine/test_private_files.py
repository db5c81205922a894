"""What kvscope creates for the user alone: folders 0700 (every one it creates, parents
included), files 0600; the conversation store (and SQLite's -wal/-shm beside it), kvscope's
cache folders and the kernel table, and the Hub's downloaded files (tests/engine/test_hub.py);
the app's folders in tests/app/test_private_store.py."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from engine.private import create_private_file, private_dir, write_private_text


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_private_dir_creates_every_missing_folder_0700_and_leaves_existing_ones(tmp_path):
    existing = tmp_path / "mine"
    existing.mkdir(mode=0o755)
    existing.chmod(0o755)
    leaf = private_dir(existing / "a" / "b" / "c")
    assert leaf.is_dir()
    assert [mode(existing / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    assert mode(existing) == 0o755, "a folder that was there keeps its permissions"
    assert private_dir(leaf) == leaf  # again: nothing to do
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        private_dir(tmp_path / "file")


def test_private_files_are_0600(tmp_path):
    assert create_private_file(tmp_path / "db")
    assert not create_private_file(tmp_path / "db"), "an existing file is left alone"
    assert mode(tmp_path / "db") == 0o600
    write_private_text(tmp_path / "table.json", "{}")
    assert mode(tmp_path / "table.json") == 0o600 and (tmp_path / "table.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] != [], "no temp file left behind"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db", "table.json"]


def test_kvscope_cache_folders_and_the_kernel_table_are_private(tmp_path, monkeypatch):
    from engine.cache_dirs import cache_root, writable_cache_dir
    from engine.kernels import policy

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    writable_cache_dir(cache_root() / "models")
    assert mode(tmp_path / "cache") == 0o700 and mode(tmp_path / "cache" / "models") == 0o700
    policy._save_cached("int4-g32", {1: "packed"})
    table = policy._cache_file()
    assert mode(table.parent) == 0o700 and mode(table) == 0o600
    assert policy._load_cached() == {"int4-g32": {1: "packed"}}
