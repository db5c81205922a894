"""The one way the app runs work off the GUI thread: a `Job` whose news (progress, then one outcome)
reaches the GUI thread as ordinary same-thread signals. napari's `create_worker` is the model.

Two kinds run a job:
- `create_worker(fn)`: a named daemon thread of its own, for the shell's long jobs that need no
  engine (reading a model's metadata, a sweep that loads its own copies of a model);
- `EngineHost.ask(query)` (app/engine_host.py): one of the engine's named questions
  (engine.api.EngineClient), answered on the engine thread between two steps, for anything that
  touches the engine's model, tokenizer or device.

Either way the work only puts its news in a thread-safe queue, and the GUI thread drains it: a
worker's own timer polls its queue while it runs, the host drains engine calls on its render tick.
No thread but the GUI's ever touches Qt, so no receiver runs on a worker, and a job whose window
was torn down while its thread still ran is never signalled from that thread.

Cancelling is cooperative: the work gets `report(message)` and calls it between pieces; once
`cancel()` was asked for, `report` raises `Cancelled`, which unwinds the work at its next piece
boundary (a model load or one timed run is never cut in half). `discard()` also drops whatever
news is still to come: a newer job has superseded this one.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal, Slot

Progress = Callable[[str], None]
# How often a running worker's news are looked for: well under what a person notices.
POLL_MS = 30


class Cancelled(Exception):
    """Raised inside the work by `report` once the user cancelled."""


class UserFacingError(Exception):
    """A failure whose message is written for the user: `errored` carries it as it is."""


def describe_error(exc: BaseException) -> str:
    """A one-line reason for the user: the message of errors written for people (the engine's
    ConfigError, ModelLoadError, MeasurementError and InspectionError, the app's
    UserFacingError), else the exception's type and text."""
    from engine.api import InspectionError, MeasurementError, ModelLoadError
    from engine.config import ConfigError

    written = (ConfigError, ModelLoadError, MeasurementError, InspectionError, UserFacingError)
    if isinstance(exc, written) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Channel:
    """What the working thread holds: the news queue and the cancel flag, no Qt object. So a
    thread never touches Qt, and never holds the last reference to a job's QObject (which Python
    would then destroy on that thread)."""

    def __init__(self) -> None:
        self.news: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._cancel = threading.Event()

    def __call__(self, message: str) -> None:
        """Progress in words, from the work; raises Cancelled once cancel() was asked for."""
        if self._cancel.is_set():
            raise Cancelled
        self.post("progress", message)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def post(self, kind: str, payload: Any = None) -> None:
        self.news.put((kind, payload))

    def outcome(self, run: Callable[[], Any]) -> None:
        """Run the work and post its outcome: returned, errored (in words) or cancelled."""
        try:
            result = run()
        except (Cancelled, CancelledError):
            self.post("cancelled")
        except Exception as exc:  # noqa: BLE001 - every failure reaches the user as a reason
            self.post("errored", describe_error(exc))
        else:
            self.post("returned", result)


class Job(QObject):
    """One piece of work and its news. Signals are emitted on the GUI thread, in order: any number
    of `progress`, then exactly one of `returned`, `errored`, `cancelled`, then `finished`."""

    progress = Signal(object)  # the work's words (str), or what it posts as progress (a download's bytes)
    returned = Signal(object)  # the work's return value
    errored = Signal(str)  # why it failed, in words
    cancelled = Signal()
    finished = Signal()

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.channel = Channel()
        self._active = True
        self._discarded = False

    @property
    def running(self) -> bool:
        """From the start until its outcome has reached the GUI thread."""
        return self._active

    @property
    def cancel_requested(self) -> bool:
        return self.channel.cancelled

    def cancel(self) -> None:
        self.channel.cancel()

    def discard(self) -> None:
        """Cancel, and emit nothing more (a newer job supersedes this one)."""
        self._discarded = True
        self.cancel()

    def report(self, message: str) -> None:
        """Progress from the work (any thread); raises Cancelled once cancel() was asked for."""
        self.channel(message)

    def wait(self, timeout: float) -> bool:
        """Block until the work has ended (window close, tests); True when it has."""
        raise NotImplementedError

    @Slot()
    def drain(self) -> None:
        """Emit the news that arrived (GUI thread only)."""
        while True:
            try:
                kind, payload = self.channel.news.get_nowait()
            except queue.Empty:
                return
            final = kind != "progress"
            if final:
                self._active = False
                self._ended()
            if not self._discarded:
                if kind == "progress":
                    self.progress.emit(payload)
                elif kind == "returned":
                    self.returned.emit(payload)
                elif kind == "errored":
                    self.errored.emit(payload)
                else:
                    self.cancelled.emit()
                if final:
                    self.finished.emit()
            if final:
                # Nothing more will come: the Qt side goes (its Python attributes stay readable
                # for whoever still holds it: running, wait).
                self.deleteLater()
                return

    def _ended(self) -> None:
        """The outcome has been drained (GUI thread): nothing more will come."""


