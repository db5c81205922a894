"""One long measurement at a time on a worker thread, reporting back to the GUI thread.

Device limits, sweeps and model inspection take seconds to minutes; run on the GUI thread they
would freeze the window. The work runs on a named daemon thread and reports through this
QObject's signals: emitted from the worker, they reach receivers on the GUI thread queued, so
no slot ever runs on the worker.

Cancelling is cooperative: the work gets a `progress(message)` callable and calls it between
pieces; once cancel() was asked for, that call raises JobCancelled, which unwinds the work at
its next piece boundary (a model load or one timed run is never cut in half).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal, Slot

Progress = Callable[[str], None]


class JobCancelled(Exception):
    """Raised inside the work by `progress` once the user cancelled."""


def describe_error(exc: BaseException) -> str:
    """A one-line reason for the user: the message of the engine's own errors (ConfigError,
    ModelLoadError are written for people), else the exception's type and text."""
    from engine.config import ConfigError
    from engine.model.errors import ModelLoadError

    if isinstance(exc, (ConfigError, ModelLoadError)) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class BackgroundJob(QObject):
    progress = Signal(str)
    succeeded = Signal(object)  # the work's return value
    failed = Signal(str)  # why, in words
    cancelled = Signal()

    def __init__(self, thread_name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread_name = thread_name
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._active = False
        # Connected first, so it runs before any other receiver of the outcome: by the time a
        # view handles it, `running` is already False and the view can re-enable its controls.
        for outcome in (self.succeeded, self.failed, self.cancelled):
            outcome.connect(self._on_outcome)

    @property
    def running(self) -> bool:
        """From start() until the outcome has reached the GUI thread."""
        return self._active

    def start(self, work: Callable[[Progress], object]) -> None:
        if self._active or (self._thread is not None and self._thread.is_alive()):
            raise RuntimeError(f"{self.thread_name} is already running")
        self._cancel.clear()
        self._active = True
        self._thread = threading.Thread(target=self._run, args=(work,), name=self.thread_name, daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancel.set()

    def wait(self, timeout: float) -> bool:
        """Join the worker (window close, tests); True when no worker thread is left."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    @Slot()
    def _on_outcome(self, *_args) -> None:
        self._active = False

    def _report(self, message: str) -> None:
        if self._cancel.is_set():
            raise JobCancelled
        self.progress.emit(message)

    def _run(self, work: Callable[[Progress], object]) -> None:
        try:
            result = work(self._report)
        except JobCancelled:
            self.cancelled.emit()
        except Exception as exc:  # noqa: BLE001 - every failure reaches the user as a reason
            self.failed.emit(describe_error(exc))
        else:
            self.succeeded.emit(result)
