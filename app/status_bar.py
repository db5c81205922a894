"""The status bar: model load progress, TTFT, tokens/s, KV usage, memory and the last error.

Text is refreshed by the window's slow timer, not per frame: formatting and relaying out labels
is the costly part of a status bar, and numbers changing 30 times a second cannot be read.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar, QWidget

from engine.units import format_bytes
from live.state import LiveState

# An error stays visible this long (and in the tooltip of the label until the next one).
ERROR_VISIBLE_MS = 30_000


def _label(name: str, tooltip: str) -> QLabel:
    label = QLabel()
    label.setObjectName(name)
    label.setToolTip(tooltip)
    return label


class StatusBar(QStatusBar):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setSizeGripEnabled(True)
        self.model = _label("statusModel", "The model the engine serves")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setFixedWidth(160)
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.error = _label("statusError", "")
        self.error.hide()
        self.ttft = _label("statusTTFT", "Time to first token of the latest reply")
        self.speed = _label("statusSpeed", "Generated tokens per second (rolling while a reply streams)")
        self.kv = _label("statusKV", "KV-cache pages in use / total, and how full the used pages are")
        self.memory = _label("statusMemory", "Memory of the whole process")
        self.addWidget(self.model)
        self.addWidget(self.progress)
        self.addWidget(self.error, 1)
        for label in (self.ttft, self.speed, self.kv, self.memory):
            self.addPermanentWidget(label)
        self._error_timer = QTimer(self)
        self._error_timer.setSingleShot(True)
        self._error_timer.setInterval(ERROR_VISIBLE_MS)
        self._error_timer.timeout.connect(self.error.hide)

    def show_error(self, message: str) -> None:
        self.clearMessage()  # a passing note (a load's estimate beside its measurement) hides it
        first_line = message.strip().splitlines()[0] if message.strip() else "error"
        self.error.setText(f"⚠ {first_line}")
        self.error.setToolTip(message)
        self.error.show()
        self._error_timer.start()

    def refresh(self, live: LiveState, model_name: str) -> None:
        self._refresh_model(live, model_name)
        self._refresh_request(live)
        self._refresh_kv(live)
        self._refresh_memory(live)

    def _refresh_model(self, live: LiveState, model_name: str) -> None:
        if live.loading is not None:
            self.model.setText(f"Loading model: {live.loading.stage}")
            self.progress.setValue(round(1000 * min(max(live.loading.fraction, 0.0), 1.0)))
            self.progress.show()
            return
        self.progress.hide()
        if live.loaded is not None:
            info = live.loaded.info
            self.model.setText(f"{info.name} · {info.dtype} · {info.device}")
        elif live.load_error is not None:
            self.model.setText("No model (loading failed)")
        else:
            self.model.setText(model_name or "Starting…")

    def _refresh_request(self, live: LiveState) -> None:
        view = live.requests.get(live.latest_request_id) if live.latest_request_id is not None else None
        if view is None:
            self.ttft.setText("TTFT –")
            self.speed.setText("– tok/s")
            return
        if view.finished is not None:
            stats = view.finished.stats
            self.ttft.setText(f"TTFT {stats.ttft_s * 1000:.0f} ms")
            self.speed.setText(f"{stats.tokens_per_s:.1f} tok/s")
            return
        if view.tokens and view.first_token_row is not None and live.latency.holds(view.first_token_row):
            ttft_ms = live.latency.column("latency_ms")[view.first_token_row - live.latency.appended]
            self.ttft.setText(f"TTFT {ttft_ms:.0f} ms")
        rate = live.latency.column("tokens_per_s")
        latest = float(rate[-1]) if len(rate) else math.nan
        self.speed.setText("– tok/s" if math.isnan(latest) else f"{latest:.1f} tok/s")

    def _refresh_kv(self, live: LiveState) -> None:
        pm = live.page_map
        if pm.num_blocks == 0:
            self.kv.setText("KV –")
            return
        text = f"KV {pm.used_blocks}/{pm.num_blocks} pages"
        if pm.used_blocks:
            # Utilisation only means something while pages are in use (written / allocated slots).
            text += f" · {pm.utilisation * 100:.0f}% filled · {format_bytes(pm.used_bytes)}"
        self.kv.setText(text)

    def _refresh_memory(self, live: LiveState) -> None:
        if not len(live.memory):
            self.memory.setText("")
            return
        process = float(live.memory.column("process")[-1])
        self.memory.setText(f"{format_bytes(process)} ({live.memory_source})")
