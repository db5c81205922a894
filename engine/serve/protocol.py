"""The OpenAI request bodies the server accepts (pydantic), and OpenAI's error shape.

Fields OpenAI and vLLM clients send are accepted by name; the range checks that are the engine's
(temperature, penalties, n with greedy...) stay in `SamplingParams`, whose messages become the
400s, so the server and the engine can never disagree on what is valid. Unknown fields are
ignored, as vLLM and OpenAI-compatible servers generally do; fields the engine cannot honour
(tools, non-text content, ...) are refused with a 400 naming them.
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


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None


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


class ChatRequest(SamplingFields):
    messages: list[MessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