class Worker(Job):
    """A job on a named daemon thread of its own; its timer drains the news while it runs."""

    def __init__(self, fn: Callable[..., Any], name: str, progress: bool, parent: QObject | None = None):
        super().__init__(name, parent)
        self._poll = QTimer(self)
        self._poll.setInterval(POLL_MS)
        self._poll.timeout.connect(self.drain)
        channel = self.channel  # the thread holds the channel and the work, never this QObject
        run = (lambda: fn(channel)) if progress else fn
        self._thread = threading.Thread(target=channel.outcome, args=(run,), name=name, daemon=True)

    def start(self) -> Worker:
        self._poll.start()
        self._thread.start()
        return self

    def wait(self, timeout: float) -> bool:
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _ended(self) -> None:
        self._poll.stop()


def create_worker(
    fn: Callable[..., Any],
    *,
    name: str,
    progress: bool = False,
    parent: QObject | None = None,
    start: bool = True,
    on_progress: Callable[[str], None] | None = None,
    on_returned: Callable[[Any], None] | None = None,
    on_errored: Callable[[str], None] | None = None,
    on_cancelled: Callable[[], None] | None = None,
) -> Worker:
    """Run `fn()` (or `fn(report)` with `progress=True`) on a thread named `name` ("kvscope-..."),
    its news delivered on the GUI thread to the given callbacks (connected before it starts)."""
    worker = Worker(fn, name, progress, parent)
    connect(worker, on_progress, on_returned, on_errored, on_cancelled)
    return worker.start() if start else worker


class EngineCall(Job):
    """A question the engine answers on its thread (EngineHost.ask); the host drains its news
    each render tick."""

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(name, parent)
        self._future: Future[Any] | None = None

    def attach(self, future: Future[Any]) -> None:
        """The engine's Future for this call: its outcome becomes the job's (posted, from whichever
        thread completes it, to the channel only)."""
        self._future = future
        channel = self.channel
        future.add_done_callback(lambda f: channel.outcome(f.result))

    def fail(self, message: str) -> None:
        """The call could not be made at all (no engine): it errors with `message`."""
        self.channel.post("errored", message)

    def cancel(self) -> None:
        super().cancel()
        if self._future is not None:
            self._future.cancel()  # not yet started: it never runs

    def wait(self, timeout: float) -> bool:
        if self._future is None:
            return True
        try:
            self._future.exception(timeout)
        except CancelledError:
            pass
        except FutureTimeout:
            return False
        return True


def connect(
    job: Job,
    on_progress: Callable[[str], None] | None = None,
    on_returned: Callable[[Any], None] | None = None,
    on_errored: Callable[[str], None] | None = None,
    on_cancelled: Callable[[], None] | None = None,
) -> Job:
    for signal, slot in (
        (job.progress, on_progress),
        (job.returned, on_returned),
        (job.errored, on_errored),
        (job.cancelled, on_cancelled),
    ):
        if slot is not None:
            signal.connect(slot)
    return job


def gather(*futures: Future[Any]) -> Future[tuple[Any, ...]]:
    """One Future of several answers, in order: it fails with the first that fails. (Two
    questions asked together, e.g. a prompt's fit and a token's text, reach the GUI at once.)"""
    combined: Future[tuple[Any, ...]] = Future()
    answers: list[Any] = [None] * len(futures)
    left = [len(futures)]
    lock = threading.Lock()  # the answers may come from different threads

    def done(index: int, future: Future[Any]) -> None:
        with lock:
            if combined.done():
                return
            try:
                answers[index] = future.result()
            except BaseException as exc:  # noqa: BLE001 - the combined Future carries it
                combined.set_exception(exc)
                return
            left[0] -= 1
            if left[0] == 0:
                combined.set_result(tuple(answers))

    for index, future in enumerate(futures):
        future.add_done_callback(functools.partial(done, index))
    return combined
