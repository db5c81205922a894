"""A token's per-stage snapshot: its top candidates' probabilities after every stage, the cuts,
the drawn token and the raw logits a what-if needs."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.events import StageSnapshot, TokenSnapshot
from engine.sampling.mask import TokenMask, grammar_snapshot

# Raw logits kept in a snapshot for what-if: enough that the tail beyond them is usually
# negligible, small enough to ship with every token.
WHAT_IF_TOP = 256


def take_snapshot(
    trace: list[tuple[str, torch.Tensor]],
    penalized: torch.Tensor,
    drawn: int,
    top_n: int,
    decode_token: Callable[[int], str],
    mask: TokenMask | None = None,
) -> TokenSnapshot:
    raw = trace[0][1][0]
    vocab = raw.numel()
    top_logits, top_ids = torch.topk(raw, min(vocab, max(top_n, WHAT_IF_TOP)))
    candidates = top_ids[: min(top_n, vocab)]
    grammar = None
    if mask is not None:
        masked = trace[1][1][0]  # the grammar stage comes right after the raw scores
        grammar = grammar_snapshot(raw, masked, mask, decode_token)
        candidates = _grammar_candidates(raw, masked, min(top_n, vocab))
    if not bool((candidates == drawn).any()):
        candidates = torch.cat([candidates, torch.tensor([drawn], device=candidates.device)])

    # Build every number as a tensor first and move them to Python in one go: on a GPU each
    # separate .item() would be a device sync.
    probs_rows: list[torch.Tensor] = []
    removed_rows: list[torch.Tensor] = []
    kept_counts: list[torch.Tensor] = []
    kept_masses: list[torch.Tensor] = []
    prev_probs: torch.Tensor | None = None
    prev_alive: torch.Tensor | None = None
    for _, scores in trace:
        s = scores[0]
        alive = s > -math.inf
        probs = torch.softmax(s, dim=0)
        probs_rows.append(probs[candidates])
        kept_counts.append(alive.sum())
        if prev_probs is None or prev_alive is None:
            removed_rows.append(torch.zeros_like(candidates, dtype=torch.bool))
            kept_masses.append(probs.new_ones(()))
        else:
            removed_rows.append(prev_alive[candidates] & ~alive[candidates])
            kept_masses.append(prev_probs[alive].sum())
        prev_probs, prev_alive = probs, alive
    final_probs = prev_probs
    assert final_probs is not None, "a trace starts with the raw scores"
    raw_probs = torch.softmax(raw, dim=0)
    summary = torch.stack(
        [
            final_probs[drawn].double(),
            torch.special.entr(final_probs).sum().double(),
            torch.special.entr(raw_probs).sum().double(),
            # float64: what-if derives the tail's mass from it as 1 - (known mass), a difference
            # float32 rounding would swamp.
            raw.double().logsumexp(0),
        ]
    ).tolist()

    ids = candidates.tolist()
    probs_of: list[list[float]] = torch.stack(probs_rows).tolist()
    removed_of: list[list[bool]] = torch.stack(removed_rows).tolist()
    count_of: list[int] = torch.stack(kept_counts).tolist()
    mass_of: list[float] = torch.stack(kept_masses).tolist()
    stages = tuple(
        StageSnapshot(name, tuple(p), tuple(r), int(n), float(m))
        for (name, _), p, r, n, m in zip(trace, probs_of, removed_of, count_of, mass_of)
    )
    return TokenSnapshot(
        candidate_ids=tuple(ids),
        candidate_texts=tuple(decode_token(i) for i in ids),
        stages=stages,
        drawn_id=drawn,
        drawn_prob=summary[0],
        entropy=summary[1],
        raw_entropy=summary[2],
        raw_top_ids=tuple(top_ids.tolist()),
        raw_top_logits=tuple(top_logits.tolist()),
        raw_logsumexp=summary[3],
        penalized_top_logits=tuple(penalized[top_ids].tolist()),
        grammar=grammar,
    )


def _grammar_candidates(raw: torch.Tensor, masked: torch.Tensor, top_n: int) -> torch.Tensor:
    """Under a grammar the raw top N are often all cut: the candidates are the likeliest tokens
    the grammar permits, then (when it permits fewer than N) the likeliest it cut, so the bars
    show both what could be drawn and what the grammar took away."""
    allowed = int((masked > -math.inf).sum())
    kept = torch.topk(masked, min(top_n, allowed)).indices
    if kept.numel() >= top_n:
        return kept
    cut = torch.topk(torch.where(masked > -math.inf, -math.inf, raw), top_n - kept.numel()).indices
    return torch.cat([kept, cut])
