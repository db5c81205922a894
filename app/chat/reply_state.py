"""What the chat controller keeps about replies: the ones made in this session (their tokens, for
the token view and the probability panel), the one streaming now, and the plan of one about to
start (while the engine measures it against the context limit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.chat.bubble import MessageBubble
from app.chat.conversations import ReplyCheckpoint, StoredMessage
from app.chat.group_reply_view import GroupReplyCard
from app.chat.rich_text import ReplyToken
from app.chat.tool_turns import expand
from engine.config import SamplingParams
from engine.events import RequestStats, ToolCallsParsed
from engine.request import ChatMessage

# What starts a reply: a sent message, a new version of a reply (regenerate), a reply cut at a
# token with another candidate put there (branch), more of an existing reply (continue), or the
# reply that reads the results of a reply's tool calls (tool_results: it answers that reply).
PLAN_KINDS = ("send", "regenerate", "branch", "continue", "tool_results")


@dataclass(slots=True)
class ReplyRecord:
    """A reply generated in this session: which engine and request made it, and its tokens.
    A branch or a continuation starts with the tokens it was given (`prefix_tokens` of them),
    which name the reply they came from."""

    generation: int
    request_id: int
    tokens: list[ReplyToken] = field(default_factory=list)
    stats: RequestStats | None = None
    token_ids: list[int] = field(default_factory=list)  # every token of the reply, prefix included
    lead_text: str = ""  # the prefix's text when its tokens are not known here (after a restart)


@dataclass(slots=True)
class ReplyPlan:
    kind: str
    # The path messages the reply follows: for "send" up to where the new message goes (the
    # message is `user_text`, stored once the plan is accepted); otherwise up to and including
    # the user message the reply answers.
    history: list[StoredMessage]
    sampling: SamplingParams
    user_text: str | None = None
    parent_id: int | None = None  # where the new user message (send) or reply goes in the tree
    prefix_ids: tuple[int, ...] = ()  # the reply starts with these tokens (branch, continue)
    prefix_tokens: list[ReplyToken] = field(default_factory=list)  # the same, for the token view
    prefix_text: str = ""  # their text (a branch's chosen token is decoded by the engine)
    chosen: tuple[int, ...] = ()  # a branch's chosen token, to decode after the prefix text
    target: StoredMessage | None = None  # the reply that continues
    note: str = ""  # said in the status bar once it starts (e.g. settings adjusted for a branch)


@dataclass(slots=True)
class ActiveReply:
    message: StoredMessage
    bubble: MessageBubble
    checkpoint: ReplyCheckpoint
    record: ReplyRecord
    plan: ReplyPlan
    text: str = ""  # everything the message holds so far (a prefix's text included)
    context: dict[str, int] | None = None  # what the context limit left out of its prompt
    # n samples or beams: the card they stream into, and each sample's text and token count.
    group: GroupReplyCard | None = None
    sample_texts: dict[int, str] = field(default_factory=dict)
    sample_tokens: dict[int, int] = field(default_factory=dict)
    # A request that offered tools: the engine's reading of the reply (just before its end), and
    # whether the blocks of the results it reads were looked up (a tool_results reply).
    tool_calls: ToolCallsParsed | None = None
    blocks_asked: bool = False


PromptParts = tuple[tuple[ChatMessage, ...], list[ChatMessage], list[ChatMessage], list[StoredMessage]]


def prompt_parts(system: str, plan: ReplyPlan) -> PromptParts:
    """(head, history, tail) of the plan's prompt as ChatMessages, and the stored messages behind
    `history`: the system prompt, the messages before, and the new message (a send) or the
    message the reply answers. A reply that called tools is its call and its results
    (app.chat.tool_turns.expand)."""
    head = (ChatMessage("system", system),) if system else ()
    sent = [m for m in plan.history if m.content]
    if plan.kind == "send":
        tail, before = [ChatMessage("user", plan.user_text or "")], sent
    else:
        tail = [turn for m in sent[-1:] for turn in expand(m)]
        before = sent[:-1]
    history = [turn for m in before for turn in expand(m)]
    return head, history, tail, before


def kept_after(before: list[StoredMessage], dropped: int) -> list[StoredMessage]:
    """The stored messages left once the context limit dropped `dropped` of their turns (the
    fit counts turns): a reply whose call or results were cut goes whole (a result without its
    call means nothing)."""
    if dropped <= 0:
        return list(before)
    owners = [i for i, m in enumerate(before) for _ in expand(m)]
    if dropped >= len(owners):
        return []
    first = owners[dropped]
    if owners[dropped - 1] == first:
        first += 1
    return list(before[first:])
