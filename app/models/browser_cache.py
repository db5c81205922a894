"""The model browser's "On this machine" tab: the Hugging Face cache with each model's size on
disk and its resumable partial downloads (engine.hub.cache, huggingface_hub's scan_cache_dir),
and the models LM Studio, GPT4All and Ollama keep; delete a cached repo, or use any of them.

Scanning reads directory listings only; it runs on the GUI thread when the tab opens or after a
download or delete (a few milliseconds for a cache of dozens of repos).
"""

from __future__ import annotations

from PySide6.QtCore import Signal, Slot
from PySide6.QtWidgets import QHBoxLayout, QLabel, QMessageBox, QPushButton, QVBoxLayout, QWidget

from app.models.browser_table import item, table
from engine.units import format_bytes

COLUMNS = ("Model", "Where", "On disk", "Partial download", "Weights")


class CacheTab(QWidget):
    model_chosen = Signal(str)  # a source load_model takes

    def __init__(self, parent: QWidget | None = None, confirm_delete: bool = True):
        super().__init__(parent)
        self.confirm_delete = confirm_delete  # tests answer the question themselves
        self.table = table(COLUMNS)
        self.summary = QLabel("")
        self.summary.setObjectName("estimate")
        self.use_button = QPushButton("Use this model")
        self.delete_button = QPushButton("Delete from the cache…")
        self.refresh_button = QPushButton("Refresh")
        self._rows: list[tuple[str, str, str | None]] = []  # (source, where, repo id when cached)
        buttons = QHBoxLayout()
        buttons.addWidget(self.refresh_button)
        buttons.addStretch(1)
        buttons.addWidget(self.delete_button)
        buttons.addWidget(self.use_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        self.refresh_button.clicked.connect(self.refresh)
        self.use_button.clicked.connect(self._on_use)
        self.delete_button.clicked.connect(self._on_delete)
        self.table.itemSelectionChanged.connect(self._on_selected)
        self._on_selected()

    @Slot()
    def refresh(self) -> None:
        from engine.api import (
            HubError,
            gpt4all_models,
            hf_cache_dir,
            list_cached,
            lmstudio_models,
            ollama_models,
        )

        try:
            cached = list_cached()
        except HubError as exc:
            self.summary.setText(str(exc))
            self.summary.setProperty("kind", "error")
            cached = []
        else:
            total = sum(c.size_bytes for c in cached)
            partial = sum(c.partial_bytes for c in cached)
            resumable = f", {format_bytes(partial)} of partial downloads that resume" if partial else ""
            self.summary.setText(
                f"Hugging Face cache {hf_cache_dir()}: {len(cached)} models, {format_bytes(total)}{resumable}"
            )
            self.summary.setProperty("kind", "")
        others = lmstudio_models() + gpt4all_models() + ollama_models()
        self._rows = [(c.source, "HF cache", c.repo_id) for c in cached] + [
            (m.source, m.where, None) for m in others
        ]
        self.table.setRowCount(len(self._rows))
        for row, c in enumerate(cached):
            cells = (
                item(c.repo_id, tip=c.path),
                item("HF cache"),
                item(format_bytes(c.size_bytes), c.size_bytes),
                item(format_bytes(c.partial_bytes) if c.partial_bytes else "–", c.partial_bytes),
                item(", ".join(c.weights) or "none"),
            )
            for col, cell in enumerate(cells):
                self.table.setItem(row, col, cell)
        for row, m in enumerate(others, start=len(cached)):
            cells = (
                item(m.name, tip=m.source),
                item(m.where),
                item(format_bytes(m.size_bytes), m.size_bytes),
                item("–"),
                item("gguf"),
            )
            for col, cell in enumerate(cells):
                self.table.setItem(row, col, cell)
        self._on_selected()

    def _selected(self) -> tuple[str, str, str | None] | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        return self._rows[rows[0].row()] if rows and rows[0].row() < len(self._rows) else None

    @Slot()
    def _on_selected(self) -> None:
        chosen = self._selected()
        self.use_button.setEnabled(chosen is not None)
        self.delete_button.setEnabled(chosen is not None and chosen[2] is not None)

    @Slot()
    def _on_use(self) -> None:
        chosen = self._selected()
        if chosen is not None:
            self.model_chosen.emit(chosen[0])

    @Slot()
    def _on_delete(self) -> None:
        from engine.api import HubError, delete_cached

        chosen = self._selected()
        if chosen is None or chosen[2] is None:
            return
        repo_id = chosen[2]
        if self.confirm_delete:
            answer = QMessageBox.question(
                self,
                "Delete from the Hugging Face cache",
                f"Delete every downloaded revision of {repo_id}? It can be downloaded again later.",
            )
            if answer != QMessageBox.StandardButton.Yes:
                return
        try:
            freed = delete_cached(repo_id)
        except HubError as exc:
            self.summary.setText(str(exc))
            self.summary.setProperty("kind", "error")
            return
        self.refresh()
        self.summary.setText(f"Deleted {repo_id}: {format_bytes(freed)} freed. " + self.summary.text())
