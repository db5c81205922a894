"""A remote OpenAI-compatible server in the place of the in-process engine.

`RemoteEngine` is the remote implementation of engine.api's EngineClient (the protocol the local
engine implements too): it submits, cancels and runs requests and pushes their events into a sink
that never waits; the questions only an engine in this process can answer (counting with its
tokenizer, a what-if, a measurement on its model) fail at once, saying so. All its I/O runs on one thread with an asyncio loop and
httpx: each reply is a task (cancelling it closes the HTTP stream, which a server reads as a
disconnect and cancels the request), /metrics is polled by another, and a kvscope server's
/v1/kvscope/events stream by a third, so the GUI thread never blocks on the network.

A generic server's replies become events here (app.remote.openai_stream: timed on this client).
A kvscope server's replies are only *sent* here: their events, the same as a local engine's,
come on its events stream (app.remote.kvscope_events), with blocks, steps and memory.

Over 400 lines on purpose: one class owns the one asyncio loop and the state its tasks share
(replies in flight, the events stream, the metrics poll); the protocol details live beside it
(http, openai_stream, kvscope_events, prom, vllm_kv).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import httpx

from app.remote import vllm_kv
from app.remote.http import RemoteError, error_message, request_body, sse_messages
from app.remote.kvscope_events import EventTranslator
from app.remote.openai_stream import ReplyAdapter
from app.remote.prom import MetricsSample, family_of, parse, point_between
from app.remote.records import RemoteAttached, RemoteMetrics, RemoteMetricsUnavailable, RemotePrefixCache
from app.remote.target import RemoteSource, RemoteTarget
from engine.api import (
    ContextFit,
    DeviceLimits,
    DeviceStatus,
    Limits,
    SpeedupResult,
    Tokens,
    decode_events,
)
from engine.config import SamplingParams, SpeculativeConfig
from engine.events import (
    EngineError,
    Event,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    RequestEnd,
    RequestFailed,
    RequestFinished,
    RequestStats,
    TokenSnapshot,
)
from engine.inside import ControlVector, ExpertRoutes, Steered, TextScore, TokenInside, WhatIfAnswer
from engine.request import ChatMessage, Request, ToolSpec

if TYPE_CHECKING:
    from engine.api import LoadedModel

METRICS_POLL_S = 1.0
CONNECT_TIMEOUT_S = 10.0
# A reply may wait long for its first token on a busy server; a stream idle this long is dead.
READ_TIMEOUT_S = 600.0
RECONNECT_S = 1.0
# A kvscope reply cancelled before the events stream named it waits this long for its end there.
CANCEL_GRACE_S = 2.0


class RemoteEngine:
    def __init__(
        self,
        target: RemoteTarget,
        sink: Callable[[object], None],
        on_record: Callable[[object], None],
        metrics_poll_s: float = METRICS_POLL_S,
        use_events: bool = True,
    ) -> None:
        self.target = target
        self._events = sink
        self._runs: list[tuple[dict[int, RequestEnd | None], Future[list[RequestEnd]]]] = []
        self._runs_lock = threading.Lock()
        self._on_record = on_record
        self._poll_s = metrics_poll_s
        self._use_events = use_events  # False: treat even a kvscope server as a plain OpenAI one
        self.info = None  # a kvscope server's ModelInfo, once its stream said it
        self.source: RemoteSource | None = None
        self._load_error: str | None = None
        self._ids = itertools.count(1)
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._io_loop: asyncio.AbstractEventLoop | None = None  # the thread's loop while it runs
        self._loop: asyncio.AbstractEventLoop | None = None  # set while replies can be submitted
        self._stop: asyncio.Event | None = None
        self._stopping = threading.Event()
        self._http: httpx.AsyncClient | None = None
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._tasks: dict[int, asyncio.Task] = {}  # loop thread: the replies that have begun
        self._cancel_first: set[int] = set()  # loop thread: cancelled before they began
        self._ended: set[int] = set()  # kvscope: own requests known to have ended
        self._failed_here: set[int] = set()  # kvscope: own requests failed from the HTTP side
        self._logprobs_refused = False
        self._translator = EventTranslator(lambda: next(self._ids), self._display_name)

    # ---- the EngineClient surface ----------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("remote engine already started")
        self._thread = threading.Thread(target=self._run, name="kvscope-remote", daemon=True)
        self._thread.start()

    def wait_until_loaded(self, timeout: float | None = None) -> bool:
        """Block until the server answered (and a kvscope server's stream named its model): True;
        False when it failed or `timeout` passed."""
        return self._ready.wait(timeout) and self._load_error is None

    @property
    def load_error(self) -> str | None:
        """Why attaching failed, in one line (None while connecting, or once attached)."""
        return self._load_error

    @property
    def events(self) -> Callable[[Event], None]:
        """Where the engine's events go, in order: the sink it was made with."""
        return self._events

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: Request) -> int:
        if self._loop is None or self.source is None:
            raise RuntimeError(f"not connected to {self.target.url}")
        request_id = next(self._ids)
        future = asyncio.run_coroutine_threadsafe(self._reply(request_id, request), self._loop)
        self._replies[request_id] = future
        future.add_done_callback(lambda _f, rid=request_id: self._replies.pop(rid, None))
        return request_id

    def cancel(self, request_id: int) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended: so has the reply
                loop.call_soon_threadsafe(self._cancel_on_loop, request_id)

    def _cancel_on_loop(self, request_id: int) -> None:
        """Cancelling the task closes its HTTP stream, which the server takes as a disconnect and
        cancels the request. A reply not yet begun ends before it sends anything."""
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()
        elif request_id in self._replies:
            self._cancel_first.add(request_id)

    def run(self, requests: Sequence[Request]) -> Future[list[RequestEnd]]:
        """Submit `requests`; the Future holds each one's end, in order, once all have ended."""
        future: Future[list[RequestEnd]] = Future()
        if not requests:
            future.set_result([])
            return future
        ends: dict[int, RequestEnd | None] = {}
        with self._runs_lock:  # registered before any can end
            self._runs.append((ends, future))
            for request in requests:
                ends[self.submit(request)] = None
        return future

    # ---- questions: only an engine in this process can answer them ------------------------------
    def count_prompt(self, request: Request) -> Future[int]:
        return self._unavailable("counting a prompt's tokens")

    def limits(self) -> Future[Limits]:
        return self._unavailable("its limits")

    def prompt_spans(self, request: Request) -> Future[tuple[tuple[int, int], ...]]:
        return self._unavailable("finding a tool result's tokens in a prompt")

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
        return self._unavailable("fitting a conversation into its context")

    def decode(self, token_ids: Sequence[int], after: Sequence[int] = ()) -> Future[str]:
        return self._unavailable("decoding tokens")

    def tokens_of(self, pieces: Sequence[str | int]) -> Future[list[Tokens]]:
        return self._unavailable("tokenizing")

    def device(self) -> Future[DeviceStatus]:
        return self._unavailable("its device's memory")

    def device_limits(self, refresh: bool = False) -> Future[DeviceLimits]:
        return self._unavailable("measuring its device")

    def what_if(
        self, request: Request, output_ids: Sequence[int], recorded: TokenSnapshot, params: SamplingParams
    ) -> Future[WhatIfAnswer]:
        return self._unavailable("a what-if")

    def inspect_token(
        self, request: Request, output_ids: Sequence[int], token_id: int, top_k: int = 5
    ) -> Future[TokenInside]:
        return self._unavailable("the logit lens and attention of a token")

    def expert_routes(self, request: Request, output_ids: Sequence[int]) -> Future[ExpertRoutes]:
        return self._unavailable("expert routes")

    def score_text(self, text: str, top_k: int = 5) -> Future[TextScore]:
        return self._unavailable("scoring a text")

    def read_control_vector(self, path: str) -> Future[ControlVector]:
        return self._unavailable("steering with a control vector")

    def contrast_vector(self, positive: str, negative: str) -> Future[ControlVector]:
        return self._unavailable("steering with a control vector")

    def steer(
        self,
        request: Request,
        output_ids: Sequence[int],
        vector: ControlVector,
        layer: int | None,
        strength: float,
        top_n: int = 10,
    ) -> Future[Steered]:
        return self._unavailable("steering with a control vector")

    def measure_speedup(
        self, request: Request, speculative: SpeculativeConfig, progress: Callable[[str], None]
    ) -> Future[SpeedupResult]:
        return self._unavailable("measuring a speedup")

    def loaded_model(self) -> Future[LoadedModel]:
        return self._unavailable("its loaded model")

    def _unavailable(self, what: str) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_exception(
            RuntimeError(f"not available on a remote engine ({what}): the engine runs on {self.target.label}")
        )
        return future

    # ---- events ----------------------------------------------------------------------------
    def _sink(self, event: Any) -> None:
        """Every event goes here, on to the app's sink; a `run`'s requests are watched for their end."""
        self._events(event)
        if self._runs and isinstance(event, (RequestFinished, RequestFailed)):
            with self._runs_lock:
                for ends, future in list(self._runs):
                    if event.request_id in ends:
                        ends[event.request_id] = event
                        done = [e for e in ends.values() if e is not None]
                        if len(done) == len(ends):
                            self._runs.remove((ends, future))
                            future.set_result(done)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        loop, stop = self._io_loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._io_loop = loop
        try:
            loop.run_until_complete(self._main(loop))
        finally:
            loop.close()
            self._ready.set()
            with self._runs_lock:  # runs still waiting for their requests' ends never get them
                runs, self._runs = self._runs, []
            for _, future in runs:
                future.set_exception(RuntimeError(f"the connection to {self.target.label} has ended"))

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stop = asyncio.Event()
        if self._stopping.is_set():  # shut down before the loop even ran
            return
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
        async with httpx.AsyncClient(
            base_url=self.target.url, headers=self.target.headers(), timeout=timeout
        ) as http:
            self._http = http
            try:
                self.source = await self._probe()
            except RemoteError as exc:
                self._load_error = str(exc)
                self._sink(ModelLoadFailed(self.load_error, time.perf_counter()))
                return
            if self._stopping.is_set():
                return
            self._loop = loop
            self._on_record(RemoteAttached(self.source))
            tasks = [asyncio.create_task(self._poll_metrics())]
            if self.source.events:
                tasks.append(asyncio.create_task(self._follow_events()))
            else:
                self._ready.set()
            if self.source.family == "vllm":
                endpoint = vllm_kv.endpoint_for(self.target.url)
                report = lambda state: self._on_record(RemotePrefixCache(state))  # noqa: E731
                tasks.append(asyncio.create_task(vllm_kv.follow(endpoint, report)))
            await self._stop.wait()
            self._loop = None
            for request_id in list(self._replies):
                self._cancel_on_loop(request_id)
            for task in tasks:
                task.cancel()
            # let cancelled replies send their last events and close their streams
            await asyncio.gather(
                *tasks, *asyncio.all_tasks() - {asyncio.current_task()}, return_exceptions=True
            )

    async def _probe(self) -> RemoteSource:
        label = self.target.label
        self._sink(ModelLoading(f"connecting to {label}", 0.2, time.perf_counter()))
        try:
            response = await self._http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach {self.target.url}: {exc or type(exc).__name__}") from exc
        if response.status_code == 401:
            what = "refused the API key" if self.target.api_key else "needs an API key"
            raise RemoteError(f"{label} {what} (HTTP 401: {error_message(response, response.content)})")
        if response.status_code != 200:
            raise RemoteError(f"{label} is not an OpenAI-compatible server: GET /v1/models answered "
                              f"{error_message(response, response.content)}")  # fmt: skip
        try:
            models = response.json()["data"]
            model = models[0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise RemoteError(f"{label} lists no model at /v1/models") from exc
        family, metrics = "", False
        try:
            scraped = await self._http.get("/metrics")
            if scraped.status_code == 200:
                family, metrics = family_of(scraped.text), True
        except httpx.HTTPError:
            pass
        kvscope = self._use_events and (model.get("owned_by") == "kvscope" or family == "kvscope")
        self._sink(ModelLoading(f"attached to {label}", 1.0, time.perf_counter()))
        return RemoteSource(self.target, str(model.get("id")), family or ("kvscope" if kvscope else ""),
                            kvscope, metrics, time.perf_counter())  # fmt: skip

    def _display_name(self, served: str) -> str:
        return self.source.display_name if self.source is not None else served

    # ---- metrics ---------------------------------------------------------------------------
    async def _poll_metrics(self) -> None:
        previous: MetricsSample | None = None
        said: str | None = None
        while True:
            message = None
            try:
                response = await self._http.get("/metrics")
                if response.status_code == 200:
                    sample = parse(response.text, time.perf_counter(), self.source.family or None)
                    if sample.values:
                        self._on_record(
                            RemoteMetrics(sample, point_between(previous, sample) if previous else None)
                        )
                        previous, said = sample, None
                    else:
                        message = (
                            f"{self.target.label}/metrics holds none of the metrics kvscope reads "
                            "(vllm:, sglang:, llamacpp:, kvscope:)"
                        )
                else:
                    hint = (
                        " (llama.cpp's server exports them with --metrics)"
                        if response.status_code == 404
                        else ""
                    )
                    message = f"{self.target.label} has no /metrics (HTTP {response.status_code}){hint}"
            except httpx.HTTPError as exc:
                message = f"reading {self.target.label}/metrics failed: {exc or type(exc).__name__}"
            except ValueError as exc:
                message = f"{self.target.label}/metrics is not Prometheus text: {exc}"
            if message is not None and message != said:
                self._on_record(RemoteMetricsUnavailable(message))
                said = message
            await asyncio.sleep(self._poll_s)

    # ---- a kvscope server's events ---------------------------------------------------------
    async def _follow_events(self) -> None:
        while True:
            try:
                async with self._http.stream(
                    "GET", "/v1/kvscope/events", timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None)
                ) as r:
                    if r.status_code != 200:
                        raise RemoteError(error_message(r, await r.aread()))
                    async for event, data in sse_messages(r):
                        if event == "hello":
                            self._translator.hello(float(json.loads(data)["t"]), time.perf_counter())
                        elif event == "events":
                            self._forward(decode_events(data))
                        elif event == "overflow":
                            raise RemoteError(json.loads(data).get("message", "the events stream overflowed"))
                raise RemoteError("the server closed its events stream")
            except (RemoteError, httpx.HTTPError, ValueError) as exc:
                if not self._ready.is_set():
                    self._load_error = f"{self.target.label}: no kvscope events stream ({exc})"
                    self._sink(ModelLoadFailed(self.load_error, time.perf_counter()))
                    self._ready.set()
                    return
                self._lost_stream(str(exc) or type(exc).__name__)
            await asyncio.sleep(RECONNECT_S)

    def _forward(self, events: list) -> None:
        for event in events:
            event = self._translator.translate(event)
            if event is None:
                continue
            kind = type(event)
            if kind is ModelLoaded:
                self.info = event.info
                self._ready.set()
            elif kind in (RequestFinished, RequestFailed):
                if event.request_id in self._failed_here:
                    self._failed_here.discard(event.request_id)
                    continue  # already failed with the HTTP side's message
                self._ended.add(event.request_id)
            self._sink(event)

    def _lost_stream(self, why: str) -> None:
        """The reconnected stream starts from a new snapshot without this app's tags: its replies
        in flight are stopped (the server cancels them when their streams close)."""
        self._sink(
            EngineError(
                f"lost {self.target.label}'s events stream ({why}); reconnecting", time.perf_counter()
            )
        )
        for request_id in list(self._replies):
            if request_id not in self._ended:
                self._ended.add(request_id)
                self._sink(
                    RequestFailed(
                        request_id, f"the events stream from {self.target.label} broke", time.perf_counter()
                    )
                )
            self._cancel_on_loop(request_id)

    # ---- replies ---------------------------------------------------------------------------
    async def _reply(self, request_id: int, request: Request) -> None:
        self._tasks[request_id] = asyncio.current_task()
        try:
            if request_id in self._cancel_first:
                self._cancel_first.discard(request_id)
                self._end_unseen(request_id)
            elif self.source.events:
                await self._kvscope_reply(request_id, request)
            else:
                await self._openai_reply(request_id, request)
        finally:
            self._tasks.pop(request_id, None)

    def _end_unseen(self, request_id: int) -> None:
        """A reply cancelled before the server said anything of it ends here."""
        if request_id not in self._ended:
            self._ended.add(request_id)
            stats = RequestStats(0, 0, 0, 0.0, (), 0.0, 0, 0)
            self._sink(RequestFinished(request_id, "cancelled", "", (), stats, time.perf_counter()))

    async def _openai_reply(self, request_id: int, request: Request) -> None:
        adapter = ReplyAdapter(
            request_id, time.perf_counter(), request.sampling.n, request.sampling.snapshot_top_n > 0
        )
        self._sink(adapter.started())
        try:
            body = request_body(self.source, request, None, self._logprobs_refused)
            await self._stream_reply(body, adapter)
        except asyncio.CancelledError:
            self._sink(adapter.finished(time.perf_counter(), "cancelled"))
            raise
        except RemoteError as exc:
            self._sink(RequestFailed(request_id, str(exc), time.perf_counter()))
        except httpx.HTTPError as exc:
            self._sink(
                RequestFailed(
                    request_id,
                    f"the connection to {self.target.label} failed: {exc or type(exc).__name__}",
                    time.perf_counter(),
                )
            )
        else:
            for event in adapter.tool_calls(time.perf_counter()):  # read by the server, before the end
                self._sink(event)
            self._sink(adapter.finished(time.perf_counter()))

    async def _stream_reply(self, body: dict, adapter: ReplyAdapter) -> None:
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                message = error_message(r, await r.aread())
                if r.status_code == 400 and "logprobs" in body and "logprob" in message.lower():
                    self._logprobs_refused = True  # a server without logprobs: ask without them
                    body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
                    adapter.snapshots = False
                    await self._stream_reply(body, adapter)
                    return
                raise RemoteError(message)
            async for _event, data in sse_messages(r):
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    raise RemoteError(error_message(r, data.encode()))
                for event in adapter.feed(chunk, time.perf_counter()):
                    self._sink(event)

    async def _kvscope_reply(self, request_id: int, request: Request) -> None:
        """Sends the request; its events come on the events stream, mapped by its tag. The tag
        stays pending until that stream names it (the two connections keep no order between
        them), unless the server refused it or it was cancelled before being named."""
        tag = uuid.uuid4().hex
        pending = self._translator.pending
        pending[tag] = request_id  # before sending: its RequestTagged may come first
        try:
            async with self._http.stream(
                "POST", "/v1/chat/completions", json=request_body(self.source, request, tag, False)
            ) as r:
                if r.status_code != 200:
                    pending.pop(tag, None)  # refused: the engine never started it
                    self._fail_own(request_id, error_message(r, await r.aread()))
                    return
                async for _event, data in sse_messages(r):
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and "error" in chunk:
                        self._fail_own(request_id, error_message(r, data.encode()))
        except asyncio.CancelledError:
            if pending.pop(tag, None) is not None:
                # Not named yet: the server may never have started it. If its end has not come
                # on the stream by then, it ends here.
                asyncio.get_running_loop().call_later(CANCEL_GRACE_S, self._end_unseen, request_id)
            raise
        except RemoteError as exc:
            pending.pop(tag, None)
            self._fail_own(request_id, str(exc))
        except httpx.HTTPError as exc:
            pending.pop(tag, None)
            self._fail_own(
                request_id, f"the connection to {self.target.label} failed: {exc or type(exc).__name__}"
            )

    def _fail_own(self, request_id: int, message: str) -> None:
        """A refusal before the engine started the request (or an error it did not report)."""
        if request_id not in self._ended:
            self._ended.add(request_id)
            self._failed_here.add(request_id)
            self._sink(RequestFailed(request_id, message, time.perf_counter()))
