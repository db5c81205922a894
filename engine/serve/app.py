"""The HTTP layer: OpenAI's routes over one `EngineBridge`. It only translates: a request body
becomes engine requests (engine.serve.params), their events become chunks or a body
(engine.serve.replies); everything else is the engine's.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, GET /v1/kvscope/events. With an API key, every /v1 route needs
`Authorization: Bearer KEY` (as vLLM does, /health and /metrics stay open).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.config import ConfigError
from engine.errors import InspectionError
from engine.events import RequestFailed, RequestFinished, RequestStarted
from engine.serve import codec
from engine.serve.bridge import EngineBridge, ServeError, Started
from engine.serve.channel import Channel, ChannelOverflow
from engine.serve.logprobs import TokenStrings
from engine.serve.params import Plan, Prompt, chat_plan, completion_plan
from engine.serve.protocol import ERROR_TYPES, ChatRequest, CompletionRequest, error_body
from engine.serve.replies import CompletionEntry, EchoedPrompt, Reply

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine
    from engine.serve.replies import Reply

Json = dict[str, Any]  # a chunk or body as it is serialised

# A non-streaming request checks this often whether its client is still there.
DISCONNECT_POLL_S = 0.5
# An idle events stream sends a comment this often so proxies and clients keep it open.
KEEPALIVE_S = 15.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(message, ERROR_TYPES.get(status, "invalid_request_error"), param, code), status
    )


def sse(data: Json | str, event: str | None = None) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


class RequireKey:
    """`Authorization: Bearer KEY` on every /v1 route. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would wrap `receive` and hide a client's disconnect from the routes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    401,
                    "Incorrect or missing API key: send Authorization: Bearer KEY.",
                    None,
                    "invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(bridge: EngineBridge, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="kvscope", docs_url=None, redoc_url=None, openapi_url=None)
    strings = TokenStrings(bridge.token_bytes)
    model = bridge.model_name

    # ---- errors in OpenAI's shape ----------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return error_response(
            400, f"{param + ': ' if param else ''}{first.get('msg')}", param, "invalid_value"
        )

    @app.exception_handler(ServeError)
    async def _refused(_request: Request, exc: ServeError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    if api_key is not None:
        app.add_middleware(RequireKey, api_key=api_key)

    def check_model(name: str | None) -> None:
        if name is not None and name != model:
            raise ServeError(
                f"The model `{name}` does not exist: this server serves `{model}`.",
                "model",
                "model_not_found",
                404,
            )

    # ---- information -----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not bridge.engine.is_alive():
            return error_response(503, "the engine has stopped")
        return JSONResponse({"status": "ok", "model": model})

    @app.get("/metrics")
    async def metrics() -> Response:
        assert bridge.metrics is not None, "the app is built on a started bridge"
        return Response(bridge.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Json:
        info = bridge.info
        assert info is not None, "the app is built on a started bridge"
        return {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "kvscope",
                    "max_model_len": bridge.max_model_len,
                    "root": info.source,
                }
            ],
        }

    # ---- generation ------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        return await generate(
            "chat", _planned(lambda: chat_plan(body, bridge.max_model_len)), body.stream, request
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await generate(
            "completion", _planned(lambda: completion_plan(body, bridge.max_model_len)), body.stream, request
        )

    async def echo(prompt: Prompt, plan: Plan) -> EchoedPrompt:
        """A completion prompt as echo returns it: its text and, with logprobs, its tokens scored."""
        top = -1 if plan.top_logprobs is None else plan.top_logprobs
        try:
            ids, text, score = await bridge.score_prompt(
                prompt.token_ids, top, _capacity_check(plan, "prompt")
            )
        except InspectionError as exc:
            raise ServeError(str(exc), "prompt", "invalid_value") from exc
        if prompt.text is not None:
            text = prompt.text  # the prompt as given, not as its tokens decode
        entries: list[CompletionEntry] = []
        if score is not None:
            offset = 0
            for token in score.tokens:
                piece = strings.text_of(token.token_id)
                top_map = None
                if token.top is not None:
                    top_map = {strings.text_of(i): lp for i, lp in zip(token.top.ids, token.top_logprobs)}
                entries.append((piece, token.logprob, top_map, offset))
                offset += len(piece)
        return EchoedPrompt(text, tuple(entries), len(ids))

    async def generate(kind: str, plan: Plan, stream: bool, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        channel = Channel(loop)
        started: list[Started] = []
        echoed = [await echo(prompt, plan) for prompt in plan.prompts] if plan.echo else []
        if plan.score_only:
            return JSONResponse(Reply(kind, plan, [], strings, model, echoed).body())
        try:
            for prompt in plan.prompts:
                check = _capacity_check(plan, "messages" if kind == "chat" else "prompt")
                started.append(
                    await bridge.start_request(prompt.token_ids, plan.sampling, channel, check, plan.tag)
                )
        except ServeError:
            _cancel(started)
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template refusing the messages
            _cancel(started)
            raise ServeError(_message_of(exc), "messages" if kind == "chat" else "prompt") from exc
        except BaseException:
            _cancel(started)
            raise
        reply = Reply(kind, plan, started, strings, model, echoed)
        try:
            first = await _opening(channel, reply)
        except BaseException:
            _cancel(started)
            raise
        if reply.error is not None and not any(c.text for c in reply.choices):
            _cancel(started)
            raise reply.error
        if stream:
            return StreamingResponse(
                _stream(channel, reply, first, started), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await _whole(channel, reply, first, started, request)

    async def _opening(channel: Channel, reply: Reply) -> list[Json]:
        """Waits for the engine's first word on every request (started, or failed: then the
        client gets a plain error status instead of a stream that breaks at once)."""
        chunks: list[Json] = []
        pending = set(reply.index_of)
        while pending and reply.error is None:
            events = await channel.get()
            for event in events:
                if isinstance(event, (RequestStarted, RequestFailed, RequestFinished)):
                    pending.discard(event.request_id)
            chunks.extend(reply.fold(events))
        return chunks

    async def _stream(
        channel: Channel, reply: Reply, first: list[Json], started: list[Started]
    ) -> AsyncIterator[bytes]:
        try:
            yield sse(reply.role_chunk() if reply.kind == "chat" else (reply.echo_chunk() or {"choices": []}))
            for chunk in first:
                yield sse(chunk)
            while not reply.done:
                for chunk in reply.fold(await channel.get()):
                    yield sse(chunk)
            if reply.error is not None:
                error = reply.error
                yield sse(
                    error_body(
                        error.message, ERROR_TYPES.get(error.status, "server_error"), error.param, error.code
                    )
                )
            elif reply.plan.include_usage:
                yield sse(reply.usage_chunk())
            yield sse("[DONE]")
        finally:
            # Normal end, or the client went away (the server cancels this generator): either
            # way the engine stops working for it, and its blocks are freed.
            _cancel(started)

    async def _whole(
        channel: Channel, reply: Reply, first: list[Json], started: list[Started], request: Request
    ) -> Response:
        try:
            checked = time.monotonic()
            while not reply.done:
                with contextlib.suppress(TimeoutError):
                    reply.fold(await asyncio.wait_for(channel.get(), DISCONNECT_POLL_S))
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nobody to answer; nginx's code for it
        finally:
            _cancel(started)
        if reply.error is not None:
            raise reply.error
        return JSONResponse(reply.body())

    def _cancel(started: list[Started]) -> None:
        for s in started:
            bridge.cancel(s.request_id)  # a no-op for a request that has ended
            bridge.release(s.request_id)

    def _capacity_check(plan: Plan, param: str) -> Callable[[LLMEngine, list[int]], None]:
        def check(core: LLMEngine, ids: list[int]) -> None:
            capacity_check(core, ids, plan, param)

        return check

    # ---- the events stream -----------------------------------------------------------------
    @app.get("/v1/kvscope/events")
    async def events(request: Request) -> Response:
        loop = asyncio.get_running_loop()
        hello = {
            "server": "kvscope",
            "model": model,
            "t": time.perf_counter(),
            "block_size": bridge.config.block_size,
        }
        channel = await bridge.subscribe(loop)

        async def body() -> AsyncIterator[bytes]:
            try:
                yield sse(hello, "hello")
                while True:
                    try:
                        items = await asyncio.wait_for(channel.get(), KEEPALIVE_S)
                    except TimeoutError:
                        yield b": keepalive\n\n"
                        continue
                    except ChannelOverflow as exc:
                        yield sse({"message": f"{exc}: reconnect for a fresh snapshot"}, "overflow")
                        return
                    yield sse(codec.encode(items), "events")
            finally:
                bridge.unsubscribe(channel)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    return app


def _message_of(exc: Exception) -> str:
    return (
        str(exc)
        if isinstance(exc, (ConfigError, ValueError)) and str(exc)
        else f"{type(exc).__name__}: {exc}"
    )


def _planned(make: Callable[[], Plan]) -> Plan:
    try:
        return make()
    except ConfigError as exc:
        raise ServeError(str(exc)) from exc


def capacity_check(core: LLMEngine, ids: list[int], plan: Plan, param: str) -> None:
    """Refuse what the model's context or the KV pool can never hold (before it starts), with the
    engine's own reason (engine.limits) in OpenAI's error shape."""
    given = plan.sampling.max_new_tokens if plan.max_tokens_given else None
    refusal = core.limits.refusal(len(ids), given, plan.sampling.group_size)
    if refusal is None:
        return
    code = {"empty": "invalid_value", "context": "context_length_exceeded", "pool": "kv_cache_too_small"}
    raise ServeError(refusal.message, "max_tokens" if refusal.new_tokens else param, code[refusal.limit])
