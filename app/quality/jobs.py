"""What a quality run compares: the running engine's model spec and KV dtype, and a text (the
current conversation or the evaluation text shipped with the engine).

When the conversation ends with a reply of the running engine, the job carries that reply's exact
generated token ids (not a re-tokenization of its text) and each token's snapshot candidates, so
the run can give the probability panel the reference distribution at every reply token.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.workers import UserFacingError
from engine.config import ModelSpec
from engine.request import ChatMessage

EVAL_TEXT = "eval"
CONVERSATION = "conversation"
SPEED_TOKENS = 32  # greedy tokens each copy decodes for the speed figures
# (key, what the quality panel calls it)
QUALITY_SOURCES = (
    (CONVERSATION, "Current conversation"),
    (EVAL_TEXT, "Shipped evaluation text"),
)


class QualityUnavailable(UserFacingError):
    """The run cannot be done here (memory, a model that fails to load, too little text);
    the message says why, for the user."""


@dataclass(frozen=True, slots=True)
class ReplyTokens:
    """The reply at the end of a conversation, as the running engine generated it."""

    generation: int  # the host's engine generation: request ids restart with each engine
    request_id: int
    prompt_tokens: int  # what the engine counted; a different count means the prompt changed
    token_ids: tuple[int, ...]
    candidate_ids: tuple[tuple[int, ...], ...]  # per reply token: its snapshot's candidates


@dataclass(frozen=True, slots=True)
class QualityJob:
    spec: ModelSpec  # the engine's model, with its weight scheme
    kv_dtype: str
    source: str  # CONVERSATION or EVAL_TEXT
    messages: tuple[ChatMessage, ...] = ()  # CONVERSATION: the prompt (up to the reply, if any)
    reply: ReplyTokens | None = None
    speed_tokens: int = SPEED_TOKENS  # 0 skips the speed measurement


def job_for(source: str, host, controller) -> QualityJob:
    """The job for `source` (CONVERSATION or EVAL_TEXT) on the model the host's engine runs.
    Raises QualityUnavailable with the reason when there is nothing to compare yet."""
    if host.config is None or not host.status().ready:
        raise QualityUnavailable(
            "Load a model first: the run compares the running scheme with full precision."
        )
    spec, kv_dtype = host.config.model, host.config.kv_dtype
    if source == EVAL_TEXT:
        return QualityJob(spec, kv_dtype, EVAL_TEXT)
    if controller.active is not None:
        raise QualityUnavailable("Wait for the reply to finish (or stop it), then run the comparison.")
    conv = controller.conversation
    stored = [m for m in conv.messages if m.content] if conv is not None else []
    if not stored:
        raise QualityUnavailable(
            "The conversation is empty: send a message first, or use the evaluation text."
        )
    system = controller.pane.system_prompt.toPlainText().strip()
    head = (ChatMessage("system", system),) if system else ()
    reply = _engine_reply(host, controller)
    if reply is None:
        return QualityJob(
            spec, kv_dtype, CONVERSATION, head + tuple(ChatMessage(m.role, m.content) for m in stored)
        )
    # The prompt the engine was given: every earlier message (as the chat controller sends it).
    before = [m for m in conv.messages[:-1] if m.content]
    messages = head + tuple(ChatMessage(m.role, m.content) for m in before)
    return QualityJob(spec, kv_dtype, CONVERSATION, messages, reply)


def _engine_reply(host, controller) -> ReplyTokens | None:
    """The conversation's last message when it is a finished reply of the running engine."""
    conv, bubbles = controller.conversation, controller.pane.transcript.bubbles
    if not conv.messages or conv.messages[-1].role != "assistant" or len(bubbles) != len(conv.messages):
        return None
    request_id = bubbles[-1].request_id  # None once another engine has started
    view = host.live.requests.get(request_id) if request_id is not None else None
    if view is None or view.finished is None or not view.finished.token_ids:
        return None
    if len(conv.messages[-1].token_ids) > len(view.finished.token_ids):
        return None  # a branch or a continuation: its prompt held a prefix the tokens do not show
    by_index = {t.index: t for t in view.tokens}
    candidates = tuple(
        by_index[i].snapshot.candidate_ids if i in by_index and by_index[i].snapshot else ()
        for i in range(len(view.finished.token_ids))
    )
    return ReplyTokens(
        host.generation, request_id, view.prompt_tokens, tuple(view.finished.token_ids), candidates
    )
