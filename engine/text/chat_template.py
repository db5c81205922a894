"""A conversation into prompt token ids, with the chat template the tokenizer ships.

Three cases, each said to the user rather than hidden:
- the template takes every role: it is used as is;
- the template has no system role (Gemma 1/2 raise "System role not supported"; some templates
  drop the message silently): the system prompt goes at the start of the first user message,
  separated by a blank line, the way Gemma's model card and Mistral's own newer templates do it;
- the tokenizer has no chat template at all (a base model): the conversation goes as plain text,
  "User: ... / Assistant:" turns after the system prompt, so the model continues the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2.exceptions import TemplateError

from engine.tools.render import conversation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.request import Request

Message = dict[str, Any]  # {"role": ..., "content": ..., maybe tool_calls}, as chat templates take them

NOTE_SYSTEM_MERGED = (
    "This model's chat template has no system role: the system prompt is put at the start of the "
    "first user message, as Gemma and Mistral document."
)
NOTE_PLAIN_TEXT = (
    "This model has no chat template (a base model?): the conversation is sent as plain text, "
    "'User:' and 'Assistant:' turns, and the model continues it."
)
_PROBE_SYSTEM = "kvscope-probe-system-prompt"


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    ids: list[int]
    text: str  # the rendered prompt (before any reply prefix)
    note: str = ""  # what kvscope changed about the conversation, for the user; "" when nothing


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]] | None = None
) -> str:
    given: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools else None
    text = tokenizer.apply_chat_template(messages, tools=given, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str), "a template applied with tokenize=False renders text"
    return text


def merge_system(messages: list[Message]) -> list[Message]:
    """The system messages folded into the first user message (or one made for them)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if not system:
        return rest
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            return rest
    return [{"role": "user", "content": system}, *rest]


def plain_text(messages: list[Message]) -> str:
    lines = []
    speaker = {"user": "User", "assistant": "Assistant", "tool": "Tool"}
    for m in messages:
        if m["role"] == "system":
            lines.append(m["content"])
        else:
            lines.append(f"{speaker.get(m['role'], 'User')}: {m['content']}")
    lines.append("Assistant:")
    return "\n".join(lines)


class ChatTemplateError(ValueError):
    """The model's template refuses the conversation even with the system prompt merged."""


def _render_or_refuse(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]] | None = None
) -> str:
    try:
        return _render(tokenizer, messages, tools)
    except TemplateError as exc:
        raise ChatTemplateError(f"The model's chat template refuses this conversation: {exc}") from None


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]] | None = None
) -> ChatPrompt:
    """`messages` ({'role', 'content'} dicts) as the model's prompt, ending where its reply starts;
    `tools` (OpenAI's function shape) for a template that renders them."""

    if not has_chat_template(tokenizer):
        text = plain_text(messages)
        # No template adds BOS for us: the tokenizer's own special tokens do.
        return ChatPrompt(list(tokenizer(text)["input_ids"]), text, NOTE_PLAIN_TEXT)
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    note = ""
    try:
        text = _render(tokenizer, messages, tools)
        merge = any(s not in text for s in system)  # the template dropped the system prompt
    except TemplateError as exc:
        if not system:
            raise ChatTemplateError(f"The model's chat template refuses this conversation: {exc}") from None
        merge = True  # "System role not supported" (Gemma), "roles must alternate" (Mistral v0.1)
    if merge:
        text, note = _render_or_refuse(tokenizer, merge_system(messages), tools), NOTE_SYSTEM_MERGED
    # The template wrote the special tokens (BOS...) itself: the tokenizer must not add more.
    return ChatPrompt(list(tokenizer(text, add_special_tokens=False)["input_ids"]), text, note)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, request: Request) -> list[int]:
    """The token ids of a Request: its own ids, or its conversation rendered, then its reply prefix."""
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    messages, tools = conversation(tokenizer, request)
    return render_chat(tokenizer, messages, tools).ids + list(request.reply_prefix_ids)


def chat_note(tokenizer: PreTrainedTokenizerBase) -> str:
    """What kvscope does to this tokenizer's conversations, said once when the model loads."""
    if not has_chat_template(tokenizer):
        return NOTE_PLAIN_TEXT
    probe = [{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": "hi"}]
    try:
        return render_chat(tokenizer, probe).note
    except ChatTemplateError:  # a template that fails even this is reported per request
        return ""


def message_spans(
    tokenizer: PreTrainedTokenizerBase, request: Request, role: str = "tool"
) -> list[tuple[int, int]]:
    """Where the content of each `role` message of the request sits in its prompt, as token
    positions [start, end): found in the rendered text in order, mapped through the tokenizer's
    offsets. (-1, -1) for one the template left out (or wrote differently)."""
    messages, tools = conversation(tokenizer, request)
    prompt = render_chat(tokenizer, messages, tools)
    encoded = tokenizer(
        prompt.text, add_special_tokens=not has_chat_template(tokenizer), return_offsets_mapping=True
    )
    offsets = [tuple(o) for o in encoded["offset_mapping"]]
    spans: list[tuple[int, int]] = []
    cursor = 0
    for message in request.messages:
        if message.role != role:
            continue
        at = prompt.text.find(message.content, cursor) if message.content else -1
        if at < 0:
            spans.append((-1, -1))
            continue
        end_char = at + len(message.content)
        cursor = end_char
        tokens = [i for i, (a, b) in enumerate(offsets) if b > at and a < end_char and b > a]
        spans.append((tokens[0], tokens[-1] + 1) if tokens else (-1, -1))
    return spans
