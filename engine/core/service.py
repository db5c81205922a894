"""The engine on its own thread: load, then serve submitted requests until shut down. The local
implementation of engine.api's EngineClient.

All public methods are safe to call from any thread. Events go to `sink`, a callable that must
not block (the app's EventStore.push, a queue.put, a list.append). The engine never waits for
the consumer. Every question (a prompt's count, the limits, a what-if, a measurement) is a named
method whose answer comes in a Future: it runs on the engine thread between two steps
(engine.core.queries), the only thread that touches the model, the tokenizer and the pool.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core import gc_heap
from engine.errors import describe_load_error
from engine.events import (
    EngineError,
    Event,
    ModelInfo,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    RequestEnd,
    RequestFailed,
    RequestFinished,
    TokenSnapshot,
)
from engine.inside import ControlVector, ExpertRoutes, Steered, TextScore, TokenInside, WhatIfAnswer
from engine.limits import ContextFit, Limits
from engine.request import ChatMessage, Request, ToolSpec
from engine.results import DeviceLimits, DeviceStatus, SpeedupResult, Tokens

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine
    from engine.core.what_if import WhatIf
    from engine.model.loaded import LoadedModel

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
        self._load_error: str | None = None
        self._closing = threading.Lock()  # `_call` vs the loop's end: a call is run or failed, never lost
        self._closed = False
        self._what_if: WhatIf | None = None  # engine thread: keeps the last what-if's logits
        self._runs: list[tuple[dict[int, RequestEnd | None], Future[list[RequestEnd]]]] = []
        self._runs_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="kvscope-engine", daemon=True)
        self._thread.start()

    def wait_until_loaded(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (True) or failed to load, or `timeout` passed (False)."""
        self._ready.wait(timeout)
        return self.info is not None

    @property
    def load_error(self) -> str | None:
        """Why loading failed, in one line (None while loading, or once loaded)."""
        return self._load_error

    @property
    def events(self) -> Callable[[Event], None]:
        """Where the engine's events go, in order: the sink it was made with."""
        return self._sink

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

    def run(self, requests: Sequence[Request]) -> Future[list[RequestEnd]]:
        """Submit `requests`; the Future holds each one's end, in order, once all have ended
        (their events go to the sink as every request's do)."""
        future: Future[list[RequestEnd]] = Future()
        if not requests:
            future.set_result([])
            return future
        ends: dict[int, RequestEnd | None] = {}
        with self._runs_lock:  # registered before any can end: the engine thread waits for the lock
            self._runs.append((ends, future))
            for request in requests:
                ends[self.submit(request)] = None
        return future

    # ---- questions, answered on the engine thread between two steps -------------------------
    def count_prompt(self, request: Request) -> Future[int]:
        from engine.core import queries  # torch: imported with the engine, on its thread

        return self._call(lambda core: queries.count_prompt(core, request))

    def limits(self) -> Future[Limits]:
        return self._call(lambda core: core.limits)

    def prompt_spans(self, request: Request) -> Future[tuple[tuple[int, int], ...]]:
        from engine.core import queries  # torch: imported with the engine, on its thread

        return self._call(lambda core: queries.prompt_spans(core, request))

    def fit_context(
        self,
        head: Sequence[ChatMessage],
        history: Sequence[ChatMessage],
        tail: Sequence[ChatMessage],
        max_new_tokens: int,
        policy: str,
        prefix_ids: Sequence[int] = (),
        tail_is_new: bool = True,
        tools: Sequence[ToolSpec] = (),
    ) -> Future[ContextFit]:
        from engine.core import queries  # torch: imported with the engine, on its thread

        return self._call(
            lambda core: queries.fit_context(
                core, head, history, tail, max_new_tokens, policy, prefix_ids, tail_is_new, tools
            )
        )

    def decode(self, token_ids: Sequence[int], after: Sequence[int] = ()) -> Future[str]:
        return self._call(lambda core: core.text.decode_after(after, token_ids))

    def tokens_of(self, pieces: Sequence[str | int]) -> Future[list[Tokens]]:
        return self._call(lambda core: core.text.tokens_of(pieces))

    def device(self) -> Future[DeviceStatus]:
        from engine.core import queries  # torch: imported with the engine, on its thread

        return self._call(queries.device)

    def device_limits(self, refresh: bool = False) -> Future[DeviceLimits]:
        from engine.core import queries  # torch: imported with the engine, on its thread

        return self._call(lambda core: queries.device_limits(core, refresh))

    def what_if(
        self, request: Request, output_ids: Sequence[int], recorded: TokenSnapshot, params: SamplingParams
    ) -> Future[WhatIfAnswer]:
        from engine.core.what_if import WhatIf  # torch: imported with the engine, on its thread

        def recompute(core: LLMEngine) -> WhatIfAnswer:
            if self._what_if is None:
                self._what_if = WhatIf()
            return self._what_if.recompute(core, request, output_ids, recorded, params)

        return self._call(recompute)

    def inspect_token(
        self, request: Request, output_ids: Sequence[int], token_id: int, top_k: int = 5
    ) -> Future[TokenInside]:
        from engine.core.inside_token import inside_token  # torch: imported with the engine, on its thread

        return self._call(lambda core: inside_token(core, request, output_ids, token_id, top_k))

    def expert_routes(self, request: Request, output_ids: Sequence[int]) -> Future[ExpertRoutes]:
        from engine.core.experts import expert_routes  # torch: imported with the engine, on its thread

        return self._call(lambda core: expert_routes(core, request, output_ids))

    def score_text(self, text: str, top_k: int = 5) -> Future[TextScore]:
        from engine.core.scoring import score_text  # torch: imported with the engine, on its thread

        return self._call(lambda core: score_text(core, text, top_k))

    def read_control_vector(self, path: str) -> Future[ControlVector]:
        # gguf's reader: imported with the engine, on its thread
        from engine.model.control_vector import check_control_vector, read_control_vector

        def read(core: LLMEngine) -> ControlVector:
            vector = read_control_vector(path)
            info = core.loaded.info
            check_control_vector(vector, info.hidden_size, info.num_layers)
            return vector

        return self._call(read)

    def contrast_vector(self, positive: str, negative: str) -> Future[ControlVector]:
        from engine.core.steering import contrast_vector  # torch: imported with the engine, on its thread

        return self._call(lambda core: contrast_vector(core, positive, negative))

    def steer(
        self,
        request: Request,
        output_ids: Sequence[int],
        vector: ControlVector,
        layer: int | None,
        strength: float,
        top_n: int = 10,
    ) -> Future[Steered]:
        from engine.core.steering import steer  # torch: imported with the engine, on its thread

        return self._call(lambda core: steer(core, request, output_ids, vector, layer, strength, top_n))

    def measure_speedup(
        self, request: Request, speculative: SpeculativeConfig, progress: Callable[[str], None]
    ) -> Future[SpeedupResult]:
        from engine.core.speedup import measure_speedup  # torch: imported with the engine, on its thread

        return self._call(
            lambda core: measure_speedup(core.loaded, core.config, speculative, request, progress)
        )

    def loaded_model(self) -> Future[LoadedModel]:
        return self._call(lambda core: core.loaded)

    def _call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(llm_engine)` on the engine thread between two steps; its result (or exception)
        arrives in the returned Future. How every question above is asked without touching the
        engine's state from another thread; private to the engine (its server's bridge uses it).
        Before the model is loaded, or after it failed, the Future fails."""
        future: Future[T] = Future()
        with self._closing:
            if self._closed:
                future.set_exception(RuntimeError(self._closed_reason()))
            else:
                self._commands.put(("call", (fn, future)))
        return future

    def _closed_reason(self) -> str:
        if self._load_error:
            return f"the model did not load: {self._load_error}"
        return "the engine has stopped"

    def _close(self) -> None:
        """The loop has ended: no command will run again. Calls still queued fail at once, and
        so do runs still waiting for their requests' ends."""
        # the model floor, imported by the engine thread's own functions (as _load does)
        from engine.model import runtime_memory

        runtime_memory.engine_released()
        gc_heap.thaw()
        with self._closing:
            self._closed = True
        with self._runs_lock:
            runs, self._runs = self._runs, []
        for _, future in runs:
            future.set_exception(RuntimeError(self._closed_reason()))
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
        if self._runs and isinstance(event, (RequestFinished, RequestFailed)):
            self._ended(event)

    def _ended(self, end: RequestEnd) -> None:
        """A request of a `run` ended: its Future completes once all of the run's have."""
        with self._runs_lock:
            for ends, future in list(self._runs):
                if end.request_id in ends:
                    ends[end.request_id] = end
                    done = [e for e in ends.values() if e is not None]
                    if len(done) == len(ends):
                        self._runs.remove((ends, future))
                        future.set_result(done)

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # noqa: BLE001 - every load failure becomes a message
            self._load_error = describe_load_error(exc)
            self._emit(ModelLoadFailed(self._load_error, time.perf_counter()))
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
        # torch and transformers are imported here, on the engine thread: creating an Engine (the
        # app's start, the server's argument checks) costs nothing, and the window draws meanwhile.
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
            runtime_memory.give_back_freed_memory()  # the engine's set-up's copies (load_model gave back its own)
        gc_heap.freeze()  # what lives now lives as long as the engine: out of full collections
        sample = core.sample_memory()
        if loads and self._loaded.device.type == "cpu":  # what the runtime adds to a load, measured
            runtime_memory.record_load(
                before, sample.process_bytes, self.info.weight_bytes, storage, self.info.name
            )
        else:
            runtime_memory.engine_holds(self.info.weight_bytes, storage)

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
