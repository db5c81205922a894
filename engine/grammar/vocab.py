"""The model's vocabulary as llguidance reads it: built once per tokenizer (about a second for a
49k-token vocabulary), then shared by every grammar and matcher of that model."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import llguidance
from llguidance.hf import from_tokenizer

from engine.grammar.compile import GrammarError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_cache: dict[tuple[int, int, tuple[int, ...]], tuple[weakref.ref[object], llguidance.LLTokenizer]] = {}


def grammar_tokenizer(
    tokenizer: PreTrainedTokenizerBase, vocab_width: int, eos_ids: set[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer`: masks `vocab_width` wide (the LM head's rows;
    ids past the tokenizer's are never allowed), EOS = every token the engine stops on."""
    eos = tuple(sorted(i for i in eos_ids if i < vocab_width))
    key = (id(tokenizer), vocab_width, eos)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is tokenizer:
        return hit[1]
    width = max(vocab_width, len(tokenizer))
    try:
        built = from_tokenizer(tokenizer, n_vocab=width, eos_token=list(eos) or None)  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError) as exc:
        raise GrammarError(
            "constrained decoding needs the model's tokenizer in its fast (tokenizers) form; "
            f"this model's is {type(tokenizer).__name__} ({exc})"
        ) from None
    _cache[key] = (weakref.ref(tokenizer), built)
    return built
