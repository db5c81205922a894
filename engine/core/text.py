"""The tokenizer as the step loop uses it: a token's own text, stop tokens, streaming detokenizers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.detokenize import IncrementalDetokenizer, NoText

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
