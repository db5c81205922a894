"""Hosts the engine for the GUI: owns the Engine, its EventStore sink and the LiveState fold.

The engine thread only ever calls `EventStore.push` (a lock and an append), never Qt. The GUI
pulls: a render timer on the GUI thread drains the store up to 30 times a second (paced to a CPU
budget by app.frame_pacer while the engine generates), folds the
batch into LiveState, and re-emits what the chat needs as ordinary same-thread Qt signals. So no
signal ever crosses threads, and a burst of thousands of events costs one redraw per panel.

What the GUI needs from the engine beyond its events goes through `ask(query)`: one of the
engine's named questions (engine.api.EngineClient: a prompt's count, a what-if, a measured
speedup...), answered on the engine thread between two steps; the answer reaches the GUI thread
as an `app.workers.EngineCall`'s signals, drained on the same render tick.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from app.frame_pacer import MIN_INTERVAL_MS, FramePacer
from app.workers import EngineCall
from engine.api import EngineClient, local_engine
from engine.config import EngineConfig
from engine.events import (
    EngineError,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    RequestFailed,
    RequestFinished,
    RequestStarted,
    TokenGenerated,
    ToolCallsParsed,
)
from engine.request import Request
from live.event_store import EventStore
from live.state import LiveState

# How long closing the window waits for the engine thread. A step of a small model takes
# milliseconds; a model still loading cannot be interrupted, so the wait is bounded.
SHUTDOWN_TIMEOUT_S = 30.0
# When the user loads another model, the old engine gets this long to stop before the GUI moves
# on; one still busy (mid-load) is kept and joined at exit so no thread outlives the app.
RESTART_TIMEOUT_S = 2.0
# Requests remembered by id for what needs them after they ran (a token's what-if recomputes its
# prompt): as many as the live state keeps views of.
REMEMBERED_REQUESTS = 256


@dataclass(frozen=True, slots=True)
class HostStatus:
    """What the window needs to enable its controls."""

    loading: bool
    ready: bool
    generating: bool


class EngineHost(QObject):
    # All emitted on the GUI thread from the render timer.
    model_loading = Signal(object)  # ModelLoading
    model_loaded = Signal(object)  # ModelLoaded
    model_load_failed = Signal(str)
    request_started = Signal(object)  # RequestStarted
    tokens_generated = Signal(int, list)  # request id, this frame's TokenGenerated events for it
    request_finished = Signal(object)  # RequestFinished
    request_failed = Signal(object)  # RequestFailed
    tool_calls_parsed = Signal(
        object
    )  # ToolCallsParsed: a reply of a request that offered tools, read for calls
    engine_error = Signal(str)
    frame = Signal(object)  # set[str]: LiveState's dirty keys, after the fold
    status_changed = Signal()

    def __init__(self, live: LiveState | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.live = live or LiveState()
        self.engine: EngineClient | None = None
        self.store: EventStore | None = None
        self.config: EngineConfig | None = None
        self.model_name: str = ""
        self._loading = False
        self._ready = False
        self._in_flight: set[int] = set()
        self._no_token_yet: set[int] = set()  # in flight, no token shown: frames stay fast for it
        self._retired: list[EngineClient] = []
        self._calls: list[EngineCall] = []  # engine calls whose outcome has not reached the GUI yet
        self._requests: OrderedDict[int, Request] = OrderedDict()  # this engine's, by request id
        self.generation = 0  # bumped per engine: request ids restart at 1 with each engine
        self.pacer = FramePacer()
        self._timer = QTimer(self)
        self._timer.setInterval(MIN_INTERVAL_MS)
        self._timer.timeout.connect(self._on_timer)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, config: EngineConfig, loaded: Any = None) -> None:
        """Start an engine for `config` (stopping any current one); loading runs on its thread.
        `loaded`: the model another engine had loaded (EngineClient.loaded_model's answer, opaque
        here), started on without loading it again."""
        self.stop(RESTART_TIMEOUT_S)
        self.config = config
        self.generation += 1
        # A fresh inbox per engine: nothing a previous engine pushed late can leak into this one.
        self.store = EventStore()
        self._run(local_engine(config, self.store.push, loaded))

    def _run(self, engine: EngineClient) -> None:
        """Start `engine` as this host's, loading until its first event: an in-process engine, or
        a remote one (app.remote's RemoteEngine)."""
        self.engine = engine
        self._loading, self._ready = True, False
        self.model_name = ""
        self.engine.start()
        if not self._timer.isActive():
            self._timer.start()
        self.status_changed.emit()

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Cancel what runs and stop the engine thread; True when it has ended."""
        engine = self.engine
        if engine is None:
            return True
        for request_id in list(self._in_flight):
            engine.cancel(request_id)
        engine.shutdown(timeout)
        self.render_tick()  # fold the cancellations and final events while the store still is ours
        self._drain_calls()  # calls the stopped engine failed or finished
        self.engine, self.store = None, None
        self._in_flight.clear()
        self._no_token_yet.clear()
        self._requests.clear()  # the next engine numbers its requests from 1 again
        self._loading = self._ready = False
        stopped = not engine.is_alive()
        if not stopped:
            self._retired.append(engine)
        self.status_changed.emit()
        return stopped

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Window closing: stop the engine and every retired one, then the timer."""
        stopped = self.stop(timeout)
        deadline = time.monotonic() + timeout
        for engine in self._retired:
            engine.shutdown(max(0.0, deadline - time.monotonic()))
        self._retired = [e for e in self._retired if e.is_alive()]
        self._timer.stop()
        return stopped and not self._retired

    def threads_alive(self) -> bool:
        engines = [*self._retired, *([self.engine] if self.engine else [])]
        return any(e.is_alive() for e in engines)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        if self.engine is None or not self._ready:
            raise RuntimeError("no model is loaded")
        request_id = self.engine.submit(request)
        self._in_flight.add(request_id)
        self._no_token_yet.add(request_id)
        self._requests[request_id] = request
        while len(self._requests) > REMEMBERED_REQUESTS:
            self._requests.popitem(last=False)
        self.status_changed.emit()
        return request_id

    def cancel(self, request_id: int) -> None:
        if self.engine is not None and request_id in self._in_flight:
            self.engine.cancel(request_id)

    def request(self, request_id: int) -> Request | None:
        """A request this engine was given (None: not one of the last REMEMBERED_REQUESTS)."""
        return self._requests.get(request_id)

    def ask(
        self, query: Callable[..., Future[Any]], *, name: str = "engine question", progress: bool = False
    ) -> EngineCall:
        """Ask the engine one of its questions: `query(engine)` (or `query(engine, report)` with
        `progress=True`) calls an EngineClient method, e.g. `lambda engine: engine.limits()`. The
        answer arrives on the GUI thread as the returned job's signals; without an engine, or once
        it has stopped, the job errors with the reason. `report(message)` raises Cancelled once
        the job was cancelled, which ends the engine's work at its next piece."""
        job = EngineCall(name, self)
        self._calls.append(job)
        if self.engine is None:
            job.fail("no model is loaded")
            QTimer.singleShot(0, self._drain_calls)
            return job
        engine = self.engine
        job.attach(query(engine, job.channel) if progress else query(engine))
        return job

    def first_token_due(self) -> bool:
        """A reply in flight has shown no token yet (the render timer stays at its fastest)."""
        return bool(self._no_token_yet)

    def status(self) -> HostStatus:
        return HostStatus(loading=self._loading, ready=self._ready, generating=bool(self._in_flight))

    # ---- the render tick -------------------------------------------------------------------
    @Slot()
    def _on_timer(self) -> None:
        self.render_tick()
        self._drain_calls()
        self._timer.setInterval(
            self.pacer.next_interval_ms(busy=bool(self._in_flight), first_token_due=self.first_token_due())
        )

    def render_tick(self) -> None:
        if self.store is None:
            return
        events = self.store.drain()
        dirty = self.live.apply(events) if events else set()
        if events:
            self._dispatch(events)
        # Emitted even when nothing arrived: a panel may be animating (the page map's fading
        # highlight of freshly written blocks); each decides from `dirty` whether to redraw.
        self.frame.emit(dirty)

    @Slot()
    def _drain_calls(self) -> None:
        for job in self._calls:
            job.drain()
        self._calls = [job for job in self._calls if job.running]

    def _dispatch(self, events: Iterable) -> None:
        """Re-emit the lifecycle the chat follows; tokens are grouped per request per frame."""
        tokens: dict[int, list[TokenGenerated]] = {}
        status_changed = False
        for event in events:
            kind = type(event)
            if kind is TokenGenerated:
                tokens.setdefault(event.request_id, []).append(event)
                continue
            if tokens and kind in (RequestFinished, RequestFailed, ToolCallsParsed):
                self._flush_tokens(tokens)  # a reply's tokens always arrive before its end
            if kind is ModelLoading:
                self.model_loading.emit(event)
            elif kind is ModelLoaded:
                self._loading, self._ready = False, True
                self.model_name = event.info.name
                self.model_loaded.emit(event)
                status_changed = True
            elif kind is ModelLoadFailed:
                self._loading, self._ready = False, False
                self.model_load_failed.emit(event.message)
                status_changed = True
            elif kind is RequestStarted:
                self.request_started.emit(event)
            elif kind is RequestFinished:
                self._in_flight.discard(event.request_id)
                self._no_token_yet.discard(event.request_id)
                self.request_finished.emit(event)
                status_changed = True
            elif kind is RequestFailed:
                self._in_flight.discard(event.request_id)
                self._no_token_yet.discard(event.request_id)
                self.request_failed.emit(event)
                status_changed = True
            elif kind is ToolCallsParsed:
                self.tool_calls_parsed.emit(event)
            elif kind is EngineError:
                self.engine_error.emit(event.message)
        self._flush_tokens(tokens)
        if status_changed:
            self.status_changed.emit()

    def _flush_tokens(self, tokens: dict[int, list[TokenGenerated]]) -> None:
        for request_id, batch in tokens.items():
            self._no_token_yet.discard(request_id)
            self.tokens_generated.emit(request_id, batch)
        tokens.clear()
