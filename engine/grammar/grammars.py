"""The engine's grammar maker: a matcher for each sequence that asks for one."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance

from engine.config import GrammarSpec
from engine.grammar.compile import GrammarError, check
from engine.grammar.state import GrammarDeadEnd, GrammarState
from engine.grammar.vocab import grammar_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Compiled grammars kept by spec: a chat regenerated, branched or sampled n ways reuses its own.
COMPILED_KEPT = 32


class Grammars:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_width: int, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_width = vocab_width
        self.eos_ids = eos_ids
        self._compiled: OrderedDict[GrammarSpec, str] = OrderedDict()

    def compiled(self, spec: GrammarSpec) -> str:
        """The grammar checked against this model's vocabulary (GrammarError: why not)."""
        text = self._compiled.get(spec)
        if text is None:
            text = check(spec, self._vocabulary())
            self._compiled[spec] = text
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return text

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A matcher at the grammar's start (GrammarError for a grammar that cannot compile)."""
        text = self.compiled(spec)
        try:
            return GrammarState.start(self._vocabulary(), text, self.vocab_width)
        except GrammarDeadEnd as exc:
            raise GrammarError(str(exc)) from None

    def _vocabulary(self) -> llguidance.LLTokenizer:
        return grammar_tokenizer(self.tokenizer, self.vocab_width, self.eos_ids)
