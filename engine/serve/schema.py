"""The server's OpenAPI schema as it answers: every route's statuses, their bodies and content
types (JSON, or an SSE stream for `stream: true`), OpenAI's error object for every refusal.

FastAPI writes the request side from the pydantic bodies (engine.serve.protocol); the responses
are declared here, because the routes return ready-made responses that FastAPI never sees as
models. `served_openapi` then writes into the request side the ranges the server checks (the
engine's SamplingParams and engine.serve.params keep checking them and give the messages) and
what only the running server knows: the one model id it accepts, the context, the vocabulary,
the batch. `./dev fuzz` (Schemathesis) holds the server to this schema: no 5xx, every response
one the schema names, in the shape it gives. (A few rules join two fields, such as n > 1 needing
a temperature above 0, or best_of equal to n; those stay in the 400s alone.)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from engine.config import LENGTH_PENALTY_LIMIT, MAX_TEMPERATURE, MIN_TEMPERATURE, PENALTY_RANGE
from engine.serve.logprobs import MAX_TOP_LOGPROBS
from engine.serve.params import MAX_STOP, MAX_STOP_CHARS, SEED_RANGE, Bounds


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
    # null for an echoed prompt's first token (nothing precedes it to predict it), as OpenAI's
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
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


# One server-sent event (OpenAPI 3.1 has no itemSchema: a stream's schema is each event's, as
# Schemathesis reads it). Generation streams send JSON chunks, an error object or "[DONE]" as data.
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}
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


Schema = dict[str, Any]


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _number(**bounds: float) -> Schema:
    return {"type": "number", **bounds}


def _request_rules(model: str, bounds: Bounds) -> dict[str, Schema]:
    """The properties the chat and completions bodies share, as the server checks them."""
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    tokens = {"type": "integer", "minimum": 1, "maximum": bounds.max_model_len}
    return {
        "model": _nullable({"type": "string", "enum": [model]}),
        "max_tokens": _nullable(tokens),
        "temperature": _nullable(
            {
                "anyOf": [
                    {"type": "number", "enum": [0]},
                    _number(minimum=MIN_TEMPERATURE, maximum=MAX_TEMPERATURE),
                ]
            }
        ),
        "top_p": _nullable(_number(exclusiveMinimum=0, maximum=1)),
        "top_k": _nullable({"type": "integer", "minimum": -1}),
        "min_p": _nullable(_number(minimum=0, exclusiveMaximum=1)),
        "presence_penalty": _nullable(_number(minimum=-2, maximum=2)),
        "frequency_penalty": _nullable(_number(minimum=-2, maximum=2)),
        "repetition_penalty": _nullable(_number(minimum=PENALTY_RANGE[0], maximum=PENALTY_RANGE[1])),
        "seed": _nullable({"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]}),
        "stop": _nullable(
            {"anyOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": MAX_STOP}]}
        ),
        "n": {"type": "integer", "minimum": 1, "maximum": bounds.max_num_seqs, "default": 1},
        "logit_bias": _nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": _number(minimum=-100, maximum=100),
            }
        ),
    }


def _token_ids(bounds: Bounds, min_items: int = 0) -> Schema:
    return {
        "type": "array",
        "minItems": min_items,
        "items": {"type": "integer", "minimum": 0, "maximum": bounds.vocab_size - 1},
    }


def _constrain(components: dict[str, Schema], model: str, bounds: Bounds) -> None:
    shared = _request_rules(model, bounds)
    tokens = {"type": "integer", "minimum": 1, "maximum": bounds.max_model_len}
    chat, completion = components["ChatRequest"]["properties"], components["CompletionRequest"]["properties"]
    chat.update(shared)
    completion.update(shared)
    chat["max_completion_tokens"] = _nullable(tokens)
    chat["top_logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    completion["logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    completion["suffix"] = _nullable({"type": "string", "maxLength": 0})
    completion["prompt"] = {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "maxItems": bounds.max_prompts, "items": {"type": "string"}},
            _token_ids(bounds, 1),
            {"type": "array", "minItems": 1, "maxItems": bounds.max_prompts, "items": _token_ids(bounds, 1)},
        ]
    }
    components["MessageIn"]["properties"]["role"] = {
        "type": "string",
        "enum": ["system", "user", "assistant", "developer", "tool"],
    }
    components["TextPart"]["properties"]["type"] = {"type": "string", "enum": ["text"]}
    components["TextPart"]["properties"]["text"] = {"type": "string"}
    components["TextPart"]["required"] = ["type", "text"]
    options = components["KvscopeOptions"]["properties"]
    options["reply_prefix_ids"] = _token_ids(bounds)
    options["num_beams"] = {"type": "integer", "minimum": 1, "maximum": bounds.max_num_seqs, "default": 1}
    options["length_penalty"] = _number(
        minimum=-LENGTH_PENALTY_LIMIT, maximum=LENGTH_PENALTY_LIMIT, default=1.0
    )


def served_openapi(app: FastAPI, model: str, bounds: Bounds) -> dict[str, Any]:
    """The schema, made once, with the request rules of this server (see the module doc)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.get("components", {}).get("schemas", {})
    _constrain(components, model, bounds)
    # The validation errors FastAPI would document as 422 are answered 400 here (OpenAI's way).
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    app.openapi_schema = schema
    return schema
