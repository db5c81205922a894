"""One sequence's place in its grammar: an llguidance matcher, and the masks it computed.

The matcher holds exactly the sequence's generated tokens (plus, for a branch, the reply prefix
it continues): the engine consumes a token when it commits it. What moves it otherwise:
- n samples and beams: a fork copies it with the sequence's blocks (`fork`);
- speculative decoding: verification walks it through the drafts to get each position's mask,
  then rolls it back (`masks_along`), so the round's emitted tokens are consumed as any others;
- a branch from a token: the new request's matcher is replayed over the reply prefix (`replay`).

Masks are remembered along a tape of consumed tokens: rolling back and consuming the same token
again (a speculative round's accepted drafts) reuses the mask computed the first time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import llguidance
import numpy as np
import torch

from engine.grammar.compile import one_line
from engine.sampling.mask import TokenMask


class GrammarDeadEnd(RuntimeError):
    """The grammar permits no next token (or its matcher failed): the reply ends here, and the
    message says why."""


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_width: int):
        self._matcher = matcher
        self.width = vocab_width
        self._words = torch.zeros((1, (vocab_width + 31) // 32), dtype=torch.int32)
        self._tape: list[int] = []  # consumed tokens, then those rolled back (still remembered)
        self.position = 0  # tokens consumed now (a prefix of the tape)
        self._masks: dict[int, TokenMask] = {}  # position -> the mask after tape[:position]

    @classmethod
    def start(cls, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_width: int) -> GrammarState:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():  # compiled by engine.grammar.compile.check first: rare
            raise GrammarDeadEnd(f"the grammar cannot start: {one_line(matcher.get_error())}")
        return cls(matcher, vocab_width)

    # ---- the mask --------------------------------------------------------------------------
    def mask(self, with_forced: bool = False) -> TokenMask:
        """What the grammar permits after the consumed tokens (GrammarDeadEnd: nothing).
        `with_forced`: also what it forces from here (a snapshot shows it; it costs a walk)."""
        cached = self._masks.get(self.position)
        if cached is None:
            # what llguidance.torch.fill_next_token_bitmask does, without importing that module:
            # it compiles a torch function at import, which pulls in torch's compiler stack
            # (+41 MiB resident in every engine process, grammar or not)
            self._matcher.unsafe_compute_mask_ptr(
                self._words.data_ptr(), self._words.numel() * self._words.element_size()
            )
            if self._matcher.is_error():
                raise GrammarDeadEnd(self._dead_end_message())
            bits = np.unpackbits(self._words.numpy().view(np.uint8), bitorder="little")[: self.width]
            if not bits.any():
                raise GrammarDeadEnd(self._dead_end_message())
            cached = TokenMask.from_bits(bits, self._matcher.is_accepting())
            self._masks[self.position] = cached
        if with_forced and cached.forced is None:
            cached = replace(cached, forced=tuple(self._matcher.compute_ff_tokens()))
            self._masks[self.position] = cached
        return cached

    def _dead_end_message(self) -> str:
        # In an error state the first line of the matcher's report names the stop reason
        # (stop_reason() then says only "InternalError").
        error = self._matcher.get_error().strip()
        reason = error.splitlines()[0].strip() if error else str(self._matcher.stop_reason())
        what = {
            "NoExtension": "the grammar permits no next token",
            "NoExtensionBias": "the grammar permits no next token",
            "MaxTokensTotal": "the grammar's token limit was reached",
            "MaxTokensParser": "the grammar's token limit was reached",
            "ParserTooComplex": "the grammar became too complex to follow",
            "LexerTooComplex": "the grammar's lexer became too complex to follow",
        }.get(
            reason,
            f"the grammar's matcher failed ({one_line(error)})" if error else "the grammar's matcher failed",
        )
        return f"{what} after {self.position} tokens of the reply ({reason})"

    # ---- moving ----------------------------------------------------------------------------
    def consume(self, token: int) -> bool:
        """Commit `token`; False (the matcher unchanged) when the grammar does not permit it."""
        if not self._matcher.consume_token(token):
            return False
        p = self.position
        if p < len(self._tape) and self._tape[p] == token:
            pass  # the tape goes on as remembered: its later masks stay valid
        else:
            del self._tape[p:]
            for key in [k for k in self._masks if k > p]:
                del self._masks[key]
            self._tape.append(token)
        self.position = p + 1
        return True

    def rollback(self, count: int) -> None:
        if count > 0:
            assert count <= self.position, "cannot roll back tokens that were never consumed"
            self._matcher.rollback(count)
            self.position -= count

    def replay(self, tokens: Sequence[int]) -> int:
        """Consume `tokens` in order; returns how many the grammar took (all, or up to the first
        it refuses)."""
        for i, token in enumerate(tokens):
            if not self.consume(token):
                return i
        return len(tokens)

    def masks_along(self, drafts: Sequence[int]) -> list[TokenMask | None]:
        """The mask at each of the len(drafts) + 1 positions a speculative round verifies: here,
        then after each draft. A draft the grammar refuses ends the walk: its position's mask
        makes the verifier reject it (p = 0), and the positions after it get None (never
        examined). So does a draft after which the grammar permits nothing: the reply ends
        when that draft is committed. The matcher is left where it was."""
        masks: list[TokenMask | None] = []
        walked = 0
        try:
            for i in range(len(drafts) + 1):
                try:
                    mask = self.mask()
                except GrammarDeadEnd:
                    if i == 0:
                        raise
                    break
                masks.append(mask)
                if i == len(drafts):
                    break
                token = drafts[i]
                permitted = token < mask.allowed.numel() and bool(mask.allowed[token])
                if not permitted or not self.consume(token):
                    break
                walked += 1
                if self.finished:
                    # The draft completes the grammar: the reply ends when it is committed, and
                    # the matcher is not walked on (llguidance's rollback out of a stopped state,
                    # past its end-of-text, leaves the same tokens consumed again not stopped).
                    break
        finally:
            self.rollback(walked)
        return masks + [None] * (len(drafts) + 1 - len(masks))

    def fork(self) -> GrammarState:
        """An independent copy at the same position (a new sample or beam)."""
        child = GrammarState(self._matcher.deep_copy(), self.width)
        child._tape = self._tape[: self.position]
        child.position = self.position
        child._masks = {k: v for k, v in self._masks.items() if k <= self.position}
        return child

    @property
    def finished(self) -> bool:
        """The grammar is complete and permits nothing more (the reply ends: "stop")."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()
