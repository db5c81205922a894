"""The grammar's token mask as a sampling stage: the first one, before the penalties.

A `TokenMask` is what a sequence's grammar permits next (engine.grammar.state makes it); the
stage sets every other token's logit to -inf, so the stages after it and the draw see exactly
the permitted set. Its snapshot (`GrammarSnapshot`) says how many tokens were allowed, how much
of the raw mass the grammar removed, what it forces from here, and the likeliest tokens it cut.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.events import GrammarSnapshot

GRAMMAR_STAGE = "grammar"
# The likeliest tokens a mask removed, kept in its snapshot ("the tokens it cut").
CUT_LISTED = 8


@dataclass(frozen=True, slots=True)
class TokenMask:
    allowed: torch.Tensor  # bool [V]: True where the grammar permits the token next
    count: int  # allowed tokens
    accepting: bool  # the text so far is complete: the grammar allows ending here
    forced: tuple[int, ...] | None = None  # tokens the grammar forces from here (for snapshots)


def apply_mask(scores: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """scores [1, V] with every token the grammar does not permit at -inf. A mask narrower than
    the scores (a head wider than the tokenizer) permits none of the extra ids."""
    allowed = mask.allowed
    vocab = scores.shape[-1]
    if allowed.numel() < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
    elif allowed.numel() > vocab:
        allowed = allowed[:vocab]
    return scores.masked_fill(~allowed.to(scores.device), -math.inf)


def grammar_snapshot(
    raw: torch.Tensor, masked: torch.Tensor, mask: TokenMask, decode_token: Callable[[int], str]
) -> GrammarSnapshot:
    """raw, masked: the scores [V] before and after the mask."""
    raw_probs = torch.softmax(raw, dim=0)
    cut = masked == -math.inf
    cut &= raw > -math.inf  # a token the model itself never produces was not cut by the grammar
    cut_probs = torch.where(cut, raw_probs, -1.0)
    top = torch.topk(cut_probs, min(CUT_LISTED, int(cut.sum())))
    removed = float(raw_probs[cut].double().sum()) if bool(cut.any()) else 0.0
    cut_ids = tuple(top.indices.tolist())
    return GrammarSnapshot(
        allowed=mask.count,
        vocab_size=raw.numel(),
        removed_mass=removed,
        forced=mask.count == 1,
        accepting=mask.accepting,
        forced_ids=mask.forced or (),
        forced_texts=tuple(decode_token(i) for i in mask.forced or ()),
        cut_ids=cut_ids,
        cut_texts=tuple(decode_token(i) for i in cut_ids),
        cut_probs=tuple(top.values.tolist()),
    )
