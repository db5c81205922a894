"""The server's OpenAPI schema as it answers: every route's statuses, their bodies and content
types (JSON, or an SSE stream for `stream: true`), OpenAI's error object for every refusal.

FastAPI writes the request side from the pydantic bodies (engine.serve.protocol); the responses
are declared here, because the routes return ready-made responses that FastAPI never sees as
models. `served_openapi` then says what only the running server knows: the one model id it
accepts. `./dev fuzz` (Schemathesis) holds the server to this schema: no 5xx, every response
one the schema names, in the shape it gives.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessageOut(BaseModel):
    role: str
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Timings(BaseModel):
    """llama.cpp server's `timings` (engine.serve.replies.timings)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class ChatCompletion(BaseModel):
    id: str
    object: str = Field(json_schema_extra={"enum": ["chat.completion"]})
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: str = Field(json_schema_extra={"enum": ["text_completion"]})
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int
    root: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Health(BaseModel):
    status: str


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


SSE = {"text/event-stream": {"schema": {"type": "string"}}}
_KEY: dict[int | str, dict[str, Any]] = {
    401: _error("The API key is missing or wrong (a server started with --api-key).")
}
_GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("A parameter the server refuses, named in `error.param`; or a prompt too long."),
    **_KEY,
    404: _error("The model named is not the one this server serves."),
    413: _error("The body is larger than the server accepts (--max-body-bytes)."),
    422: _error("The model's chat template cannot render these messages."),
    429: {
        **_error("The waiting queue is full; retry after the Retry-After header's seconds."),
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
    },
    500: _error("The request failed inside the engine (it failed alone; other requests go on)."),
    503: _error("The server is shutting down."),
}


def _generation(body: type[BaseModel], what: str) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": body,
            "description": f"The {what} (with `stream: true`: SSE chunks, then [DONE]).",
            "content": SSE,
        },
        **_GENERATION_ERRORS,
    }


GENERATION_RESPONSES = {
    "chat": _generation(ChatCompletion, "chat completion"),
    "completion": _generation(Completion, "completion"),
}
INFO_RESPONSES: dict[str, dict[int | str, dict[str, Any]]] = {
    "health": {200: {"model": Health, "description": "The engine runs."}, 503: _error("The engine stopped.")},
    "metrics": {
        200: {
            "description": "Prometheus text, vLLM's metric names under kvscope:.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        **_KEY,
    },
    "models": {200: {"model": ModelList, "description": "The one model served."}, **_KEY},
    "events": {
        200: {"description": "The engine's own events, as SSE (never ends).", "content": SSE},
        **_KEY,
    },
}


def served_openapi(app: FastAPI, model: str) -> dict[str, Any]:
    """The schema, made once: the request bodies' `model` is the one id served (or absent)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("ChatRequest", "CompletionRequest"):
        props = components.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"] = {
                "anyOf": [{"type": "string", "enum": [model]}, {"type": "null"}],
                "title": "Model",
            }
    # The validation errors FastAPI would document as 422 are answered 400 here (OpenAI's way).
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    app.openapi_schema = schema
    return schema
