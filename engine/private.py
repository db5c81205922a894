"""Folders and files only their owner can read: the conversation store, kvscope's caches and the
models it downloads hold what the user wrote and fetched, and another account on the machine has
no business reading them.

Only what kvscope creates is made private (0700 folders, 0600 files); a folder the user chose
and that exists already keeps the permissions it has. Plain Python, usable on every layer.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """`path` and every missing folder above it, each created 0700 (`Path.mkdir(parents=True)`
    would create the parents with the default mode). Raises OSError as mkdir does."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            os.mkdir(folder, PRIVATE_DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")
    return path


def create_private_file(path: Path) -> bool:
    """Create `path` empty and 0600 if it does not exist; True when it was created here. (SQLite
    gives a database's -wal and -shm files the database file's own permissions.)"""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def open_private_append(path: Path) -> int:
    """A file descriptor appending to `path`, which is created 0600 when missing."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE)


def write_private_text(path: Path, text: str) -> None:
    """`text` into `path` through a 0600 temp file and a rename (a reader never sees half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
