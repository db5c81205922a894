"""The OpenAI request bodies the server accepts (pydantic), and OpenAI's error shape.

Fields OpenAI and vLLM clients send are accepted by name; the range checks that are the engine's
(temperature, penalties, n with greedy...) stay in `SamplingParams`, whose messages become the
400s, so the server and the engine can never disagree on what is valid. Unknown fields are
ignored, as vLLM and OpenAI-compatible servers generally do; fields the engine cannot honour
(non-text content, ...) are refused with a 400 naming them. Structured output and tools
(`response_format`, vLLM's `guided_*`, `tools`, `tool_choice`) are typed here and turned into the
engine's grammar and tools by engine.serve.structured.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI's API returns it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class KvscopeOptions(BaseModel):
    """kvscope's own extension object (`"kvscope": {...}` in the body), used by an attached app."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    tag: str | None = Field(None, max_length=200)  # echoed on /v1/kvscope/events (RequestTagged)
    snapshot_top_n: int = Field(0, ge=0, le=256)  # per-token stage snapshots with this many candidates
    reply_prefix_ids: list[int] = Field(default_factory=list)  # continue a reply from these tokens
    num_beams: int = Field(1, ge=1)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients an object


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionIn


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: a call of that function."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    # "schema" as OpenAI names it (an alias: pydantic's BaseModel has a .schema of its own)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    # Taken and not needed: the schema is always held by the grammar, strict or not (OpenAI's
    # non-strict mode only asks the model to follow it).
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or JSON valid under a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """What chat and completions share. NaN and infinities are refused (Python's JSON reader
    takes them, and a NaN temperature would pass every range check)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    kvscope: KvscopeOptions | None = None
    # vLLM's guided decoding names (one at most; chat's response_format is the OpenAI way)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatRequest(SamplingFields):
    messages: list[MessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
