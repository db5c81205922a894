"""Where kvscope keeps the user's data and settings, and where the app's shipped assets are.

Both folders honour an environment override so tests (and portable installs) never touch the
real user directories: KVSCOPE_DATA_DIR for conversations, KVSCOPE_CONFIG_DIR for settings.
A folder that cannot be created or written raises DirectoryError with a message for the user
(a read-only home, a path through a file): the app reports it at startup instead of failing at
the first save. Assets go through engine.api.resource, the one lookup that also works frozen.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from platformdirs import user_config_dir, user_data_dir

from engine.api import private_dir, resource

APP_NAME = "kvscope"


class DirectoryError(Exception):
    """A folder kvscope needs cannot be created or written; str() is for the user."""


def writable_dir(path: Path, what: str, override: str) -> Path:
    """`path`, created if needed (private: 0700, as every folder it creates above it) and
    proven writable (a file made and removed in it)."""
    try:
        private_dir(path)
        # mkdir(exist_ok=True) succeeds on a folder we cannot write into; find out now.
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise DirectoryError(
            f"cannot write the {what} folder {path} ({reason}). Make it writable, or set {override} "
            "to a folder you can write."
        ) from exc
    return path


def data_dir() -> Path:
    override = os.environ.get("KVSCOPE_DATA_DIR")
    path = Path(override).expanduser() if override else Path(user_data_dir(APP_NAME))
    return writable_dir(path, "data", "KVSCOPE_DATA_DIR")


def config_dir() -> Path:
    override = os.environ.get("KVSCOPE_CONFIG_DIR")
    path = Path(override).expanduser() if override else Path(user_config_dir(APP_NAME))
    return writable_dir(path, "settings", "KVSCOPE_CONFIG_DIR")


DB_NAME = "conversations.sqlite3"


def conversations_db_path() -> Path:
    """The conversation database. A data folder that cannot be written but already holds one
    is still its place: the store opens it read-only and the window says so."""
    try:
        return data_dir() / DB_NAME
    except DirectoryError:
        override = os.environ.get("KVSCOPE_DATA_DIR")
        folder = Path(override).expanduser() if override else Path(user_data_dir(APP_NAME))
        if (folder / DB_NAME).is_file():
            return folder / DB_NAME
        raise


def settings_path() -> Path:
    return config_dir() / "settings.ini"


def asset_path(name: str) -> Path:
    """A file of the repository's assets/ folder (in the frozen bundle: its assets/ folder)."""
    return resource(f"assets/{name}")
