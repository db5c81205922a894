"""Proposers of draft tokens, as the engine asks them; n-gram prompt lookup. The model drafters
(a draft model, the target's own layers) run on the engine's runner: engine/core/drafter.py.
Their guesses are checked by engine.speculative.verify."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.config import ConfigError, SamplingParams

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from engine.kv.block_pool import Block
    from engine.sampling.sampler import Sampler

# A proposal for one sequence: its draft tokens and, per draft, the distribution it was drawn
# from (None: a one-hot, deterministic proposal such as n-gram lookup).
Drafts = tuple[list[int], list["torch.Tensor | None"]]


class Sequence(Protocol):
    """What a proposer reads of a sequence (engine.core.sequence.Sequence): its committed tokens,
    where its prompt ends, and its sampling settings; a self-draft also where the target's pool
    holds its K/V (the blocks of its first num_computed_tokens tokens)."""

    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_table(self) -> list[Block]: ...


class Proposer(Protocol):
    """What the engine asks of a proposer (n-gram lookup or a model drafter)."""

    name: str
    # True when it drafts from the target's hidden state: the engine then hands it the final
    # norm's output of the row each sequence's last token was drawn from (observe_hidden)
    reads_hidden: bool
    # a layer m > 0 whose input residual at that row it reads too (0: none)
    middle_layer: int
    # True when proposing costs next to nothing (a lookup): the engine then proposes at plain
    # steps too and scores the proposal against what the target decodes (shadow drafts), so a
    # sequence whose draft length went to 0 learns when drafts would pay again for free.
    free: bool
    forwards: int  # draft forwards the last `propose` ran (a lookup counts one)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        """Up to ks[i] draft tokens for seqs[i] (all at once: a model drafter batches them)."""
        ...

    def evidence(self, seq: Sequence) -> int:
        """The class of what a proposal for the sequence now would rest on (the draft tuner keeps
        an acceptance per class; engine.speculative.adaptive): asked of free proposers only, 0
        when they have nothing to propose."""
        ...

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        """Only the sequence's first `valid_tokens` tokens are still true."""
        ...

    def observe_hidden(
        self, seq: Sequence, hidden: torch.Tensor, middle: torch.Tensor | None, length: int
    ) -> None:
        """`hidden` [hidden]: what the target's head read where the sequence's token `length` - 1
        was drawn, and `middle` [hidden] the residual entering layer `middle_layer` at that row
        (None where it reads none) (asked only of proposers that read them)."""
        ...

    def release(self, seq: Sequence) -> None: ...

    def memory_bytes(self) -> tuple[int, int]:
        """(own weights, own caches) in bytes."""
        ...


@dataclass(slots=True)
class _Grams:
    """One sequence's n-gram index: for each n, the latest start of every n-gram that some token
    follows. Committed tokens only grow (drafts live apart), so it is built once, incrementally."""

    indexed: int = 0  # tokens seen: grams ending before this position are in the index
    latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
    `max_n` down to `min_n`) and propose the tokens that followed it. No model; q is one-hot.
    An incremental index per sequence makes a lookup O(max_n) whatever the context's length (a
    scan of a 2000-token context cost ~2 ms of Python a step)."""

    name = "ngram"
    free = True
    forwards = 1
    reads_hidden = False
    middle_layer = 0

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self._grams: dict[int, _Grams] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        return [self.lookup(seq, k) for seq, k in zip(seqs, ks)]

    def lookup(self, seq: Sequence, k: int) -> Drafts:
        tokens = seq.token_ids
        n, start = self._match(seq)
        if n == 0:
            return [], []
        follow = tokens[start + n : start + n + k]
        return list(follow), [None] * len(follow)

    def evidence(self, seq: Sequence) -> int:
        """The length of the match a proposal would follow (0: none)."""
        return self._match(seq)[0]

    def _match(self, seq: Sequence) -> tuple[int, int]:
        """(n, start) of the longest of the last n tokens' latest earlier occurrence, (0, 0) if none."""
        tokens = seq.token_ids
        grams = self._index(seq.seq_id, tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = grams.latest[n].get(tuple(tokens[-n:]))
            if start is not None:
                return n, start
        return 0, 0

    def _index(self, seq_id: int, tokens: list[int]) -> _Grams:
        grams = self._grams.get(seq_id)
        if grams is None or grams.indexed > len(tokens):
            grams = self._grams[seq_id] = _Grams(latest={n: {} for n in range(self.min_n, self.max_n + 1)})
        # a gram starting at s is followed by a token once s + n < len(tokens); later starts win
        for end in range(grams.indexed + 1, len(tokens)):
            for n, table in grams.latest.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end - n
        grams.indexed = max(grams.indexed, len(tokens) - 1)
        return grams

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        pass

    def observe_hidden(
        self, seq: Sequence, hidden: torch.Tensor, middle: torch.Tensor | None, length: int
    ) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        self._grams.pop(seq.seq_id, None)

    def memory_bytes(self) -> tuple[int, int]:
        """(own weights, own caches): a lookup in the sequence's tokens holds neither."""
        return 0, 0


def draw_draft(
    sampler: Sampler, logits: torch.Tensor, seq: Sequence, drafted: list[int], vocab_size: int
) -> tuple[int, torch.Tensor | None]:
    """A model drafter's next draft for `seq` from its `logits`, under the request's own sampling
    settings: (token, q), q None where the draft is deterministic (one-hot). A head over only the
    vocabulary's first ids gives the others probability 0, which the exact verifier allows."""
    if sampler.plain_greedy:
        return int(logits.argmax()), None  # one-hot q: the verifier keeps it while it is the argmax
    if logits.shape[-1] < vocab_size:  # a trimmed head: the ids it lacks get probability 0
        full = logits.new_full((vocab_size,), float("-inf"))
        full[: logits.shape[-1]] = logits
        logits = full
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    q = sampler.distribution(logits, prompt, [*seq.output_ids, *drafted])
    if seq.params.greedy:
        return int(q.argmax()), None  # the penalized argmax; one-hot q
    return sampler.draw(q), q


PROBE_TEXT = "Speculative decoding checks drafts: 42 tokens, naïve café, 你好, 🙂."


def check_same_tokenizer(
    target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase
) -> None:
    """Draft tokens are target tokens: the two vocabularies must agree."""
    same = len(target_tokenizer) == len(draft_tokenizer) and target_tokenizer.encode(
        PROBE_TEXT
    ) == draft_tokenizer.encode(PROBE_TEXT)
    if not same:
        raise ConfigError(
            "The draft model's tokenizer differs from the target's, so its tokens cannot be verified; "
            "choose a draft model of the same family (same vocabulary)."
        )
