"""The ways to a model, as actions the File menu, the toolbar and the picker's Open menu share:
a GGUF file (Ctrl+O), a model folder, the Hugging Face Hub (Ctrl+Shift+O) and the models already
on this machine. Each one that names a model loads it at once with the picker's settings."""

from __future__ import annotations

from PySide6.QtCore import QObject
from PySide6.QtGui import QAction, QKeySequence

OPEN_FILE_SHORTCUT = "Ctrl+O"
HUB_SHORTCUT = "Ctrl+Shift+O"
ON_THIS_MACHINE_SHORTCUT = "Ctrl+Shift+M"


class ModelActions(QObject):
    def __init__(self, parent: QObject):
        super().__init__(parent)
        self.open_file = self._make(
            "&Open model file…", "A .gguf model file, loaded at once", OPEN_FILE_SHORTCUT
        )
        self.open_folder = self._make(
            "Open model &folder…", "A Hugging Face model folder (config.json + weights), loaded at once"
        )
        self.hub = self._make(
            "Browse the &Hugging Face Hub…",
            "Search the Hub, see each file's fit here, download one and load it",
            HUB_SHORTCUT,
        )
        self.on_this_machine = self._make(
            "Models on this &machine…",
            "The Hugging Face cache, LM Studio, GPT4All and Ollama models already downloaded",
            ON_THIS_MACHINE_SHORTCUT,
        )

    def _make(self, text: str, tip: str, shortcut: str | None = None) -> QAction:
        action = QAction(text, self)
        action.setToolTip(f"{tip} ({shortcut})" if shortcut else tip)
        action.setStatusTip(tip)
        if shortcut:
            action.setShortcut(QKeySequence(shortcut))
        return action

    def all(self) -> tuple[QAction, ...]:
        return (self.open_file, self.open_folder, self.hub, self.on_this_machine)
