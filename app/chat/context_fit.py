"""How much of the context a conversation takes, and what to do at the limit.

A request must fit the model's context window and the whole KV pool (the engine refuses one
that does not), with room left for the reply. At the limit the user's setting decides, never a
silent cut: "drop" leaves the oldest turns out of the prompt (the chat marks them), "refuse"
sends nothing and says why. Counting is the tokenizer's job on the engine thread: `measure`
runs there (through Engine.call) and takes the engine's own prompt rendering, so the count is
the one the engine will see; `fit` is pure and takes any counting function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.request import ChatMessage, Request

POLICIES = ("drop", "refuse")
DEFAULT_POLICY = "drop"
POLICY_LABELS = {
    "drop": "Drop the oldest turns (marked in the chat)",
    "refuse": "Refuse to send, with a message",
}
# Room kept for the reply: its token limit, but never more than this share of the context, so
# a long max_new_tokens does not make every conversation "over the limit".
MAX_REPLY_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class ContextFit:
    prompt_tokens: int  # what the request will hold (after any dropping)
    full_tokens: int  # the whole conversation, nothing dropped
    context_window: int  # the engine's max_model_len
    pool_tokens: int  # KV slots of the whole pool
    reply_room: int  # tokens kept free for the reply
    dropped: int  # leading history messages left out
    fits: bool  # can be sent under the policy
    policy: str
    sent_tokens: int = 0  # of full_tokens, those already in the conversation (not the new message)

    @property
    def limit(self) -> int:
        """Tokens one request may hold: the smaller of the window and the pool."""
        return min(self.context_window, self.pool_tokens)

    @property
    def over(self) -> bool:
        return self.full_tokens + self.reply_room > self.limit

    def refusal(self) -> str:
        """The one-line message when it cannot be sent."""
        what = "context window" if self.context_window <= self.pool_tokens else "KV pool"
        need = self.full_tokens + self.reply_room
        if self.policy == "refuse":
            advice = (
                "start a new conversation, branch from an earlier message, or choose "
                "Chat › At the context limit › Drop the oldest turns"
            )
        else:
            advice = "even the last message alone is too long: shorten it"
            if what == "KV pool":
                advice += " or raise the KV budget"
        return (
            f"This turn needs {need:,} tokens ({self.full_tokens:,} of prompt and {self.reply_room:,} for the "
            f"reply) but the {what} holds {self.limit:,}: {advice}."
        )


def reply_room(max_new_tokens: int, limit: int) -> int:
    return max(1, min(max_new_tokens, int(limit * MAX_REPLY_SHARE)))


def fit(
    count: Callable[[Sequence[ChatMessage]], int],
    head: Sequence[ChatMessage],
    history: Sequence[ChatMessage],
    tail: Sequence[ChatMessage],
    context_window: int,
    pool_tokens: int,
    max_new_tokens: int,
    policy: str,
    tail_is_new: bool = True,
) -> ContextFit:
    """`head` (the system prompt) and `tail` (the new message) are always sent; with "drop",
    the fewest leading `history` messages are left out, cutting only before a user turn so the
    rest still alternates. `count(messages)` is the prompt's token count. `tail_is_new`: the
    tail is being typed (the meter shows it apart), not a message already sent."""
    limit = min(context_window, pool_tokens)
    room = reply_room(max_new_tokens, limit)
    full = count([*head, *history, *tail])
    sent = (count([*head, *history]) if (head or history) else 0) if tail_is_new and tail else full

    def result(tokens: int, dropped: int, fits: bool) -> ContextFit:
        return ContextFit(tokens, full, context_window, pool_tokens, room, dropped, fits, policy, sent)

    if full + room <= limit:
        return result(full, 0, True)
    if policy != "drop":
        return result(full, 0, False)
    # Cut points: before each user message after the first, and after the whole history.
    cuts = [i for i in range(1, len(history)) if history[i].role == "user"] + [len(history)]
    counts: dict[int, int] = {}

    def tokens_from(cut: int) -> int:
        if cut not in counts:
            counts[cut] = count([*head, *history[cut:], *tail])
        return counts[cut]

    # Fewer tokens the more is cut: binary search for the first cut that fits.
    lo, hi = 0, len(cuts) - 1
    if tokens_from(cuts[hi]) + room > limit:
        return result(tokens_from(cuts[hi]), cuts[hi], False)
    while lo < hi:
        mid = (lo + hi) // 2
        if tokens_from(cuts[mid]) + room <= limit:
            hi = mid
        else:
            lo = mid + 1
    return result(tokens_from(cuts[lo]), cuts[lo], True)


def measure(
    core,
    head: Sequence[ChatMessage],
    history: Sequence[ChatMessage],
    tail: Sequence[ChatMessage],
    prefix_ids: Sequence[int],
    max_new_tokens: int,
    policy: str,
    tail_is_new: bool = True,
) -> ContextFit:
    """`fit` with the engine's own prompt rendering; runs on the engine thread (Engine.call)."""

    def count(messages: Sequence[ChatMessage]) -> int:
        if not messages:
            return len(prefix_ids)
        request = Request(messages=tuple(messages), reply_prefix_ids=tuple(prefix_ids))
        return len(core.prompt_ids(request))

    pool_tokens = core.kv.pool.num_blocks * core.kv.block_size
    return fit(
        count, head, history, tail, core.max_model_len, pool_tokens, max_new_tokens, policy, tail_is_new
    )
