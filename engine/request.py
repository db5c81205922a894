"""What a caller submits to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import ConfigError, SamplingParams

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"chat role must be one of {', '.join(ROLES)}, got {self.role!r}")


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
        if not self.detokenize and (self.sampling.stop or self.sampling.beam_search):
            raise ConfigError("stop strings and beam search need the engine's own detokenizer")

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
