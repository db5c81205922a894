"""HTTP pieces of the remote client: OpenAI-shaped errors, server-sent events, request bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from app.remote.target import RemoteSource
from engine.request import Request

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
        "messages": [{"role": m.role, "content": m.content} for m in request.messages],
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
