"""A request's tools while the engine runs it: the format its reply is read in, the grammar
that holds a required call to that format, and the reply read back into calls at its end."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import GrammarSpec
from engine.events import ToolCallsParsed
from engine.request import Request, ToolSpec
from engine.tools.formats import MISTRAL, ToolFormat
from engine.tools.render import tool_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ToolUseError(ValueError):
    """Tools asked for in a way that cannot hold; the message is for the user."""


@dataclass(frozen=True, slots=True)
class ToolUse:
    format: ToolFormat
    tools: tuple[ToolSpec, ...]
    constrained: bool  # a grammar holds the reply to calls (tool_choice required or named)


def tool_use(
    tokenizer: PreTrainedTokenizerBase, request: Request, grammar: GrammarSpec | None
) -> tuple[ToolUse | None, GrammarSpec | None]:
    """The request's tool use and the grammar its reply runs under: with tool_choice required
    or named, the calls' own (one call of that tool, or of any; several with parallel calls);
    with auto under a JSON response format, the calls or an answer in that schema."""
    if not request.offers_tools:
        return None, grammar
    fmt = tool_template(tokenizer).format
    tools = request.tools
    if request.tool_choice in ("required", "named"):
        if grammar is not None:
            raise ToolUseError(
                f"tool_choice {request.tool_choice!r} holds the reply to tool calls: it cannot also "
                f"follow a {grammar.label}"
            )
        chosen = (
            tuple(t for t in tools if t.name == request.tool_name)
            if request.tool_choice == "named"
            else tools
        )
        parallel = request.parallel_tool_calls and request.tool_choice == "required"
        return ToolUse(fmt, tools, True), GrammarSpec("lark", fmt.grammar(chosen, parallel))
    if grammar is None:
        return ToolUse(fmt, tools, False), None
    if grammar.kind not in ("json_schema", "json_object"):
        raise ToolUseError(
            f"tools with tool_choice 'auto' combine only with a JSON response format, not a {grammar.label}"
        )
    schema: dict[str, Any] = json.loads(grammar.text) if grammar.kind == "json_schema" else {"type": "object"}
    text = fmt.grammar(tools, request.parallel_tool_calls, answer_schema=schema)
    return ToolUse(fmt, tools, False), GrammarSpec("lark", text)


def _without_eos(token_ids: Sequence[int], eos_ids: set[int]) -> list[int]:
    ids = list(token_ids)
    while ids and ids[-1] in eos_ids:
        ids.pop()
    return ids


def _token_at(tokenizer: PreTrainedTokenizerBase, ids: list[int], chars: int, specials: bool) -> int:
    """The number of leading tokens whose text is shorter than `chars` characters (where a
    character offset falls in the reply's tokens)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=not specials)) <= chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


def parsed(
    use: ToolUse,
    tokenizer: PreTrainedTokenizerBase,
    request_id: int,
    token_ids: Sequence[int],
    eos_ids: set[int],
    branch: int = 0,
) -> ToolCallsParsed:
    """The reply `token_ids` read for calls in the request's format."""
    ids = _without_eos(token_ids, eos_ids)
    specials = use.format.name == MISTRAL  # its [TOOL_CALLS] is a special token
    text = tokenizer.decode(ids, skip_special_tokens=not specials)
    assert isinstance(text, str)
    reply = use.format.parse(text, use.tools)
    start = end = 0
    if reply.raw:
        start = _token_at(tokenizer, ids, reply.start, specials)
        end = min(len(ids), _token_at(tokenizer, ids, reply.end - 1, specials) + 1)
    return ToolCallsParsed(
        request_id,
        use.format.name,
        reply.content,
        reply.calls,
        reply.raw,
        start,
        end,
        reply.error,
        branch,
        time.perf_counter(),
    )
