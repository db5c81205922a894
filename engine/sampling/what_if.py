"""What-if: a recorded token's warper stages recomputed under other settings from its snapshot."""

from __future__ import annotations

import math

import torch

from engine.config import SamplingParams
from engine.events import StageSnapshot, TokenSnapshot
from engine.sampling.stages import PENALTY_STAGES, TOP_P_TOLERANCE, build_stages, enabled_warpers

# what-if: the smallest tail mass it trusts; float64 rounding of 1 - (known mass) is ~1e-14.
MIN_TAIL_MASS = 1e-13


def what_if(snapshot: TokenSnapshot, params: SamplingParams) -> tuple[StageSnapshot, ...]:
    """Recompute a recorded token's warper stages (temperature, top-k, top-p, min-p, typical-p,
    XTC) under other `params`; `what_if_notes` says what it could not recompute.

    Works from the snapshot alone (no model), so it is an approximation, labelled "what-if" in
    the app:
    - Only the top raw logits kept in the snapshot (`raw_top_ids`, 256 or more) are known one by
      one. The rest of the vocabulary (the tail) is known only through its total probability,
      implied by `raw_logsumexp`; it is modelled as that many tokens sharing the tail mass
      equally, each below every known token. Where the tail mass is negligible the result equals
      the real pipeline's; otherwise a heavy tail is spread more evenly than it really is.
    - Penalties, DRY, logit bias and banned tokens cannot be recomputed (the token history is not
      in the snapshot, and they act on the logits before the ones it keeps): the recorded
      "raw" and penalty stages are returned as they were, and the new warpers act on the
      recorded penalized logits of the known tokens; the tail is taken as untouched by the
      penalties (exact when every penalized token is among the known ones). A candidate
      outside the known top set gets one tail token's share.
    - XTC is random: it is shown as if its coin came up (with probability xtc_probability).
    With greedy params (temperature 0) only the recorded raw and penalty stages remain.
    """
    recorded = tuple(s for s in snapshot.stages if s.name == "raw" or s.name in PENALTY_STAGES)
    warpers = enabled_warpers(params)
    if not warpers or not snapshot.raw_top_ids:
        return recorded
    dist = _TruncatedDistribution(snapshot)
    return recorded + tuple(dist.apply(name, value) for name, value in warpers)


def what_if_notes(snapshot: TokenSnapshot, params: SamplingParams) -> tuple[str, ...]:
    """One line per way the what-if differs from what a real run under `params` would show."""
    notes = []
    recorded = [s.name for s in snapshot.stages if s.name in PENALTY_STAGES]
    wanted = [s.name for s in build_stages(params) if s.name in PENALTY_STAGES]
    if recorded != wanted:
        notes.append(
            "penalties, DRY, logit bias and banned tokens need the token history: shown as recorded "
            f"({', '.join(recorded) or 'none'}), not as set ({', '.join(wanted) or 'none'})"
        )
    if params.xtc_probability > 0.0 and not params.greedy:
        notes.append(
            f"XTC shown as if its coin came up (it does with probability {params.xtc_probability:g})"
        )
    return tuple(notes)


