"""Runs quality jobs (app/quality/compute.py) on a worker thread and reports back to the GUI
thread through a queued signal to bound slots, like the model picker's metadata reads."""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Signal, Slot

from app.quality.compute import QualityResult, compute_quality
from app.quality.jobs import QualityJob, QualityUnavailable

THREAD_NAME = "kvscope-quality"


class _Relay(QObject):
    """Carries the worker's news to the GUI thread (queued: the receiver lives there)."""

    progress = Signal(int, str)
    finished = Signal(int, object, str)  # ticket, QualityResult or None, error message


class QualityRunner(QObject):
    """Runs one QualityJob at a time on a worker thread; a new run supersedes an old one."""

    progress = Signal(str)
    finished = Signal(object)  # QualityResult
    failed = Signal(str)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._relay = _Relay(self)
        self._relay.progress.connect(self._on_progress)
        self._relay.finished.connect(self._on_finished)
        self._ticket = 0
        self._cancel = threading.Event()
        self._worker: threading.Thread | None = None
        self.result: QualityResult | None = None

    def running(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def start(self, job: QualityJob) -> None:
        self.cancel()
        self._ticket += 1
        self._cancel = threading.Event()
        self._worker = threading.Thread(
            target=self._work, args=(self._ticket, job, self._cancel), name=THREAD_NAME, daemon=True
        )
        self._worker.start()

    def cancel(self) -> None:
        """Stop at the next step (a forward or a load in progress runs to its end)."""
        self._cancel.set()

    def shutdown(self, timeout: float = 60.0) -> bool:
        """Cancel and join (window close, tests); True when no worker is left."""
        self.cancel()
        if self._worker is not None:
            self._worker.join(timeout)
        return not self.running()

    def _work(self, ticket: int, job: QualityJob, cancel: threading.Event) -> None:
        try:
            result = compute_quality(job, lambda text: self._relay.progress.emit(ticket, text), cancel.is_set)
            self._relay.finished.emit(ticket, result, "")
        except QualityUnavailable as exc:
            self._relay.finished.emit(ticket, None, str(exc))
        except Exception as exc:  # noqa: BLE001 - a failed run is reported, never a traceback
            self._relay.finished.emit(ticket, None, f"The quality run failed: {type(exc).__name__}: {exc}")

    @Slot(int, str)
    def _on_progress(self, ticket: int, text: str) -> None:
        if ticket == self._ticket:
            self.progress.emit(text)

    @Slot(int, object, str)
    def _on_finished(self, ticket: int, result, error: str) -> None:
        if ticket != self._ticket:
            return  # superseded by a newer run
        if result is not None:
            self.result = result
            self.finished.emit(result)
        elif error:
            self.failed.emit(error)
