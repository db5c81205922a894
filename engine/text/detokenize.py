"""Streaming detokenization: turn tokens into text deltas as they arrive.

Byte-level tokenizers split a multi-byte character (a Chinese character, an emoji) across
several tokens, and SentencePiece-style ones decide a word's leading space from the token
before it, so decoding token by token is wrong. The offset technique of vLLM and TGI decodes
a small window twice, `ids[prefix_offset:read_offset]` (text already emitted) and
`ids[prefix_offset:]`, and emits the difference only once it no longer ends in U+FFFD (the
replacement character of an incomplete byte sequence).

Stop strings are cut here too: the text ends before the first stop string, and a tail that
could still grow into one is held back, so a streamed delta never shows part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded along with the first reply tokens, so the first delta gets the spacing
# the prompt implies (vLLM uses the same five).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """One reply's text, token by token. `text` is always the concatenation of the deltas
    returned so far (after `flush`, the whole reply, cut before a stop string)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()
    ):
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._decoded = ""  # all text decoded so far, cut at a stop string once one appears
        self._emitted = 0  # characters of _decoded handed out as deltas
        self._searched = 0  # characters of _decoded already searched for stop strings
        self._stopped = False

    @property
    def text(self) -> str:
        return self._decoded[: self._emitted]

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it releases (may be "")."""
        if self._stopped:
            return ""
        self._ids.append(token_id)
        self._decoded += self._decode_new(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the reply: release what was held back (an incomplete character as
        U+FFFD, a tail that could have begun a stop string)."""
        if not self._stopped:
            self._decoded += self._decode_new(final=True)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: that heuristic rewrites text across token
        # boundaries (" ." -> "."), so windows would not add up to the whole.
        text = self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert isinstance(text, str), "one list of ids decodes to one string"
        return text

    def _decode_new(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        emitted_window = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(emitted_window) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # a special token, or a character still incomplete: wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(emitted_window) :]

    def _release(self, final: bool) -> str:
        if self._stop and not self._stopped:
            self._cut_at_stop()
        end = len(self._decoded)
        if not (final or self._stopped):
            end -= self._stop_prefix_len()
        end = max(end, self._emitted)
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        return delta

    def _cut_at_stop(self) -> None:
        # Only text new since the last search can complete a stop string.
        start = max(0, self._searched - self._longest_stop + 1)
        hits = [i for s in self._stop if (i := self._decoded.find(s, start)) != -1]
        if hits:
            self._decoded = self._decoded[: min(hits)]
            self._stopped = True
        self._searched = len(self._decoded)

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is the beginning of a stop string."""
        text = self._decoded
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


class NoText(IncrementalDetokenizer):
    """The detokenizer of a request whose caller makes its text itself (Request.detokenize
    False): nothing decoded on the engine thread, no stop string to find."""

    def __init__(self) -> None:
        self._stopped = False

    @property
    def text(self) -> str:
        return ""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""