class _TruncatedDistribution:
    """The penalized distribution as known from a snapshot: one entry per known top token plus
    one entry standing for `count` tail tokens of equal logit. Cuts lower an entry's count."""

    def __init__(self, snapshot: TokenSnapshot):
        ids = snapshot.raw_top_ids
        raw = torch.tensor(snapshot.raw_top_logits, dtype=torch.float64)
        logits = torch.tensor(snapshot.penalized_top_logits or snapshot.raw_top_logits, dtype=torch.float64)
        counts = torch.isfinite(logits).to(torch.float64)
        vocab = snapshot.stages[0].kept_count  # finite raw logits = tokens that can be drawn at all
        tail_tokens = vocab - int(counts.sum())
        self.tail_entry = None
        if tail_tokens > 0:
            # The tail's raw mass is what the known tokens leave of the whole. Below
            # MIN_TAIL_MASS that difference is rounding noise, and the tail is certainly not
            # empty (its logits are finite), so it is floored there.
            tail_mass = 1.0 - float(torch.exp(raw - snapshot.raw_logsumexp).sum())
            tail_logit = snapshot.raw_logsumexp + math.log(max(tail_mass, MIN_TAIL_MASS) / tail_tokens)
            self.tail_entry = len(ids)
            logits = torch.cat([logits, logits.new_tensor([tail_logit])])
            counts = torch.cat([counts, counts.new_tensor([float(tail_tokens)])])
        self.logits, self.counts = logits, counts
        index = {token: i for i, token in enumerate(ids)}
        self.candidate_entries = [index.get(c, self.tail_entry) for c in snapshot.candidate_ids]

    def token_probs(self) -> torch.Tensor:
        """Probability of ONE token of each entry (0 for entries cut to count 0)."""
        alive = self.counts > 0
        x = torch.where(alive, self.logits, -math.inf)
        log_norm = torch.logsumexp(x + self.counts.log(), 0)
        return torch.where(alive, torch.exp(x - log_norm), 0.0)

    def apply(self, name: str, value: float) -> StageSnapshot:
        before = self.token_probs()
        alive_before = self.counts > 0
        if name == "temperature":
            self.logits = self.logits / value
        elif name == "top_k":
            self.counts = self._top_k_counts(int(value))
        elif name == "top_p":
            self.counts = self._top_p_counts(before, value)
        elif name == "min_p":
            self.counts = torch.where(before >= value * before.max(), self.counts, 0.0)
        elif name == "typical_p":
            self.counts = self._typical_counts(before, value)
        elif name == "xtc":
            self.counts = self._xtc_counts(before, value)
        after = self.token_probs()
        alive_after = self.counts > 0
        probs, removed = [], []
        for entry in self.candidate_entries:
            probs.append(0.0 if entry is None else float(after[entry]))
            removed.append(entry is not None and bool(alive_before[entry] and not alive_after[entry]))
        return StageSnapshot(
            name=name,
            probs=tuple(probs),
            removed=tuple(removed),
            kept_count=int(self.counts.sum()),
            kept_mass=float((before * self.counts).sum()),
        )

    def _descending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry order by logit, highest first, and the token count strictly above each entry."""
        order = torch.argsort(torch.where(self.counts > 0, self.logits, -math.inf), descending=True)
        above = torch.cumsum(self.counts[order], 0) - self.counts[order]
        return order, above

    def _top_k_counts(self, k: int) -> torch.Tensor:
        # Like TopKLogitsWarper: keep every token scoring at least the k-th highest score (so a tie
        # at the cut keeps all tied known tokens); the tail entry keeps as many tokens as fit.
        order, above = self._descending()
        kept = self.counts.clone()
        reached = torch.nonzero(above + self.counts[order] >= k)
        if len(reached) == 0:
            return kept
        threshold = self.logits[order[int(reached[0])]]
        kept[order] = torch.clamp(k - above, min=0).minimum(self.counts[order])
        singles = (self.counts == 1) & (self.logits >= threshold)
        return torch.where(singles, 1.0, kept)

    def _typical_counts(self, probs: torch.Tensor, mass: float) -> torch.Tensor:
        # TypicalLogitsWarper: rank tokens by |surprise - entropy|, keep the smallest such prefix
        # reaching `mass` and every token tied with its last (so an entry is kept whole).
        alive = self.counts > 0
        log_p = torch.where(alive, probs.clamp(min=1e-300).log(), 0.0)
        entropy = -(self.counts * probs * log_p).sum()
        shifted = torch.where(alive, (-log_p - entropy).abs(), math.inf)
        order = torch.argsort(shifted)
        cumulative = torch.cumsum((probs * self.counts)[order], 0)
        last = min(int((cumulative < mass).sum()), int(alive.sum()) - 1)
        keep = shifted <= shifted[order[last]]
        return torch.where(keep & alive, self.counts, 0.0)

    def _xtc_counts(self, probs: torch.Tensor, threshold: float) -> torch.Tensor:
        # XTC when it fires: of the tokens at or above the threshold, only the least likely stays.
        above = (probs >= threshold) & (self.counts > 0)
        if float(self.counts[above].sum()) < 2:
            return self.counts
        least = int(torch.where(above, probs, math.inf).argmin())
        kept = torch.where(above, 0.0, self.counts)
        kept[least] = 1.0
        return kept

    def _top_p_counts(self, probs: torch.Tensor, top_p: float) -> torch.Tensor:
        # The rule of `TopP`: a token stays while the mass strictly above it is below top_p (the
        # first token always stays); of the tail entry, as many tokens as that allows.
        order, _ = self._descending()
        mass = probs[order] * self.counts[order]
        mass_above = torch.cumsum(mass, 0) - mass
        room = torch.ceil((top_p - TOP_P_TOLERANCE - mass_above) / probs[order].clamp(min=1e-300))
        kept = self.counts.clone()
        kept[order] = torch.clamp(room, min=0).minimum(self.counts[order])
        kept[order[0]] = torch.clamp(kept[order[0]], min=1.0).minimum(self.counts[order[0]])
        return kept
