"""Where kvscope keeps the user's data and settings.

Both honour an environment override so tests (and portable installs) never touch the real
user directories: KVSCOPE_DATA_DIR for conversations, KVSCOPE_CONFIG_DIR for settings.
"""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_config_dir, user_data_dir

APP_NAME = "kvscope"


def data_dir() -> Path:
    override = os.environ.get("KVSCOPE_DATA_DIR")
    path = Path(override).expanduser() if override else Path(user_data_dir(APP_NAME))
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    override = os.environ.get("KVSCOPE_CONFIG_DIR")
    path = Path(override).expanduser() if override else Path(user_config_dir(APP_NAME))
    path.mkdir(parents=True, exist_ok=True)
    return path


def conversations_db_path() -> Path:
    return data_dir() / "conversations.sqlite3"


def settings_path() -> Path:
    return config_dir() / "settings.ini"


def asset_path(name: str) -> Path:
    """A file from the repository's assets/ folder (shipped beside the app package)."""
    return Path(__file__).resolve().parent.parent / "assets" / name
