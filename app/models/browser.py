"""The model browser: search the Hugging Face Hub, see a repo's weight files with the fit for this
machine, download one with a byte-level progress bar (cancel, resume), and hand it to the picker.

Everything it shows comes from the Hub (through engine.hub on HubWorker threads) or from
inspect-model's estimate; failures (offline, no network, gated, private, full disk...) are one
line in the status label, and nothing the user typed is lost.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.models.browser_cache import CacheTab
from app.models.browser_table import item, table
from app.models.browser_worker import HubWorker
from engine.config import DTYPES
from engine.units import format_bytes

RESULT_COLUMNS = ("Model", "Downloads", "Likes", "Params", "Size", "Licence", "Gated", "kvscope")
FILE_COLUMNS = ("Weights", "Size", "Downloaded", "Weights + KV", "Fits here?", "Process", "Note")
ON_DISK = "✓ on disk"
SORTS = (("Most downloaded", "downloads"), ("Most liked", "likes"), ("Trending", "trending_score"))


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else (f"{n / 1e3:.1f}k" if n >= 1e3 else str(n))


def fit_text(choice) -> tuple[str, str]:
    """(weights + KV, verdict) for a WeightChoice's estimate, or why there is none."""
    est = choice.estimate
    if est is None:
        return "–", choice.estimate_error or "unknown"
    need = est["weight_bytes"] + est["kv_bytes_for_context"]
    total = f"{format_bytes(need)} ({format_bytes(est['weight_bytes'])} + {format_bytes(est['kv_bytes_for_context'])})"
    if est["fits_with_context"]:
        return (
            total,
            f"yes, in {format_bytes(est['budget_bytes'])} {est['budget_source'].replace('available ', '')}",
        )
    if est["weights_fit_in_budget"]:
        return total, f"weights only: {est['max_context_tokens_in_budget']:,} tokens of KV fit"
    return total, f"no: {format_bytes(est['budget_bytes'])} {est['budget_source'].replace('available ', '')}"


def _served(supported: bool | None) -> str:
    return "–" if supported is None else ("serves" if supported else "refuses")


def process_text(choice) -> tuple[str, str]:
    """(the process once this file runs, how that is made up) for a WeightChoice's estimate: the
    measured runtime (engine.model.runtime_memory) beside its weights and KV for the context."""
    est = choice.estimate
    if est is None or "process_bytes" not in est:
        return "–", ""
    kv = format_bytes(est["kv_bytes_for_context"])
    tip = (
        f"once loaded: the runtime {format_bytes(est['runtime_bytes'])} ({est['runtime_source']}) + "
        f"weights {format_bytes(est['weight_bytes'])}"
        + (
            f"; its KV pages resident as the cache fills: {format_bytes(est['process_full_pool_bytes'])} "
            f"with {kv} of KV"
            if est["pool_fills_lazily"]
            else f" + KV {kv}"
        )
    )
    return f"≈ {format_bytes(est['process_bytes'])}", tip


