"""What a caller submits to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import ConfigError, SamplingParams
from engine.events import ToolCall

ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required", "named")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    # An assistant turn's calls, and a tool turn's answer to one of them (its id and the tool).
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"chat role must be one of {', '.join(ROLES)}, got {self.role!r}")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.tool_calls and self.role != "assistant":
            raise ConfigError("only an assistant message carries tool calls")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call: its name, what it does, and its arguments' JSON Schema
    (as JSON text, so a request stays hashable)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "_-." for c in self.name) or len(self.name) > 64:
            raise ConfigError(f"a tool name is 1-64 letters, digits, '_', '-' or '.', got {self.name!r:.80}")


@dataclass(frozen=True, slots=True)
class Request:
    """A conversation to continue (rendered with the tokenizer's chat template) or raw token ids."""

    messages: tuple[ChatMessage, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Continue a reply that already has these tokens (a branch from a chosen token, a reply cut
    # off by a crash): they follow the chat template's generation prompt as part of the prompt,
    # so the prefix cache shares their blocks with the reply they came from. The request streams
    # only what comes after them.
    reply_prefix_ids: tuple[int, ...] = ()
    # Tools the model may call (rendered by the model's chat template, or already in the prompt
    # ids of a server's request; engine.tools reads the reply for calls). tool_choice: "auto"
    # (the model decides), "none" (no tools offered), "required" (at least one call) or "named"
    # (a call of `tool_name`): the last two are held to the call format by a grammar.
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"
    tool_name: str = ""
    parallel_tool_calls: bool = True
    # False: the engine thread makes no text for this request (TokenGenerated.text/text_delta
    # and RequestFinished.text stay empty); the caller detokenizes the token ids itself, off the
    # engine thread (the HTTP server does). Only for a request without stop strings and without
    # beam search, whose ends the engine must find in the text.
    detokenize: bool = True

    def __post_init__(self) -> None:
        if bool(self.messages) == bool(self.prompt_token_ids):
            raise ConfigError("a request needs either chat messages or prompt token ids (exactly one)")
        if self.reply_prefix_ids and not self.messages:
            raise ConfigError("a reply prefix continues a chat: it needs chat messages")
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.tool_choice not in TOOL_CHOICES:
            raise ConfigError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {self.tool_choice!r}"
            )
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ConfigError("two tools have the same name")
        if self.tool_choice == "named" and self.tool_name not in names:
            raise ConfigError(f"tool_choice names {self.tool_name!r}, which is not one of the tools")
        if self.tool_choice in ("required", "named") and not self.tools:
            raise ConfigError(f"tool_choice {self.tool_choice!r} needs tools")
        if not self.detokenize and (self.sampling.stop or self.sampling.beam_search):
            raise ConfigError("stop strings and beam search need the engine's own detokenizer")

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @staticmethod
    def chat(
        user: str,
        system: str | None = None,
        history: tuple[ChatMessage, ...] = (),
        sampling: SamplingParams | None = None,
        **sampling_fields: Any,
    ) -> Request:
        """A user turn after `history`, optionally under a system prompt. Sampling is either a
        SamplingParams or its fields as keywords."""
        msgs = (
            ((ChatMessage("system", system),) if system else ())
            + tuple(history)
            + (ChatMessage("user", user),)
        )
        return Request(messages=msgs, sampling=sampling or SamplingParams(**sampling_fields))
