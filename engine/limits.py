"""What fits: one home for every "does this request fit" of the engine and its front ends.

`Limits` is what one engine can hold, from its config and its pool: the context window of one
sequence, the KV pool, the batch. The engine refuses a request against it before the request
starts (engine.core.llm_engine), the server before it answers (engine.serve), the group driver a
group the engine cannot run, and the chat fits a conversation into it (`fit`: the oldest turns
dropped at the limit, or the message refused). Blocks for N tokens are counted here too.

Plain Python: the app reads these answers (through engine.api) on its own thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.config import SamplingParams
from engine.request import ChatMessage

# At the context limit the chat either drops the oldest turns (marked in the chat) or refuses.
POLICIES = ("drop", "refuse")
# Room kept for the reply: its token limit, but never more than this share of the context, so
# a long max_new_tokens does not make every conversation "over the limit".
MAX_REPLY_SHARE = 0.25


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` slots that hold `tokens` tokens (the last one partly filled)."""
    return -(-tokens // block_size)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request can never run, in one line for the user, and which limit it hits:
    "empty" (no prompt), "context" (the window), "pool" (the KV pool). `new_tokens` is True when
    the tokens asked for, not the prompt alone, are what does not fit."""

    message: str
    limit: str
    new_tokens: bool = False


@dataclass(frozen=True, slots=True)
class Limits:
    """What one engine can hold."""

    context_window: int  # tokens one sequence may hold, prompt and reply (max_model_len)
    num_blocks: int  # the KV pool
    block_size: int
    max_num_seqs: int  # sequences in one step
    max_num_batched_tokens: int  # tokens in one step
    speculative: bool = False  # a speculative engine runs no groups (n samples, beams)

    @property
    def pool_tokens(self) -> int:
        """KV slots of the whole pool."""
        return self.num_blocks * self.block_size

    @property
    def request_tokens(self) -> int:
        """Tokens one request may hold: the smaller of the window and the pool."""
        return min(self.context_window, self.pool_tokens)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for_tokens(tokens, self.block_size)

    def blocks_needed(self, prompt_tokens: int, new_tokens: int = 1, sequences: int = 1) -> int:
        """The fewest blocks a request ever runs in: its prompt and `new_tokens` more for each of
        `sequences`. A group's samples or beams share the prompt's full blocks; each writes its own
        copy of the partial one onwards."""
        if sequences == 1:
            return self.blocks_for(prompt_tokens + new_tokens)
        full, partial = divmod(prompt_tokens, self.block_size)
        return full + sequences * self.blocks_for(partial + new_tokens)

    def refusal(
        self, prompt_tokens: int, new_tokens: int | None = None, sequences: int = 1
    ) -> Refusal | None:
        """Why a request of `prompt_tokens` can never run here, or None when it can. With
        `new_tokens` (a client that asked for that many), all of them must fit as well; without,
        the prompt and its first token must."""
        n = prompt_tokens
        if n == 0:
            return Refusal("The prompt is empty.", "empty")
        window = self.context_window
        if n >= window:
            return Refusal(
                f"The prompt is {n} tokens but the context holds {window} tokens: shorten it, or start "
                "a new conversation.",
                "context",
            )
        if new_tokens is not None and n + new_tokens > window:
            return Refusal(
                f"The context holds {window} tokens, but {n + new_tokens} were asked for ({n} in the "
                f"prompt, {new_tokens} new): ask for fewer new tokens or shorten the prompt.",
                "context",
                new_tokens=True,
            )
        need = self.blocks_needed(n, 1 if new_tokens is None else new_tokens, sequences)
        if need <= self.num_blocks:
            return None
        what = f"its {n}-token prompt"
        if new_tokens is not None:
            what += f" and {new_tokens} new tokens" + (
                f" for each of {sequences} sequences" if sequences > 1 else ""
            )
        elif sequences > 1:
            what += f" for each of {sequences} sequences"
        return Refusal(
            f"The KV pool ({self.num_blocks} blocks of {self.block_size} tokens, {self.pool_tokens} tokens) "
            f"can never hold this request: {what} {'need' if new_tokens is not None else 'needs'} {need} blocks. "
            "Raise the KV budget"
            + (", or ask for fewer tokens or sequences." if new_tokens is not None or sequences > 1 else "."),
            "pool",
            new_tokens=new_tokens is not None,
        )

    def group_refusal(self, params: SamplingParams) -> str | None:
        """Why this engine cannot run `params`' group (n samples, beams), or None."""
        if params.group_size <= 1:
            return None
        what = f"beam search with {params.num_beams} beams" if params.beam_search else f"n={params.n} samples"
        if self.speculative:
            return f"{what} cannot run with speculative decoding: turn one of them off."
        if params.group_size > self.max_num_seqs:
            return (
                f"{what} run {params.group_size} sequences at once, but the engine runs at most "
                f"{self.max_num_seqs} (max_num_seqs): ask for fewer or raise it."
            )
        if params.beam_search and params.num_beams > self.max_num_batched_tokens:
            return (
                f"{what} need {params.num_beams} tokens per step, more than the step budget "
                f"({self.max_num_batched_tokens}, max_num_batched_tokens)."
            )
        return None


# ---- a conversation at the context limit -----------------------------------------------------
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

    @property
    def limited_by(self) -> str:
        """What holds the limit: "context window" or "KV pool"."""
        return "context window" if self.context_window <= self.pool_tokens else "KV pool"


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