class ModelBrowser(QDialog):
    model_chosen = Signal(str)  # a source to load now (repo id, or a GGUF path in the cache)

    def __init__(
        self, dtype: str = "bfloat16", parent: QWidget | None = None, worker: HubWorker | None = None
    ):
        super().__init__(parent)
        self.setWindowTitle("Models on the Hugging Face Hub")
        self.resize(1180, 760)
        self.worker = worker or HubWorker(self)
        self._hits: list = []
        self._files = None
        self._tickets = {"search": 0, "files": 0, "download": 0}

        self.query = QLineEdit()
        self.query.setPlaceholderText(
            "Search text-generation models by name (e.g. qwen2.5 0.5b, smollm, gemma)"
        )
        self.sort = QComboBox()
        for label, value in SORTS:
            self.sort.addItem(label, value)
        self.search_button = QPushButton("Search")
        self.search_button.setObjectName("loadButton")
        self.status = QLabel("")
        self.status.setObjectName("estimate")
        self.status.setWordWrap(True)
        self.results = table(RESULT_COLUMNS)

        self.repo_title = QLabel("Choose a model to see its files")
        self.repo_title.setStyleSheet("font-weight: bold;")
        self.support = QLabel("")
        self.support.setWordWrap(True)
        self.dtype = QComboBox()
        self.dtype.addItems(DTYPES)
        self.dtype.setCurrentText(dtype if dtype in DTYPES else "bfloat16")
        self.dtype.setToolTip("The dtype the fit is computed for (a GGUF is dequantized to it on load)")
        self.context = QSpinBox()
        self.context.setRange(1, 1_048_576)
        self.context.setValue(4096)
        self.context.setSuffix(" tokens")
        self.context.setToolTip("The context whose KV cache the fit reserves next to the weights")
        self.files_table = table(FILE_COLUMNS)
        self.download_button = QPushButton("Download")
        self.download_button.setEnabled(False)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.use_button = QPushButton("Use this model")
        self.use_button.setObjectName("loadButton")
        self.use_button.setToolTip("Load the chosen file now, with the model picker's settings")
        self.use_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(False)
        self.progress_label = QLabel("")
        self.cache = CacheTab(self)

        self._layout()
        self.tabs.currentChanged.connect(self._on_tab)
        self.cache.model_chosen.connect(self._choose)
        self.search_button.clicked.connect(self.search)
        self.query.returnPressed.connect(self.search)
        self.results.itemSelectionChanged.connect(self._on_result_selected)
        self.files_table.itemSelectionChanged.connect(self._on_file_selected)
        self.dtype.currentIndexChanged.connect(self._refresh_files)
        self.context.editingFinished.connect(self._refresh_files)
        self.download_button.clicked.connect(self.download)
        self.cancel_button.clicked.connect(self.worker.cancel)
        self.use_button.clicked.connect(self._on_use)
        self.worker.searched.connect(self._on_searched)
        self.worker.listed.connect(self._on_listed)
        self.worker.progressed.connect(self._on_progress)
        self.worker.downloaded.connect(self._on_downloaded)
        self.worker.failed.connect(self._on_failed)

    def _layout(self) -> None:
        search_row = QHBoxLayout()
        search_row.addWidget(self.query, 1)
        search_row.addWidget(self.sort)
        search_row.addWidget(self.search_button)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.setContentsMargins(0, 0, 0, 0)
        top_layout.addLayout(search_row)
        top_layout.addWidget(self.status)
        top_layout.addWidget(self.results, 1)

        options = QHBoxLayout()
        options.addWidget(self.repo_title, 1)
        options.addWidget(QLabel("fit for"))
        options.addWidget(self.dtype)
        options.addWidget(self.context)
        actions = QHBoxLayout()
        actions.addWidget(self.download_button)
        actions.addWidget(self.progress, 1)
        actions.addWidget(self.progress_label)
        actions.addWidget(self.cancel_button)
        actions.addWidget(self.use_button)
        bottom = QWidget()
        bottom_layout = QVBoxLayout(bottom)
        bottom_layout.setContentsMargins(0, 0, 0, 0)
        bottom_layout.addLayout(options)
        bottom_layout.addWidget(self.support)
        bottom_layout.addWidget(self.files_table, 1)
        bottom_layout.addLayout(actions)

        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(top)
        splitter.addWidget(bottom)
        splitter.setSizes([400, 360])
        self.tabs = QTabWidget()
        self.tabs.addTab(splitter, "Hugging Face Hub")
        self.tabs.addTab(self.cache, "On this machine")
        QVBoxLayout(self).addWidget(self.tabs)

    # ---- search ----------------------------------------------------------------------------
    @Slot()
    def search(self) -> None:
        self._say(f"Searching the Hub for {self.query.text().strip()!r}…")
        self._tickets["search"] = self.worker.search(self.query.text().strip(), sort=self.sort.currentData())

    @Slot(int, object)
    def _on_searched(self, ticket: int, hits: list) -> None:
        if ticket != self._tickets["search"]:
            return
        self._hits = hits
        self.results.setRowCount(len(hits))
        for row, h in enumerate(hits):
            params = (
                f"{h.params / 1e9:.2f} B"
                if h.params and h.params >= 1e9
                else (f"{h.params / 1e6:.0f} M" if h.params else "?")
            )
            served = _served(h.supported)
            cells = (
                item(h.repo_id, tip=h.repo_id),
                item(_count(h.downloads), h.downloads),
                item(_count(h.likes), h.likes),
                item(params, h.params),
                item(format_bytes(h.weights_bytes) if h.weights_bytes else "?", h.weights_bytes),
                item(h.license or "?"),
                item(
                    h.gated or "no", tip="accept the licence on the Hub and set HF_TOKEN" if h.gated else ""
                ),
                item(served, tip=h.support_note),
            )
            for col, cell in enumerate(cells):
                self.results.setItem(row, col, cell)
        self._say(
            f"{len(hits)} text-generation models" if hits else "No text-generation model matches that name."
        )
        if hits:
            self.results.selectRow(0)

    def _mark_served(self, repo_id: str, supported: bool | None, note: str) -> None:
        """The search result's kvscope cell, once the repo's files tell (a GGUF repo's search hit
        has no config to judge by; its file's header does)."""
        for row, hit in enumerate(self._hits):
            if hit.repo_id == repo_id and supported is not None:
                self.results.setItem(row, len(RESULT_COLUMNS) - 1, item(_served(supported), tip=note))

    # ---- files -----------------------------------------------------------------------------
    def _selected_hit(self):
        rows = self.results.selectionModel().selectedRows() if self.results.selectionModel() else []
        return self._hits[rows[0].row()] if rows and rows[0].row() < len(self._hits) else None

    @Slot()
    def _on_result_selected(self) -> None:
        self._refresh_files()

    @Slot()
    def _refresh_files(self) -> None:
        hit = self._selected_hit()
        if hit is None:
            return
        self._files = None
        self.files_table.setRowCount(0)
        self.download_button.setEnabled(False)
        self.repo_title.setText(f"{hit.repo_id}: reading its files…")
        self.support.setText("")
        self._tickets["files"] = self.worker.files(
            hit.repo_id, self.dtype.currentText(), self.context.value()
        )

    @Slot(int, object)
    def _on_listed(self, ticket: int, files) -> None:
        if ticket != self._tickets["files"]:
            return
        self._files = files
        gated = " · gated: needs your token" if files.gated else ""
        self.repo_title.setText(f"{files.repo_id} @ {files.revision[:10]}{gated}")
        verdict = {True: "kvscope serves it", False: "kvscope refuses it", None: "kvscope: not known yet"}
        self.support.setText(f"{verdict[files.supported]}: {files.support}")
        self._mark_served(files.repo_id, files.supported, files.support)
        self.files_table.setRowCount(len(files.choices))
        for row, c in enumerate(files.choices):
            total, verdict_text = fit_text(c)
            process, process_tip = process_text(c)
            held = (c.estimate or {}).get("weights_summary", "")  # a GGUF's plan per tensor type
            cells = (
                item(c.label, tip="\n".join(c.files)),
                item(format_bytes(c.weights_bytes), c.weights_bytes),
                item(ON_DISK if c.cached_source else "–", tip=c.cached_source or ""),
                item(total, tip=f"weights as the load holds them: {held}" if held else ""),
                item(verdict_text),
                item(process, tip=process_tip),
                item(c.note or ("" if c.loadable else "not loadable by kvscope")),
            )
            for col, cell in enumerate(cells):
                self.files_table.setItem(row, col, cell)
        if files.choices:
            self.files_table.selectRow(self._best_row(files.choices))

    @staticmethod
    def _best_row(choices) -> int:
        """The loadable choice that fits, preferring safetensors (exact) then the largest GGUF."""
        ranked = sorted(
            range(len(choices)),
            key=lambda i: (
                not choices[i].loadable,
                not (choices[i].estimate or {}).get("fits_with_context", False),
                choices[i].kind != "safetensors",
                -choices[i].weights_bytes,
            ),
        )
        return ranked[0]

    def _selected_choice(self):
        rows = self.files_table.selectionModel().selectedRows() if self.files_table.selectionModel() else []
        if self._files is None or not rows:
            return None
        return self._files.choices[rows[0].row()]

    @Slot()
    def _on_file_selected(self) -> None:
        """A choice already in the cache is used as it is; any other loadable one downloads first."""
        choice = self._selected_choice()
        ok = choice is not None and choice.loadable and self._files.supported is not False
        downloading = self.cancel_button.isEnabled()
        on_disk = ok and choice.cached_source is not None
        self.download_button.setEnabled(ok and not on_disk and not downloading)
        self.use_button.setEnabled(on_disk and not downloading)
        if choice is not None:
            self.download_button.setText(
                f"{choice.label} is on disk"
                if on_disk
                else f"Download {choice.label} ({format_bytes(choice.download_bytes)})"
            )

    # ---- download --------------------------------------------------------------------------
    @Slot()
    def download(self) -> None:
        choice = self._selected_choice()
        if choice is None or self._files is None:
            return
        self.use_button.setEnabled(False)
        self.download_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.progress.setValue(0)
        self.progress_label.setText(f"0 B of {format_bytes(choice.download_bytes)}")
        self._say(f"Downloading {self._files.repo_id} ({choice.label}) into the Hugging Face cache…")
        self._tickets["download"] = self.worker.download(self._files.repo_id, choice.files)

    @Slot(int, object)
    def _on_progress(self, ticket: int, p) -> None:
        if ticket != self._tickets["download"]:
            return
        self.progress.setValue(round(1000 * p.done_bytes / p.total_bytes) if p.total_bytes else 1000)
        rate = f" · {format_bytes(p.bytes_per_s)}/s" if p.bytes_per_s else ""
        self.progress_label.setText(f"{format_bytes(p.done_bytes)} of {format_bytes(p.total_bytes)}{rate}")

    @Slot(int, object)
    def _on_downloaded(self, ticket: int, result) -> None:
        if ticket != self._tickets["download"]:
            return
        self.cancel_button.setEnabled(False)
        self.progress.setValue(1000)
        self._mark_on_disk(result.files, result.source)
        resumed = f", {format_bytes(result.resumed_bytes)} resumed" if result.resumed_bytes else ""
        self._say(
            f"Downloaded {result.repo_id}: {format_bytes(result.downloaded_bytes)}{resumed}. "
            "Use this model loads it."
        )
        self._on_file_selected()

    def _mark_on_disk(self, files: tuple[str, ...], source: str) -> None:
        """The downloaded choice's row says so, and using it needs no second download."""
        if self._files is None:
            return
        choices = list(self._files.choices)
        for row, c in enumerate(choices):
            if c.files == tuple(files):
                choices[row] = dataclasses.replace(c, cached_source=source)
                self.files_table.setItem(row, 2, item(ON_DISK, tip=source))
        self._files = dataclasses.replace(self._files, choices=tuple(choices))

    @Slot()
    def _on_use(self) -> None:
        choice = self._selected_choice()
        if choice is not None and choice.cached_source:
            self._choose(choice.cached_source)

    @Slot(str)
    def _choose(self, source: str) -> None:
        self.model_chosen.emit(source)
        self.accept()

    @Slot(int)
    def _on_tab(self, index: int) -> None:
        if self.tabs.widget(index) is self.cache:
            self.cache.refresh()

    # ---- messages --------------------------------------------------------------------------
    @Slot(int, str, str)
    def _on_failed(self, ticket: int, what: str, message: str) -> None:
        if ticket != self._tickets.get(what):
            return
        if what == "download":
            self.cancel_button.setEnabled(False)
            self._on_file_selected()
        if what == "files":
            hit = self._selected_hit()
            self.repo_title.setText(f"{hit.repo_id}: its files could not be listed" if hit else "")
        self._say(message, error=True)

    def _say(self, text: str, error: bool = False) -> None:
        self.status.setText(text)
        self.status.setProperty("kind", "error" if error else "")
        self.status.style().unpolish(self.status)
        self.status.style().polish(self.status)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.worker.cancel()
        super().closeEvent(event)
