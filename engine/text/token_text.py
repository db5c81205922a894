"""The tokenizer as the step loop uses it: a token's own text, stop tokens, streaming detokenizers;
and as the app asks it: the text some tokens add after others, a text's tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.results import Tokens
from engine.text.detokenize import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, NoText

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


class TokenText:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def text(self, token_id: int) -> str:
        """One token's own text, special tokens included (the probability panel shows them)."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        assert isinstance(text, str), "one list of ids decodes to one string"
        return text

    def decode_after(self, before: Sequence[int], token_ids: Sequence[int]) -> str:
        """The text `token_ids` add after `before`, decoded as the reply's stream would decode it
        (the same few tokens of context give it its leading space)."""
        context = list(before[-PROMPT_CONTEXT_TOKENS:])
        whole = self._decode([*context, *token_ids])
        return whole[len(self._decode(context)) :]

    def tokens_of(self, pieces: Sequence[str | int]) -> list[Tokens]:
        """Each piece in the model's tokens: a text tokenized as it stands (no special tokens
        added; it may make none), a token id checked against the vocabulary. With each token's
        own text."""
        vocab = len(self.tokenizer)
        out = []
        for piece in pieces:
            if isinstance(piece, int):
                if not 0 <= piece < vocab:
                    raise ValueError(f"#{piece}: the model has {vocab:,} tokens (ids 0 to {vocab - 1:,})")
                ids = [piece]
            else:
                ids = list(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
            out.append(Tokens(tuple(ids), tuple(self.text(i) for i in ids)))
        return out

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert isinstance(text, str), "one list of ids decodes to one string"
        return text

    def detokenizer(
        self, prompt_ids: list[int], stop: tuple[str, ...] = (), text: bool = True
    ) -> IncrementalDetokenizer:
        """The reply's streaming detokenizer; `text` False: none (the caller makes the text)."""
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, stop) if text else NoText()

    def stops(self, token_id: int, ignore_eos: bool) -> bool:
        return token_id in self.eos_ids and not ignore_eos


def eos_ids_of(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
