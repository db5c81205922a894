"""A conversation with tools as the model's chat template takes it.

transformers renders `tools` (and assistant calls and tool results) through the template the
model ships, in its family's format, which this module reads off the template. A template that
ignores tools (SmolLM2's, most small models') gets them described in the system prompt in the
Hermes format, calls written back into the assistant's turns and results given as
<tool_response> blocks in a user turn; the note says so, as for a merged system prompt.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.request import ChatMessage, Request, ToolSpec
from engine.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat, format_named

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
_PROBE_TOOL = "kvscope_probe_tool"
NOTE_TOOLS_IN_PROMPT = (
    "This model's chat template does not render tools: kvscope describes them in the system prompt "
    "and reads calls in the Hermes <tool_call> format."
)


@dataclass(frozen=True, slots=True)
class ToolTemplate:
    """What a tokenizer's chat template does with tools."""

    format: ToolFormat
    native: bool  # the template renders tools, calls and results itself
    note: str = ""  # what kvscope does instead, for the user


_templates: weakref.WeakKeyDictionary[Any, tuple[str, ToolTemplate]] = weakref.WeakKeyDictionary()


def hf_tool(tool: ToolSpec) -> dict[str, Any]:
    """A tool as transformers' chat templates take it (OpenAI's function shape)."""
    try:
        parameters = json.loads(tool.parameters)
    except json.JSONDecodeError:
        parameters = {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": parameters},
    }


def tool_template(tokenizer: PreTrainedTokenizerBase) -> ToolTemplate:
    """Read once per tokenizer (and template): does it render tools, and in which format."""
    source = str(getattr(tokenizer, "chat_template", None) or "")
    cached = _templates.get(tokenizer)
    if cached is not None and cached[0] == source:
        return cached[1]
    native = False
    if source:
        probe = [{"role": "user", "content": "hi"}]
        try:
            rendered = tokenizer.apply_chat_template(
                probe,
                tools=[hf_tool(ToolSpec(_PROBE_TOOL, "probe"))],
                tokenize=False,
                add_generation_prompt=True,
            )
            native = _PROBE_TOOL in str(rendered)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            native = False
    if not native:
        found = ToolTemplate(format_named(HERMES), False, NOTE_TOOLS_IN_PROMPT)
    elif "[TOOL_CALLS]" in source:
        found = ToolTemplate(format_named(MISTRAL, _special_id(tokenizer, "[TOOL_CALLS]")), True)
    elif "<tool_call>" in source:
        found = ToolTemplate(format_named(HERMES), True)
    elif "<|python_tag|>" in source or '"parameters"' in source or "parameters" in source:
        found = ToolTemplate(format_named(LLAMA3_JSON), True)
    else:
        found = ToolTemplate(
            format_named(HERMES),
            True,
            "This model's chat template renders tools in a format kvscope does not know: "
            "calls are read in the Hermes <tool_call> format.",
        )
    with contextlib.suppress(TypeError):  # a tokenizer stand-in without weak references: not cached
        _templates[tokenizer] = (source, found)
    return found


def _special_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    """The id of `text` when the tokenizer has it as one special token, else None."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for token_id, token in decoder.items():
        if str(token) == text and getattr(token, "special", False):
            return int(token_id)
    return None


def hermes_system_prompt(tools: tuple[ToolSpec, ...]) -> str:
    """The tools described the way Hermes-format models are prompted with them."""
    listed = "\n".join(json.dumps(hf_tool(t), ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help with the user's request. These are the functions, as JSON "
        f"Schemas:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, answer with one JSON object per call, each inside <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n'
        "The results come back inside <tool_response></tool_response> tags."
    )


def _arguments(call_arguments: str) -> Any:
    try:
        return json.loads(call_arguments or "{}")
    except json.JSONDecodeError:
        return call_arguments


def _native(message: ChatMessage) -> Message:
    out: Message = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out


def _written(
    messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...], fmt: ToolFormat
) -> list[Message]:
    """Without the template's help: tools in the system prompt, calls in the assistant's text,
    results as <tool_response> blocks in a user turn."""
    described = hermes_system_prompt(tools) if tools else ""
    first_system = next((i for i, m in enumerate(messages) if m.role == "system"), None)
    out: list[Message] = []
    if described and first_system is None:
        out.append({"role": "system", "content": described})
    responses: list[str] = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            responses.append(f"<tool_response>\n{message.content}\n</tool_response>")
            continue
        if responses:
            out.append({"role": "user", "content": "\n".join(responses)})
            responses = []
        content = message.content
        if i == first_system and described:
            content = f"{content}\n\n{described}" if content else described
        if message.tool_calls:
            written = "\n".join(fmt.write_call(c) for c in message.tool_calls)
            content = f"{content}\n{written}" if content else written
        out.append({"role": message.role, "content": content})
    if responses:
        out.append({"role": "user", "content": "\n".join(responses)})
    return out


def conversation(
    tokenizer: PreTrainedTokenizerBase, request: Request
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The request's messages as the template takes them, and the `tools` it is given (None
    when the tools are written into the messages, or there are none)."""
    has_tool_turns = any(m.role == "tool" or m.tool_calls for m in request.messages)
    if not request.offers_tools and not has_tool_turns:
        return [{"role": m.role, "content": m.content} for m in request.messages], None
    template = tool_template(tokenizer)
    offered = request.tools if request.offers_tools else ()
    if template.native:
        tools = [hf_tool(t) for t in offered] or None
        return [_native(m) for m in request.messages], tools
    return _written(request.messages, offered, template.format), None
