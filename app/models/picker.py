"""Choosing the model: source (packaged default, a folder, a .gguf file, the local HF cache),
dtype, device, KV block size and budget, with the memory estimate shown before loading.

The estimate (`engine.model.inspect.inspect_model`) reads only config/metadata, but a GGUF
header can still take a moment, so it runs on a worker (app.workers); a newer choice discards
the estimate still being read for an older one.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Signal, Slot
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QMenu,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.models.actions import ModelActions
from app.models.quant_picker import QuantizationChoice
from app.settings import ModelChoice
from app.workers import Worker, create_worker
from engine.config import DEVICES, DTYPES
from engine.units import MIB, format_bytes

DEFAULT_LABEL = "Packaged default: SmolLM2-135M-Instruct"


def _weights_as(est: dict) -> str:
    return "at the file's own bits" if est.get("weights_as") == "native" else f"in {est['dtype']}"


def describe_estimate(est: dict, kv_budget_bytes: int, block_size: int) -> str:
    """A few short lines from inspect_model's figures and the chosen KV budget: the weights as
    the load will hold them (per GGUF type), the KV cache, the pool, and the whole process."""
    per_token = est["kv_bytes_per_token"]
    per_block = per_token * block_size
    pool_blocks = kv_budget_bytes // per_block if per_block else 0
    fit = "fits" if est["weights_fit_in_budget"] else "does NOT fit"
    lines = [
        f"{est['architecture']} · {est['params'] / 1e6:,.0f} M parameters · {est['num_layers']} layers, "
        f"{est['num_kv_heads']} KV heads × {est['head_dim']}",
        f"Weights ≈ {format_bytes(est['weight_bytes'])} {_weights_as(est)}: {fit} in "
        f"{format_bytes(est['budget_bytes'])} ({est['budget_source']})",
    ]
    if est.get("weight_plan"):  # a GGUF: how each of its tensor types is held
        lines.append(f"  {est['weights_summary']}")
    lines += [
        f"KV cache: {format_bytes(per_token)} per token; the full {est['context']:,}-token context "
        f"needs {format_bytes(est['kv_bytes_for_context'])}",
        f"KV budget {format_bytes(kv_budget_bytes)} = {pool_blocks:,} pages of {block_size} "
        f"= {pool_blocks * block_size:,} tokens",
    ]
    process = process_estimate(est, kv_budget_bytes)
    if process is not None:
        lazy = est.get("pool_fills_lazily", False)
        runtime = process - est["weight_bytes"] - (0 if lazy else kv_budget_bytes)
        lines.append(
            f"Process ≈ {format_bytes(process)} once loaded: the runtime {format_bytes(runtime)} "
            f"({est['runtime_source']}) + weights"
            + (
                f"; the KV pool's pages as the cache fills, up to {format_bytes(process + kv_budget_bytes)}"
                if lazy
                else " + KV budget"
            )
        )
    return "\n".join(lines)


def process_estimate(est: dict, kv_budget_bytes: int) -> int | None:
    """The process once the estimated model is loaded with this KV budget (a pool that fills
    lazily not yet resident; None: no runtime figures)."""
    from engine.api import estimate_process

    if "runtime_process_now_bytes" not in est:
        return None
    pool = 0 if est.get("pool_fills_lazily", False) else kv_budget_bytes
    return estimate_process(
        est["runtime_process_now_bytes"],
        est["runtime_last_held_bytes"],
        est["runtime_first_load_bytes"],
        est["weight_bytes"] + pool,
    )


def _change(estimated: int, measured: int) -> str:
    """'+4%', '-12%', or 'within 0.5%' (how far the estimate was from the measurement)."""
    if not measured:
        return ""
    share = (estimated - measured) / measured
    return "within 0.5%" if abs(share) < 0.005 else f"{share:+.0%}"


def describe_measured(est: dict | None, kv_budget_bytes: int, weights: int, process: int | None) -> str:
    """Estimate and measurement of a model just loaded, side by side: the weights as the engine
    counts them, and the process (psutil RSS) once loaded."""
    lines = ["Estimated before loading → measured:"]
    if est is None:
        lines.append(f"weights {format_bytes(weights)} (no estimate was made)")
        return "\n".join(lines)
    lines.append(
        f"weights {format_bytes(est['weight_bytes'])} → {format_bytes(weights)} "
        f"(estimate {_change(est['weight_bytes'], weights)})"
    )
    expected = process_estimate(est, kv_budget_bytes)
    if expected is not None and process is not None:
        lines.append(
            f"process {format_bytes(expected)} → {format_bytes(process)} (estimate {_change(expected, process)})"
        )
    return "\n".join(lines)


def cached_model_entries() -> list[tuple[str, str]]:
    """(label, source) for each model already on this machine (the HF cache, LM Studio, GPT4All,
    Ollama: engine.model.local_models), with its size on disk; [] when none or unreadable."""
    from engine.api import find_local_models

    return [(f"{m.where}: {m.name} · {format_bytes(m.size_bytes)}", m.source) for m in find_local_models()]


def source_label(source: str) -> str:
    """How a source the user just chose reads in the list: a file in the HF cache as
    'HF cache: owner/repo/file.gguf', a repo id as 'HF cache: owner/repo', else the path."""
    from pathlib import Path

    from engine.api import hf_cache_dir, repo_file_of

    repo_file = repo_file_of(Path(source), hf_cache_dir())
    if repo_file is not None:
        return f"HF cache: {repo_file[0]}/{repo_file[1]}"
    return f"HF cache: {source}" if "/" in source and not Path(source).exists() else source


def fit_suffix(est: dict) -> str:
    """' · fits' or why not, for a picker entry (weights + KV for its context vs free memory)."""
    if est.get("fits_with_context"):
        return " · fits"
    return " · weights only fit" if est.get("weights_fit_in_budget") else " · too big here"


# Context the picker's fit marks reserve KV for (the model's own when smaller).
ENTRY_FIT_CONTEXT = 4096


def entry_fits(sources: list[str], dtype: str) -> list[tuple[str, str]]:
    """(source, suffix) for each entry: whether it fits, from its metadata alone (a worker runs it)."""
    from engine.api import inspect_model

    marks = []
    for source in sources:
        try:
            est = inspect_model(source, dtype=dtype, context=ENTRY_FIT_CONTEXT)
        except Exception:  # noqa: BLE001 - unreadable: the estimate line says why when chosen
            marks.append((source, " · unreadable"))
            continue
        marks.append((source, " · not served" if not est.get("supported", True) else fit_suffix(est)))
    return marks


class ModelPicker(QWidget):
    load_requested = Signal(object)  # ModelChoice

    def __init__(self, choice: ModelChoice, default_budget_bytes: int, parent: QWidget | None = None):
        super().__init__(parent)
        self._default_budget = default_budget_bytes
        self.source = QComboBox()
        self.source.setToolTip("Which model to load")
        self.source.addItem(DEFAULT_LABEL, "default")
        # Long paths and repo ids must not widen the whole Controls column: show the start,
        # the full text is in the drop-down and the tooltip.
        self.source.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.source.setMinimumContentsLength(14)
        # The ways to a model (File menu, toolbar and this Open menu share them): each loads
        # what it names at once, with the settings below.
        self.actions = ModelActions(self)
        self.open_button = QToolButton()
        self.open_button.setObjectName("openModel")  # its menu arrow gets room of its own (style.qss)
        self.open_button.setText("Open…")
        self.open_button.setToolTip(
            "Open a GGUF file or model folder, browse the Hub, or the models on this machine"
        )
        self.open_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        # as tall as Load model beside it (a tool button keeps its own, smaller height)
        self.open_button.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        open_menu = QMenu(self.open_button)
        open_menu.addActions(list(self.actions.all()))
        self.open_button.setMenu(open_menu)
        self._browser = None
        self.dtype = QComboBox()
        self.dtype.addItems(DTYPES)
        self.dtype.setToolTip("Weight and KV precision: float32 is exact; bfloat16 halves memory")
        self.device = QComboBox()
        self.device.addItems(DEVICES)
        self.device.setToolTip("auto uses a CUDA GPU when PyTorch has one, else the CPU")
        self.block_size = QSpinBox()
        self.block_size.setRange(1, 1024)
        self.block_size.setToolTip(
            "Tokens per KV page: small pages waste less, large pages mean fewer lookups"
        )
        self.kv_budget = QSpinBox()
        self.kv_budget.setRange(0, 1024 * 1024)
        self.kv_budget.setSuffix(" MiB")
        self.kv_budget.setSpecialValueText(f"auto ({format_bytes(default_budget_bytes)})")
        self.kv_budget.setToolTip("Memory for the paged KV cache; it sets how many pages the pool has")
        self.quantization = QuantizationChoice(self)
        self.estimate = QLabel("")
        self.estimate.setObjectName("estimate")
        self.estimate.setWordWrap(True)
        self.measured = QLabel("")  # after a load: its estimate beside what it measured
        self.measured.setObjectName("estimate")
        self.measured.setWordWrap(True)
        self.measured.hide()
        self.load_button = QPushButton("Load model")
        self.load_button.setObjectName("loadButton")
        self.load_button.setToolTip("Stop the current engine and start one with these settings")
        self.load_button.clicked.connect(self._on_load_clicked)
        self.load_stage = QLabel("")  # the load's stage while a model loads, beside its bar
        self.load_stage.setObjectName("hint")
        self.load_stage.setWordWrap(True)
        self.load_progress = QProgressBar()
        self.load_progress.setRange(0, 1000)
        self.load_progress.setTextVisible(False)
        self.show_loading(None)

        # The load bar: which model and the button that loads it. The Controls dock pins it above
        # its scrolling part, so loading never needs a scroll past the fields below.
        self.load_bar = QWidget()
        self.load_bar.setObjectName("loadBar")
        bar = QVBoxLayout(self.load_bar)
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(self.source)
        buttons = QHBoxLayout()
        buttons.addWidget(self.load_button, 1)
        buttons.addWidget(self.open_button)
        bar.addLayout(buttons)
        bar.addWidget(self.load_progress)
        bar.addWidget(self.load_stage)

        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow("dtype", self.dtype)
        form.addRow("device", self.device)
        form.addRow("KV block size", self.block_size)
        form.addRow("KV budget", self.kv_budget)
        self.quantization.add_rows(form)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.load_bar)
        layout.addLayout(form)
        layout.addWidget(self.estimate)
        layout.addWidget(self.measured)

        self._worker: Worker | None = None
        self._estimate: dict | None = None
        self._then: Callable[[], None] | None = None  # a load asked for while the estimate is read
        self._load_estimate: tuple[dict | None, int] | None = None  # the last load's (estimate, KV budget)
        self.set_choice(choice)
        self.source.currentIndexChanged.connect(self.refresh_estimate)
        self.dtype.currentIndexChanged.connect(self.refresh_estimate)
        self.quantization.scheme.currentIndexChanged.connect(self.refresh_estimate)  # native or dtype bytes
        self.device.currentTextChanged.connect(self.quantization.set_device)
        self.kv_budget.valueChanged.connect(self._on_pool_changed)
        self.block_size.valueChanged.connect(self._on_pool_changed)
        self.actions.open_file.triggered.connect(self._on_pick_gguf)
        self.actions.open_folder.triggered.connect(self._on_pick_folder)
        self.actions.hub.triggered.connect(self.open_browser)
        self.actions.on_this_machine.triggered.connect(self.open_on_this_machine)

    # ---- values ----------------------------------------------------------------------------
    def set_choice(self, choice: ModelChoice) -> None:
        self._select_source(choice.source)
        self.dtype.setCurrentText(choice.dtype)
        self.device.setCurrentText(choice.device)
        self.block_size.setValue(choice.block_size)
        self.kv_budget.setValue(choice.kv_budget_mib)
        self.quantization.set_device(choice.device)
        self.quantization.set_values(choice.quantization, choice.kv_dtype)

    def choice(self) -> ModelChoice:
        return ModelChoice(
            source=self.source.currentData(),
            dtype=self.dtype.currentText(),
            device=self.device.currentText(),
            block_size=self.block_size.value(),
            kv_budget_mib=self.kv_budget.value(),
            quantization=self.quantization.scheme_name(),
            kv_dtype=self.quantization.kv_dtype_name(),
        )

    def add_cached_models(self) -> None:
        """List the models already on this machine with their size, then mark each with whether
        it fits (called once at startup). Both run on workers: the scan walks the HF cache, LM
        Studio, GPT4All and Ollama folders and reads configs, the marks read each model's metadata."""
        create_worker(
            cached_model_entries,
            name="kvscope-local-models",
            parent=self,
            on_returned=self._on_local_models,
            on_errored=lambda message: self.source.setToolTip(
                f"The models on this machine could not be listed: {message}"
            ),
        )

    @Slot(object)
    def _on_local_models(self, entries: list[tuple[str, str]]) -> None:
        added = []
        for label, source in entries:
            if self.source.findData(source) < 0:
                self.source.addItem(label, source)
                added.append(source)
        if added:
            dtype = self.dtype.currentText()
            create_worker(
                lambda: entry_fits(added, dtype),
                name="kvscope-fit",
                parent=self,
                on_returned=self._on_entry_fits,
            )

    @Slot(object)
    def _on_entry_fits(self, marks: list[tuple[str, str]]) -> None:
        for source, suffix in marks:
            index = self.source.findData(source)
            if index >= 0 and not self.source.itemText(index).endswith(suffix):
                self.source.setItemText(index, self.source.itemText(index) + suffix)

    def _select_source(self, source: str) -> None:
        index = self.source.findData(source)
        if index < 0:
            self.source.addItem(source, source)
            index = self.source.count() - 1
        self.source.setCurrentIndex(index)

    # ---- estimate --------------------------------------------------------------------------
    @Slot()
    def refresh_estimate(self) -> None:
        """Start inspecting the chosen source; a newer request supersedes an older one."""
        choice = self.choice()
        self.source.setToolTip(self.source.currentText())
        self._estimate = None
        self.estimate.setText("Reading the model's metadata…")
        if self._worker is not None:
            self._worker.discard()  # the user has picked something else since

        def inspect() -> dict:
            from engine.api import inspect_model

            # Context and memory budget left to inspect_model: the model's full context against
            # the memory available now (our KV budget is a part of that, shown beside it).
            return inspect_model(choice.source, dtype=choice.dtype, quantization=choice.quantization)

        self._worker = create_worker(
            inspect,
            name="kvscope-inspect",
            parent=self,
            on_returned=self._on_estimate,
            on_errored=self._on_estimate_failed,
        )

    @Slot(object)
    def _on_estimate(self, est: dict) -> None:
        self._estimate = est
        self.estimate.setText(describe_estimate(est, self._kv_budget_bytes(), self.block_size.value()))
        self._mark_estimate("")
        self._load_if_asked()

    @Slot(str)
    def _on_estimate_failed(self, error: str) -> None:
        self._estimate = None
        self.estimate.setText(f"Cannot estimate this model: {error}")
        self._mark_estimate("error")
        self._load_if_asked()  # the load says why in its own words

    def _load_if_asked(self) -> None:
        then, self._then = self._then, None
        if then is not None:
            self.after_estimate(then)

    def _mark_estimate(self, kind: str) -> None:
        self.estimate.setProperty("kind", kind)
        self.estimate.style().unpolish(self.estimate)
        self.estimate.style().polish(self.estimate)

    def _kv_budget_bytes(self) -> int:
        return self.kv_budget.value() * MIB or self._default_budget

    @Slot()
    def _on_pool_changed(self) -> None:
        """Budget or block size moved: the estimate's figures stand, only the pool line changes."""
        if self._estimate is not None:
            self.estimate.setText(
                describe_estimate(self._estimate, self._kv_budget_bytes(), self.block_size.value())
            )

    def wait_for_estimate(self, timeout: float = 5.0) -> None:
        """Join the inspections still reading (window close, tests) and deliver the latest, so no
        worker outlives the picker."""
        for _ in range(2):  # the local models' scan, then the fit marks it started
            for worker in [w for w in self.findChildren(Worker) if w.running]:
                worker.wait(timeout)
                worker.drain()
        if self._browser is not None:
            self._browser.worker.wait(timeout)

    # ---- loading ---------------------------------------------------------------------------
    def show_loading(self, stage: str | None, fraction: float = 0.0) -> None:
        """The engine's load progress under the load button (None: no load running)."""
        loading = stage is not None
        self.load_progress.setVisible(loading)
        self.load_stage.setVisible(loading)
        if loading:
            self.load_progress.setValue(round(1000 * min(max(fraction, 0.0), 1.0)))
            self.load_stage.setText(f"Loading: {stage}")

    def use(self, source: str, label: str | None = None) -> None:
        """Choose `source` and load it now with the settings shown (one action: a file opened,
        a model used from the Hub browser or from the models on this machine)."""
        if self.source.findData(source) < 0:
            self.source.addItem(label or source_label(source), source)
        self._select_source(source)
        self._on_load_clicked()

    # ---- slots -----------------------------------------------------------------------------
    @Slot()
    def _on_pick_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder")
        if folder:
            self.use(folder)

    @Slot()
    def _on_pick_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model file", "", "GGUF models (*.gguf)")
        if path:
            self.use(path)

    @Slot()
    def _on_load_clicked(self) -> None:
        self.after_estimate(self._emit_load)

    def _emit_load(self) -> None:
        self.load_requested.emit(self.choice())

    def after_estimate(self, start: Callable[[], None]) -> None:
        """Run `start` (a load of the shown choice) once its estimate is read: made before the
        load changes the process it measures, it is shown beside what the load measures."""
        if self._worker is not None and self._worker.running and self._estimate is None:
            self._then = start
            self.show_loading("reading the model's metadata for the estimate")
            return
        self._load_estimate = (self._estimate, self._kv_budget_bytes())
        self.measured.hide()
        start()

    def show_measured(self, weight_bytes: int, process_bytes: int | None) -> None:
        """A load finished: its estimate (made before it) beside the weights the engine counted
        and the process it measured."""
        est, budget = self._load_estimate or (None, self._kv_budget_bytes())
        self.measured.setText(describe_measured(est, budget, weight_bytes, process_bytes))
        self.measured.show()

    def browser(self):
        """The Hub browser (one per picker, made on first use); a model it is told to use loads."""
        from app.models.browser import ModelBrowser

        if self._browser is None:
            self._browser = ModelBrowser(dtype=self.dtype.currentText(), parent=self.window())
            self._browser.model_chosen.connect(self.use)
        return self._browser

    @Slot()
    def open_browser(self) -> None:
        browser = self.browser()
        browser.tabs.setCurrentIndex(0)
        browser.show()
        browser.raise_()
        browser.query.setFocus()

    @Slot()
    def open_on_this_machine(self) -> None:
        browser = self.browser()
        browser.tabs.setCurrentWidget(browser.cache)  # the tab lists the cache as it opens
        browser.cache.refresh()
        browser.show()
        browser.raise_()
