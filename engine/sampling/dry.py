"""DRY ("don't repeat yourself"): a penalty on the tokens that would continue a sequence the text
already contains.

The algorithm of text-generation-webui's DRYLogitsProcessor (p-e-w, PR #5677), also in llama.cpp:
for every earlier occurrence of the last token, extend the match backwards while the tokens
before it equal the tokens before the end of the text; the token that followed that occurrence
would repeat a sequence of `match_length + 1` tokens. A token whose longest such match is at
least `allowed_length` loses `multiplier * base ** (match_length - allowed_length)` from its
logit. A sequence breaker ends every match: the last token, the token that would follow, or a
token inside the match being a breaker stops it there.

Breakers are strings here (the user's "\\n", ":", ...): a token is a breaker when its text
contains one, which is llama.cpp's reading of single-character breakers (webui takes the one
token `encode("a" + s)[-1]`, which misses the many tokens that merely contain the character).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

# Matches are extended at most this far (webui's cap): it bounds both the work of the worst
# case (a long run of one token) and the exponent of the penalty.
DRY_MAX_MATCH = 50


class DryPenalty:
    def __init__(
        self,
        multiplier: float,
        base: float,
        allowed_length: int,
        breakers: Iterable[str],
        last_n: int = 0,
        decode_token: Callable[[int], str] | None = None,
    ):
        self.multiplier = multiplier
        self.base = base
        self.allowed_length = allowed_length
        self.last_n = last_n
        self._breaker_strings = tuple(breakers)
        self._decode = decode_token or (lambda token_id: "")
        self._is_breaker: dict[int, bool] = {}  # decoded once per token id for this request

    def is_breaker(self, token_id: int) -> bool:
        known = self._is_breaker.get(token_id)
        if known is None:
            text = self._decode(token_id)
            known = self._is_breaker[token_id] = any(b in text for b in self._breaker_strings)
        return known

    def penalties(self, ids: list[int]) -> dict[int, float]:
        """token id -> the amount taken from its logit, for the text `ids` (prompt + reply)."""
        if self.last_n > 0:
            ids = ids[-self.last_n :]
        if len(ids) < 2 or self.is_breaker(ids[-1]):
            return {}
        arr = np.asarray(ids)
        last = len(ids) - 1
        match_lengths: dict[int, int] = {}
        for i in np.flatnonzero(arr[:-1] == arr[-1]).tolist():
            following = ids[i + 1]
            if self.is_breaker(following):
                continue
            length = 1  # the last token itself matches at i
            while length < DRY_MAX_MATCH:
                j = i - length
                if j < 0:
                    break
                previous = ids[last - length]
                if ids[j] != previous or self.is_breaker(previous):
                    break
                length += 1
            if length > match_lengths.get(following, 0):
                match_lengths[following] = length
        return {
            token: self.multiplier * self.base ** (length - self.allowed_length)
            for token, length in match_lengths.items()
            if length >= self.allowed_length
        }

    def __call__(self, ids: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        found = self.penalties(list(ids))
        if not found:
            return scores
        vocab = scores.shape[-1]
        tokens = [t for t in found if t < vocab]
        amounts = scores.new_tensor([found[t] for t in tokens])
        index = torch.tensor(tokens, device=scores.device, dtype=torch.long)
        return scores.index_add(1, index, -amounts.reshape(1, -1))
