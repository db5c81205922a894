"""Speculative decoding: proposers guess k tokens cheaply; one target forward checks them all.

Verification is the standard rejection sampling (Leviathan et al. 2023): draft token x with
draft probability q(x) is accepted with probability min(1, p(x)/q(x)), where p is the target's
distribution after the request's own sampling stages; on the first rejection the token is drawn
from the normalised residual max(p - q, 0); when every draft is accepted a bonus token is drawn
from the target's next distribution. The emitted tokens are distributed exactly as p, whatever
the draft. Greedy is the special case of one-hot p: drafts are kept while they equal the argmax
(`verify_greedy`: the whole round from its rows' argmaxes, no distribution built).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: int  # leading draft tokens kept
    token: int  # the token after them: resampled on a rejection, else the bonus
    bonus: bool
    accept_probs: tuple[float, ...]  # min(1, p/q) of each draft token examined
    p_of_draft: tuple[float, ...]
    q_of_draft: tuple[float, ...]
    # a greedy round's (verify_greedy) log-sum-exp of each row it emits from, for their tokens'
    # log-probs without a second pass over the rows; empty otherwise
    log_normalizers: tuple[float, ...] = ()


def verify(
    p: torch.Tensor,
    draft: list[int],
    q: list[torch.Tensor | None],
    draw: Callable[[torch.Tensor], int],
    uniform: Callable[[], float],
) -> Verdict:
    """p: [len(draft) + 1, V] target distributions; q[i]: the draft's distribution for draft[i]
    (None = a deterministic, one-hot proposal such as n-gram lookup)."""
    accept_probs, ps, qs = [], [], []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qi = q[i]
        qx = 1.0 if qi is None else float(qi[x])
        a = min(1.0, px / qx) if qx > 0 else 0.0
        accept_probs.append(a)
        ps.append(px)
        qs.append(qx)
        if uniform() < a:
            continue
        if qi is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - qi).clamp_min(0.0)
        total = float(residual.sum())
        # Rejection with zero residual mass needs p == q, where acceptance is certain; guard
        # against float dust all the same.
        token = draw(residual / total) if total > 0 else draw(p[i])
        return Verdict(i, token, False, tuple(accept_probs), tuple(ps), tuple(qs))
    return Verdict(len(draft), draw(p[len(draft)]), True, tuple(accept_probs), tuple(ps), tuple(qs))


def verify_greedy(score: Callable[[int], tuple[int, float]], draft: list[int]) -> Verdict:
    """A greedy round with no sampling stage, from its rows' (argmax, log-sum-exp) as
    sampler.greedy_row gives them (`score(i)`: row i's). Drafts are kept while each equals its
    row's argmax; the token after them is the first differing row's argmax (the rejection) or the
    last row's (the bonus): what `verify` gives with one-hot p and q, without a distribution per
    row. Rows are scored in order up to that token's: the rows after it emit nothing (a round
    that keeps no draft scores one row, as a decode step does)."""
    scored = [score(0)]
    accepted = 0
    while accepted < len(draft) and draft[accepted] == scored[accepted][0]:
        accepted += 1
        scored.append(score(accepted))
    examined = min(accepted + 1, len(draft))
    kept = tuple(1.0 if i < accepted else 0.0 for i in range(examined))
    normalizers = tuple(lse for _, lse in scored)
    return Verdict(
        accepted, scored[accepted][0], accepted == len(draft), kept, kept, (1.0,) * examined, normalizers
    )
