"""Opening the conversation database at launch, and what happens when it cannot be opened.

Someone who starts kvscope from a desktop entry sees no terminal, so a line on stderr is not an
answer: a dialog says why the database cannot be opened and offers to set the file aside
(renamed, its bytes untouched, with its WAL and shared-memory files) and start a fresh one, or
to quit. Scripted runs keep the one-line error and exit status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from app.chat.conversations import ConversationStore, StorageError

SET_ASIDE, QUIT = "set_aside", "quit"
SIDECARS = ("-wal", "-shm")  # SQLite's files beside a WAL database: they belong to it


def set_aside_path(path: Path, now: float | None = None) -> Path:
    """Where an unreadable database goes: beside it, named for when it was set aside."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    candidate = path.with_name(f"{path.stem}.unreadable-{stamp}{path.suffix}")
    n = 2
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}.unreadable-{stamp}-{n}{path.suffix}")
        n += 1
    return candidate


def set_aside(path: Path) -> Path:
    """Rename the database (and its sidecar files) out of the way; returns its new path."""
    target = set_aside_path(path)
    path.rename(target)
    for suffix in SIDECARS:
        sidecar = path.with_name(path.name + suffix)
        if sidecar.exists():
            sidecar.rename(target.with_name(target.name + suffix))
    return target


def ask_with_dialog(reason: str, path: Path) -> str:
    """The dialog: the reason, and the two ways on. Returns SET_ASIDE or QUIT."""
    from PySide6.QtWidgets import QMessageBox

    box = QMessageBox(QMessageBox.Icon.Critical, "kvscope cannot open its conversations", reason)
    box.setInformativeText(
        f"kvscope can set the file aside, untouched (renamed beside it in {path.parent}), and start "
        "with a fresh, empty database; or you can quit and look at the file first."
    )
    fresh = box.addButton("Set it aside and start fresh", QMessageBox.ButtonRole.AcceptRole)
    box.addButton("Quit", QMessageBox.ButtonRole.RejectRole)
    box.setDefaultButton(fresh)
    box.setObjectName("databaseErrorDialog")
    box.exec()
    return SET_ASIDE if box.clickedButton() is fresh else QUIT


def open_conversations(
    path: Path,
    interactive: bool,
    ask: Callable[[str, Path], str] = ask_with_dialog,
    tell: Callable[[str], None] | None = None,
) -> ConversationStore | None:
    """The store at `path`. When it cannot be opened: raise (scripted), or ask (interactive)
    and either set the file aside and open a fresh one, or return None (quit)."""
    try:
        return ConversationStore(path)
    except StorageError as exc:
        if not interactive:
            raise
        reason = str(exc)
    if ask(reason, path) != SET_ASIDE:
        return None
    try:
        moved = set_aside(path) if path.exists() else None
        store = ConversationStore(path)
    except (OSError, StorageError) as exc:
        _tell(tell, f"kvscope could not start a fresh database either: {exc}")
        return None
    if moved is not None:
        _tell(tell, f"The unreadable database was kept, untouched, as {moved}.", error=False)
    return store


def _tell(tell: Callable[[str], None] | None, message: str, error: bool = True) -> None:
    if tell is not None:
        tell(message)
        return
    from PySide6.QtWidgets import QMessageBox

    icon = QMessageBox.Icon.Critical if error else QMessageBox.Icon.Information
    QMessageBox(icon, "kvscope", message).exec()
