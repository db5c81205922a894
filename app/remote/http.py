"""HTTP pieces of the remote client: OpenAI-shaped errors, server-sent events, request bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from app.remote.target import RemoteSource
from engine.config import GrammarSpec
from engine.request import ChatMessage, Request, ToolSpec

MAX_TOP_LOGPROBS = 20  # what OpenAI's API allows (and vLLM by default)


class RemoteError(RuntimeError):
    """Something the server said or did, in one line for the user."""


def error_message(response: httpx.Response, body: bytes) -> str:
    """The server's own words from an OpenAI-shaped error (or its status and text)."""
    try:
        data = json.loads(body)
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message") if isinstance(error, dict) else str(error)
        if isinstance(message, str) and message:
            return message
        detail = data.get("detail") if isinstance(data, dict) else None
        if detail:
            return str(detail)
    except (ValueError, AttributeError):
        pass
    text = body.decode("utf-8", "replace").strip()[:200]
    return f"HTTP {response.status_code}{': ' + text if text else ''}"


async def sse_messages(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """(event, data) per server-sent event; event is "" when the server names none."""
    event, data = "", []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield event, "\n".join(data)


def request_body(source: RemoteSource, request: Request, tag: str | None, logprobs_refused: bool) -> dict:
    """A streamed chat completion for `request`. With a `tag` (a kvscope server) the kvscope
    extension carries what only its engine does: stage snapshots, beams, a reply prefix."""
    p = request.sampling
    server = source.server_name
    if not tag:
        if p.beam_search:
            raise RemoteError(
                f"beam search runs on kvscope's own engine; {server} takes no beam search over its API"
            )
        if request.reply_prefix_ids:
            raise RemoteError(
                f"continuing a reply from a chosen token needs token ids, which {server} does not report"
            )
    body: dict = {
        "model": source.model,
        "messages": [openai_message(m) for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "n": p.n,
    }
    optional = {
        "seed": p.seed,
        "stop": list(p.stop) or None,
        # not OpenAI's, but vLLM, SGLang, llama.cpp and kvscope take them
        "top_k": p.top_k or None,
        "min_p": p.min_p or None,
        "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        "ignore_eos": p.ignore_eos or None,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if p.grammar is not None:
        body.update(structured_fields(p.grammar))
    if request.offers_tools:
        body["tools"] = [openai_tool(t) for t in request.tools]
        body["parallel_tool_calls"] = request.parallel_tool_calls
        body["tool_choice"] = (
            {"type": "function", "function": {"name": request.tool_name}}
            if request.tool_choice == "named"
            else request.tool_choice
        )
    if tag:
        body["kvscope"] = {
            "tag": tag,
            "snapshot_top_n": p.snapshot_top_n,
            "num_beams": p.num_beams,
            "length_penalty": p.length_penalty,
            "early_stopping": p.early_stopping,
            "reply_prefix_ids": list(request.reply_prefix_ids),
        }
    elif not logprobs_refused:
        # the probability panel's bars, and each token's boundary and logprob
        body.update(logprobs=True, top_logprobs=min(p.snapshot_top_n, MAX_TOP_LOGPROBS))
    return body


def structured_fields(grammar: GrammarSpec) -> dict:
    """A chat's structured output as OpenAI's response_format, or vLLM's guided_* for what
    OpenAI has no name for (kvscope's server takes both)."""
    if grammar.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if grammar.kind == "json_schema":
        schema = json.loads(grammar.text)
        return {
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
        }
    if grammar.kind == "regex":
        return {"guided_regex": grammar.text}
    if grammar.kind == "choice":
        return {"guided_choice": json.loads(grammar.text)}
    return {"guided_grammar": grammar.text}


def openai_tool(tool: ToolSpec) -> dict:
    try:
        parameters = json.loads(tool.parameters)
    except ValueError:
        parameters = {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": parameters},
    }


def openai_message(message: ChatMessage) -> dict:
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["content"] = message.content or None
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out
