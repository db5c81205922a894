"""The engine's answers to engine.api's named questions, computed between two steps on the engine
thread (engine.core.service.Engine runs each through its command queue). Each takes the
synchronous engine first; headless callers (tests, the CLI) may call them on it directly."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.llm_engine import LLMEngine
from engine.limits import ContextFit, fit
from engine.measure import device_limits as measured_limits
from engine.measure.memory import available_memory_bytes, device_name
from engine.request import ChatMessage, Request, ToolSpec
from engine.results import DeviceLimits, DeviceStatus
from engine.text.chat_template import message_spans


def count_prompt(core: LLMEngine, request: Request) -> int:
    """Tokens of the request's prompt, as the engine renders it (its chat template)."""
    return len(core.prompt_ids(request))


def prompt_spans(core: LLMEngine, request: Request) -> tuple[tuple[int, int], ...]:
    """Token positions [start, end) of each tool message's content in the request's prompt."""
    return tuple(message_spans(core.tokenizer, request))


def fit_context(
    core: LLMEngine,
    head: Sequence[ChatMessage],
    history: Sequence[ChatMessage],
    tail: Sequence[ChatMessage],
    max_new_tokens: int,
    policy: str,
    prefix_ids: Sequence[int] = (),
    tail_is_new: bool = True,
    tools: Sequence[ToolSpec] = (),
) -> ContextFit:
    """engine.limits.fit with the engine's own prompt rendering and limits: the count is the one
    the engine will see. `prefix_ids` start the reply (a continued or branched one); `tools` are
    rendered as the reply's request will render them."""

    def count(messages: Sequence[ChatMessage]) -> int:
        if not messages:
            return len(prefix_ids)
        request = Request(messages=tuple(messages), reply_prefix_ids=tuple(prefix_ids), tools=tuple(tools))
        return count_prompt(core, request)

    limits = core.limits
    return fit(
        count,
        head,
        history,
        tail,
        limits.context_window,
        limits.pool_tokens,
        max_new_tokens,
        policy,
        tail_is_new,
    )


def device(core: LLMEngine) -> DeviceStatus:
    """The loaded model's device and the memory left on it now."""
    where = core.loaded.device
    return DeviceStatus(str(where), device_name(where), available_memory_bytes(where))


def device_limits(core: LLMEngine, refresh: bool = False) -> DeviceLimits:
    """The loaded model's device's roofs in its dtype, read from their cache or measured (no
    reply runs on the device meanwhile: this is the engine thread)."""
    return measured_limits.load_or_measure(core.loaded.device, core.loaded.info.dtype, refresh=refresh)
