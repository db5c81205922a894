"""The engine on its own thread: load, then serve submitted requests until shut down.

All public methods are safe to call from any thread. Events go to `sink`, a callable that must
not block (the app's EventStore.push, a queue.put, a list.append). The engine never waits for
the consumer.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from engine.config import EngineConfig
from engine.events import EngineError, Event, ModelInfo, ModelLoaded, ModelLoadFailed, ModelLoading

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.core.llm_engine import LLMEngine
    from engine.model.loaded import LoadedModel
    from engine.request import Request

T = TypeVar("T")

# How often an idle engine wakes to sample memory: the memory graph keeps moving while idle,
# and it bounds how long shutdown waits on an idle loop.
IDLE_POLL_S = 0.25


class Engine:
    def __init__(
        self, config: EngineConfig, sink: Callable[[Event], None], loaded: LoadedModel | None = None
    ):
        self.config = config
        self._sink = sink
        self._loaded = loaded  # None: load config.model on the thread
        # (kind, payload): ("submit", (request_id, Request)), ("cancel", request_id),
        # ("call", (fn, Future)), ("wake", None)
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._core: LLMEngine | None = None
        self.info: ModelInfo | None = None
        self.load_error: str | None = None
        self._closing = threading.Lock()  # `call` vs the loop's end: a call is run or failed, never lost
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="kvscope-engine", daemon=True)
        self._thread.start()

    def wait_until_loaded(self, timeout: float | None = None) -> ModelInfo | None:
        """Block until the model is loaded (returns its info) or failed to load (returns None)."""
        self._ready.wait(timeout)
        return self.info

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._loaded.tokenizer if self._loaded is not None else None

    @property
    def core(self) -> LLMEngine | None:
        """The synchronous engine (LLMEngine); only for the engine thread and tests."""
        return self._core

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel everything, stop the loop and join the thread."""
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queue a Request; returns its id at once. Its events carry that id."""
        request_id = next(self._ids)
        self._commands.put(("submit", (request_id, request)))
        return request_id

    def cancel(self, request_id: int) -> None:
        self._commands.put(("cancel", request_id))

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(llm_engine)` on the engine thread between two steps; its result (or exception)
        arrives in the returned Future. How the GUI asks the engine anything (count tokens,
        recompute a token's logits, read a figure) without touching its state from another
        thread. Before the model is loaded, or after it failed, the Future fails."""
        future: Future[T] = Future()
        with self._closing:
            if self._closed:
                future.set_exception(RuntimeError(self._closed_reason()))
            else:
                self._commands.put(("call", (fn, future)))
        return future

    def _closed_reason(self) -> str:
        if self.load_error:
            return f"the model did not load: {self.load_error}"
        return "the engine has stopped"

    def _close(self) -> None:
        """The loop has ended: no command will run again. Calls still queued fail at once."""
        from engine.model import runtime_memory

        runtime_memory.engine_released()
        with self._closing:
            self._closed = True
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                payload[1].set_exception(RuntimeError(self._closed_reason()))

    # ---- thread body -----------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        with contextlib.suppress(Exception):  # a broken consumer must not kill inference
            self._sink(event)

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # noqa: BLE001 - every load failure becomes a message
            from engine.model.errors import describe_load_error

            self.load_error = describe_load_error(exc)
            self._emit(ModelLoadFailed(self.load_error, time.perf_counter()))
            self._ready.set()
            self._close()
            return
        self._ready.set()
        try:
            self._serve()
        finally:
            self._loaded_core().abort_all()
            self._close()

    def _load(self) -> None:
        from engine.core.llm_engine import LLMEngine
        from engine.model import runtime_memory
        from engine.model.loading import load_model

        loads = self._loaded is None
        before = runtime_memory.resident_bytes()
        if self._loaded is None:

            def progress(stage: str, fraction: float) -> None:
                self._emit(ModelLoading(stage, fraction, time.perf_counter()))

            self._loaded = load_model(self.config.model, progress=progress)
        core = self._core = LLMEngine(self._loaded, self.config, self._emit)
        pool, storage = core.kv.pool, core.storage
        self._emit(
            ModelLoaded(
                self._loaded.info, pool.num_blocks, pool.block_size, storage.total_bytes, time.perf_counter()
            )
        )
        self.info = self._loaded.info
        if loads:
            runtime_memory.give_back_freed_memory()  # the load's short-lived copies
        sample = core.sample_memory()
        if loads and self._loaded.device.type == "cpu":  # what the runtime adds to a load, measured
            runtime_memory.record_load(
                before, sample.process_bytes, self.info.weight_bytes, storage.total_bytes, self.info.name
            )
        else:
            runtime_memory.engine_holds(self.info.weight_bytes + storage.total_bytes)

    def _loaded_core(self) -> LLMEngine:
        assert self._core is not None, "commands are served only after the model loaded"
        return self._core

    def _serve(self) -> None:
        core = self._loaded_core()
        last_memory = 0.0
        while not self._stop.is_set():
            block = not core.has_work()
            try:
                while True:
                    kind, payload = (
                        self._commands.get(block, IDLE_POLL_S) if block else self._commands.get_nowait()
                    )
                    block = False
                    self._handle(kind, payload)
            except queue.Empty:
                pass
            if self._stop.is_set():
                break
            if core.has_work():
                try:
                    core.step()
                except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving
                    core.fail_running(f"{type(exc).__name__}: {exc}")
                    self._emit(EngineError(f"step failed: {type(exc).__name__}: {exc}", time.perf_counter()))
            now = time.perf_counter()
            if now - last_memory >= IDLE_POLL_S:
                core.sample_memory()
                last_memory = now

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "submit":
            request_id, request = payload
            self._loaded_core().add_request(request, request_id=request_id)
        elif kind == "cancel":
            self._loaded_core().abort(payload)
        elif kind == "call":
            fn, future = payload
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self._loaded_core()))
            except BaseException as exc:  # noqa: BLE001 - the caller gets it, the engine goes on
                future.set_exception(exc)
