"""The HTTP layer: OpenAI's routes over one `EngineBridge`. It only translates: a request body
becomes engine requests (engine.serve.params), their events become chunks or a body
(engine.serve.replies); everything else is the engine's.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, GET /v1/kvscope/events, GET /openapi.json (the schema of them all, with every
status each can answer; `./dev fuzz` holds the server to it). With an API key, every route but
a plain GET /health needs `Authorization: Bearer KEY` (engine.serve.guards).

A generation request goes: checked against the served model's bounds (engine.serve.params),
admitted to the bounded queue (429 past it), tokenized on the prompt pool, checked against the
context and the KV pool, then started on the engine thread. Its text is made here, from the
token ids, unless the engine must make it (stop strings, beam search).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import ConfigError
from engine.errors import InspectionError
from engine.events import RequestFailed, RequestFinished, RequestStarted, TokenGenerated
from engine.serve import codec
from engine.serve.bridge import DEFAULT_MAX_BODY_BYTES, EngineBridge, Started
from engine.serve.channel import Channel, ChannelOverflow
from engine.serve.errors import ServeError
from engine.serve.guards import error_response, install
from engine.serve.logprobs import TokenStrings
from engine.serve.params import Plan, Prompt, chat_plan, completion_plan
from engine.serve.prompts import Overloaded
from engine.serve.protocol import ERROR_TYPES, ChatRequest, CompletionRequest, error_body
from engine.serve.replies import CompletionEntry, EchoedPrompt, Reply
from engine.serve.schema import GENERATION_RESPONSES, INFO_RESPONSES, served_openapi
from engine.text.chat_template import ChatTemplateError

if TYPE_CHECKING:
    from engine.serve.replies import Reply

Json = dict[str, Any]  # a chunk or body as it is serialised

# A non-streaming request checks this often whether its client is still there.
DISCONNECT_POLL_S = 0.5
# An idle events stream sends a comment this often so proxies and clients keep it open.
KEEPALIVE_S = 15.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Json | str, event: str | None = None) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def build_app(
    bridge: EngineBridge,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cors_origins: tuple[str, ...] = (),
) -> FastAPI:
    app = FastAPI(title="kvscope", version="1", docs_url=None, redoc_url=None)
    strings = TokenStrings(bridge.token_bytes)
    model = bridge.model_name
    bounds = bridge.bounds
    prompts = bridge.prompts
    tokenizer = bridge.tokenizer
    assert bounds is not None and prompts is not None, "the app is built on a started bridge"

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
        response = error_response(exc.status, exc.message, exc.param, exc.code)
        if isinstance(exc, Overloaded):
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    install(app, api_key, max_body_bytes, cors_origins)
    app.openapi = lambda: served_openapi(app, model, bounds)  # type: ignore[method-assign]

    def check_model(name: str | None) -> None:
        if name is not None and name != model:
            raise ServeError(
                f"The model `{name}` does not exist: this server serves `{model}`.",
                "model",
                "model_not_found",
                404,
            )

    # ---- information -----------------------------------------------------------------------
    @app.get("/health", responses=INFO_RESPONSES["health"])
    async def health() -> Response:
        if not bridge.engine.is_alive():
            return error_response(503, "the engine has stopped")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", responses=INFO_RESPONSES["metrics"], response_class=Response)
    async def metrics() -> Response:
        assert bridge.metrics is not None, "the app is built on a started bridge"
        return Response(bridge.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=INFO_RESPONSES["models"])
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
    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES["chat"], response_class=Response)
    async def chat(body: ChatRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        check_model(body.model)
        return await generate(
            "chat", _planned(lambda: chat_plan(body, bounds)), body.stream, request, arrival
        )

    @app.post("/v1/completions", responses=GENERATION_RESPONSES["completion"], response_class=Response)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        check_model(body.model)
        return await generate(
            "completion", _planned(lambda: completion_plan(body, bounds)), body.stream, request, arrival
        )

    async def echo(prompt: Prompt, ids: list[int], plan: Plan) -> EchoedPrompt:
        """A completion prompt as echo returns it: its text and, with logprobs, its tokens scored."""
        top = -1 if plan.top_logprobs is None else plan.top_logprobs
        try:
            text, score = await bridge.score_prompt(ids, top)
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

    async def _prompt_ids(kind: str, plan: Plan) -> list[list[int]]:
        """Every prompt of the plan as checked token ids, tokenized on the prompt pool."""
        param = "messages" if kind == "chat" else "prompt"
        out = []
        for prompt in plan.prompts:
            try:
                ids = await prompts.token_ids(prompt)
            except ChatTemplateError as exc:
                raise ServeError(str(exc), param, "unprocessable_messages", 422) from exc
            except Exception as exc:  # noqa: BLE001 - a tokenizer refusing the text
                raise ServeError(_message_of(exc), param, "invalid_value") from exc
            capacity_check(bridge, ids, plan, param)
            out.append(ids)
        return out

    async def generate(kind: str, plan: Plan, stream: bool, request: Request, arrival: float) -> Response:
        loop = asyncio.get_running_loop()
        channel = Channel(loop)
        started: list[Started] = []
        places = len(plan.prompts)
        prompts.admit(places)  # 429 when the waiting queue is full
        echoed: list[EchoedPrompt] = []
        try:
            prompt_ids = await _prompt_ids(kind, plan)
            if plan.echo:
                echoed = [await echo(p, ids, plan) for p, ids in zip(plan.prompts, prompt_ids, strict=True)]
            if plan.score_only:  # max_tokens 0: the prompts scored, nothing generated
                return JSONResponse(Reply(kind, plan, [], strings, model, echoed).body())
            for ids in prompt_ids:
                started.append(
                    await bridge.start_request(
                        ids,
                        plan.sampling,
                        channel,
                        plan.tag,
                        arrival,
                        detokenize=plan.engine_text,
                        tools=plan.tools,
                    )
                )
        except BaseException:
            _cancel(started)
            raise
        finally:
            prompts.leave(places)
        tokenizer_here = None if plan.engine_text else tokenizer
        reply = Reply(
            kind,
            plan,
            started,
            strings,
            model,
            echoed,
            tokenizer_here,
            tool_format=bridge.tool_format,
            cancel=bridge.cancel,  # a request whose every choice met a stop string the server found
        )
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

    # ---- the events stream -----------------------------------------------------------------
    @app.get("/v1/kvscope/events", responses=INFO_RESPONSES["events"], response_class=Response)
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
                    yield sse(codec.encode(_with_token_text(items, strings)), "events")
            finally:
                bridge.unsubscribe(channel)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    return app


def _with_token_text(items: list[object], strings: TokenStrings) -> list[object]:
    """Requests the server detokenizes itself (untagged, without stop strings) come from the
    engine without text: their tokens get theirs here, from the vocabulary's table, and their
    RequestFinished carries token ids with an empty text (the client's own reply has it)."""
    return [
        dataclasses.replace(e, text=strings.text_of(e.token_id))
        if isinstance(e, TokenGenerated) and not e.text
        else e
        for e in items
    ]


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


def capacity_check(bridge: EngineBridge, ids: list[int], plan: Plan, param: str) -> None:
    """Refuse what the model's context or the KV pool can never hold (before it starts), with the
    engine's own reason (engine.limits) in OpenAI's error shape. Off the engine thread: the
    limits are plain figures read when the server started."""
    assert bridge.limits is not None, "requests are served after start()"
    given = plan.sampling.max_new_tokens if plan.max_tokens_given else None
    refusal = bridge.limits.refusal(len(ids), given, plan.sampling.group_size)
    if refusal is None:
        return
    code = {"empty": "invalid_value", "context": "context_length_exceeded", "pool": "kv_cache_too_small"}
    raise ServeError(refusal.message, "max_tokens" if refusal.new_tokens else param, code[refusal.limit])
