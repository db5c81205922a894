"""The load tool: submit N requests at once and watch them share the engine.

Settings on top (how many, a shared or distinct system prompt, prompt and output lengths), a
table with each request's progress and its measured TTFT / ITL / prefix-cache hit, and below the
latency-vs-throughput plot that gains a point per finished run. "Sweep" runs the same settings at
concurrency 1, 2, 4 and 8 one after the other, so the plot shows the batching trade-off.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.batching.load_run import LoadRequest, LoadRun, LoadRunner, LoadSpec
from app.engine_host import EngineHost
from widgets.throughput_view import ThroughputView

SWEEP_LEVELS = (1, 2, 4, 8)
COLUMNS = ("request", "prompt tokens", "progress", "TTFT ms", "median ITL ms", "cached prompt", "status")


def _spin(low: int, high: int, value: int, suffix: str = "") -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setValue(value)
    box.setSuffix(suffix)
    return box


class LoadToolPanel(QWidget):
    def __init__(self, host: EngineHost, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.host = host
        self.runner = LoadRunner(host, self)
        self._sweep: list[int] = []

        self.count = _spin(1, 64, 4)
        self.shared = QCheckBox("shared system prompt (one cached prefix for all)")
        self.shared.setChecked(True)
        self.system_words = _spin(0, 2000, 120, " words")
        self.prompt_words = _spin(1, 2000, 20, " words")
        self.new_tokens = _spin(1, 4096, 32, " tokens")
        form = QFormLayout()
        form.addRow("requests", self.count)
        form.addRow("system prompt", self.system_words)
        form.addRow("", self.shared)
        form.addRow("user prompt", self.prompt_words)
        form.addRow("output", self.new_tokens)

        self.run_button = QPushButton("Run")
        self.run_button.setToolTip("Submit all requests at once to the loaded model")
        self.sweep_button = QPushButton("Sweep ×1, 2, 4, 8")
        self.sweep_button.setToolTip(
            "Run these settings at each concurrency in turn; each adds a point below"
        )
        self.cancel_button = QPushButton("Cancel")
        buttons = QHBoxLayout()
        for button in (self.run_button, self.sweep_button, self.cancel_button):
            buttons.addWidget(button)

        self.progress = QProgressBar()
        self.progress.setFormat("%v of %m tokens")
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.throughput = ThroughputView()

        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.progress)
        layout.addWidget(self.summary)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.throughput, 1)

        self.run_button.clicked.connect(lambda: self.start_run())
        self.sweep_button.clicked.connect(self.start_sweep)
        self.cancel_button.clicked.connect(self.cancel)
        self.runner.changed.connect(self._show_run)
        self.runner.run_finished.connect(self._on_run_finished)
        host.status_changed.connect(self._sync_buttons)
        self._show_run()
        self._sync_buttons()

    def spec(self, requests: int | None = None) -> LoadSpec:
        return LoadSpec(
            requests=requests or self.count.value(),
            shared_system=self.shared.isChecked(),
            system_words=self.system_words.value(),
            prompt_words=self.prompt_words.value(),
            new_tokens=self.new_tokens.value(),
        )

    # ---- actions ---------------------------------------------------------------------------
    def start_run(self, requests: int | None = None) -> LoadRun | None:
        try:
            run = self.runner.start(self.spec(requests))
        except Exception as exc:  # no model, or a bad request: say so, never a traceback
            self.summary.setText(f"Could not start the load: {exc}")
            self._sweep.clear()
            return None
        self._sync_buttons()
        return run

    def start_sweep(self) -> None:
        self._sweep = list(SWEEP_LEVELS[1:])
        self.start_run(SWEEP_LEVELS[0])

    def cancel(self) -> None:
        self._sweep.clear()
        self.runner.cancel()

    def _on_run_finished(self, run: LoadRun) -> None:
        point = run.throughput()
        if point is not None:
            self.throughput.add_point(point)
        if self._sweep and point is not None:
            self.start_run(self._sweep.pop(0))
        else:
            self._sweep.clear()
        self._sync_buttons()

    def _sync_buttons(self) -> None:
        ready = self.host.status().ready
        self.run_button.setEnabled(ready and not self.runner.running)
        self.sweep_button.setEnabled(ready and not self.runner.running)
        self.cancel_button.setEnabled(self.runner.running)

    # ---- display ---------------------------------------------------------------------------
    def _show_run(self) -> None:
        run = self.runner.run
        if run is None:
            self.summary.setText(
                "Submit several requests at once to watch the KV pool fill, share and preempt."
            )
            self.progress.setRange(0, 1)
            self.progress.setValue(0)
            return
        rows = list(run.requests.values())
        self.progress.setRange(0, sum(r.target_tokens for r in rows))
        self.progress.setValue(sum(r.generated for r in rows))
        self.table.setRowCount(len(rows))
        for i, row in enumerate(rows):
            for j, text in enumerate(_cells(row)):
                item = self.table.item(i, j)
                if item is None:
                    item = QTableWidgetItem()
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                    self.table.setItem(i, j, item)
                item.setText(text)
                if j == len(COLUMNS) - 1:
                    item.setToolTip(row.error)
        self.summary.setText(_summary(run))


def _cells(row: LoadRequest) -> tuple[str, ...]:
    stats = row.finished.stats if row.finished else None
    itl = row.median_itl_s
    return (
        f"#{row.request_id}",
        str(row.prompt_tokens) if row.prompt_tokens else "",
        f"{row.generated} / {row.target_tokens}",
        f"{stats.ttft_s * 1000:.0f}" if stats else "",
        f"{itl * 1000:.1f}" if itl is not None else "",
        f"{stats.cached_prompt_tokens} of {stats.prompt_tokens}" if stats else "",
        row.status + (f" ({stats.preemptions} preempted)" if stats and stats.preemptions else ""),
    )


def _summary(run: LoadRun) -> str:
    rows = list(run.requests.values())
    ended = sum(r.done for r in rows)
    text = f"×{len(rows)}: {ended} of {len(rows)} ended"
    point = run.throughput() if run.done else None
    if point is not None:
        text += (
            f" · {point.total_tokens_per_s:.1f} tokens/s in total, median ITL "
            f"{point.median_itl_s * 1000:.1f} ms"
        )
    failed = [r for r in rows if r.status == "failed"]
    if failed:
        text += f" · {len(failed)} failed: {failed[0].error}"
    return text
