"""How many drafts each sequence gets: the length that makes the most of the engine's time, from
what this engine measured (never a fixed guess), down to none.

Two measurements, both the engine's own:
  costs       a decode step's time by its rows (each speculative round adds its drafts' rows),
              and the drafting time per draft forward, as exponential averages;
  acceptance  per sequence, class of evidence and draft position j, the recent share of rounds
              whose j-th draft was kept given the ones before it were (decayed counts, so it
              follows the text), from a prior that is the engine's recent acceptance in that
              class over all its sequences (with a fixed 0.5, every new sequence spent its first
              rounds relearning what the engine had measured on the ones before it; 0.5 before
              any round). The class is what the proposer's guess rests on: for n-gram lookup the
              length of the match (measured on the packaged model's greedy replies to 9 chat
              prompts, the first draft was kept after 15% of 1-token matches, 52% of 2-token ones
              and 83% of 3-token ones: one acceptance for all of them drafted where it lost and
              held back where it paid); a model drafter's guesses are one class.
A round of k drafts is expected to give E(k) = 1 + sum_i prod_{j<=i} a_j tokens. The chosen length
is the k that makes the engine the most tokens a second: the step's tokens (this sequence's E(k),
the other decoding sequences' one each) over its time (a plain step's, plus what the k rows add to
it and this sequence's share of the drafting), else 0 where no k beats a plain step: the sequence
decodes plainly. Not the k with the most seconds saved a round: that favours long rounds (on the
packaged model's repeat task with all but 2% of drafts kept, a round of 8 drafts saved 14 ms and
one of 4 saved 9, but the 9-row step took 10.3 ms against the 5-row step's 5.3: 0.85 tokens a
millisecond against 0.92, and at up to 8 drafts the task ran 2.0x plain against 2.25x at 4).
A round pays exactly when its net is positive: (E(k) - 1) plain tokens' worth (a plain step's
time over its sequences) exceeds what the k rows add and the drafting. A proposer may make fewer
drafts than asked (the self-draft none where it is unsure, a lookup a shorter match): the rows
are counted at the share of asked drafts it made, measured like acceptance (`_Made`).

At 0 it keeps learning. A free proposer (n-gram lookup) still proposes at every plain step and
its proposal is scored against the tokens the target then decodes (a shadow round: nothing is
verified, nothing is spent); a costly one (a draft model, the self-draft) gets a one-draft probe
round now and then, spaced out further each time it fails. A new sequence starts at the spacing
the engine's probes last reached: restarting at 8 plain steps, every 64-token reply paid three
probes (at 8, 24 and 56 steps), each a draft forward and a verified row, ~2% of its steps, about
what the self-draft lost on the packaged model's free chat (0.973x in two runs). Between probes
a costly proposer's sequence needs nothing computed for it (`may_draft_next`).

Each round's saving is measured the same way, after the fact: the tokens it gave beyond the
first at a plain token's time, less the step's time beyond a plain step's of its other rows and
its share of the drafting (`RoundOutcome`).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# Until the engine has timed steps of two row counts, a verification row is taken to cost this
# share of a one-row decode step (kvk reads the weights once per step: rows cost their activations
# and attention; measured on the packaged model at 2 cores between 0.05 and 0.3 of a step).
PRIOR_ROW_COST = 0.2
# A cost is the median of its last few timings: a step slowed by the machine (or the first one,
# which pays one-off costs) moves a median less than an average, and recent ones follow the
# context's growth.
TIMINGS_KEPT = 15
ACCEPTANCE_DECAY = 0.85  # per round: the acceptance of the last ~7 rounds counts
# The engine's own, over every sequence (a new sequence's prior): the last ~50 rounds. At 0.85 it
# was the last few probes' luck: on the packaged model's chat the self-draft's made drafts were
# kept 27% of the time over a reply's 26 rounds, and its prior ended at 9% on the last ones, so
# every later sequence started sure that drafting did not pay and probed too rarely to learn.
SEEN_DECAY = 0.98
PROBE_FIRST, PROBE_MOST = 8, 64  # plain steps before a probe round; doubled after each failure
MAX_ROWS_TRACKED = 64


@dataclass(slots=True)
class RowTimings:
    """A time by a step's rows: the median of its last timings at each row count measured, and
    between or beyond them on the line through the nearest two."""

    _by_rows: dict[int, float] = field(default_factory=dict)
    _timings: dict[int, deque[float]] = field(default_factory=dict)
    _stale: set[int] = field(default_factory=set)  # row counts timed since their median was taken

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or rows > MAX_ROWS_TRACKED or seconds <= 0:
            return
        self._timings.setdefault(rows, deque(maxlen=TIMINGS_KEPT)).append(seconds)
        self._stale.add(rows)  # every step is timed; its median is taken when a choice reads it

    @property
    def by_rows(self) -> dict[int, float]:
        """The median of the last timings at each row count measured."""
        for rows in self._stale:
            self._by_rows[rows] = statistics.median(self._timings[rows])
        self._stale.clear()
        return self._by_rows

    def at(self, rows: int) -> float | None:
        """Measured, else on the line through the nearest measured row counts, else from the one
        measured with the prior row cost; None before any."""
        by_rows = self.by_rows
        if rows in by_rows:
            return by_rows[rows]
        if not by_rows:
            return None
        known = sorted(by_rows)
        if len(known) == 1:
            r0 = known[0]
            t0 = by_rows[r0]
            one = t0 / (1 + PRIOR_ROW_COST * (r0 - 1))
            return one * (1 + PRIOR_ROW_COST * (rows - 1))
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            a, b = below[-1], above[0]
        elif below:
            a, b = below[-2], below[-1]
        else:
            a, b = above[0], above[1]
        ta, tb = by_rows[a], by_rows[b]
        slope = max(0.0, (tb - ta) / (b - a))
        return max(1e-9, ta + slope * (rows - a))


@dataclass(slots=True)
class StepCosts:
    """The engine's measured decode and verification steps by rows, whole (scheduling, forward,
    postprocessing: a round's rows add to each, 0.12 ms of postprocessing at one row and 0.38 at
    five on the packaged model, a tenth of what its drafts add to a step) and their
    postprocessing alone, and its drafting time per draft forward: medians of their last timings."""

    steps: RowTimings = field(default_factory=RowTimings)
    postprocessing: RowTimings = field(default_factory=RowTimings)
    draft_forward_s: float | None = None
    _drafts: deque[float] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))

    def observe_step(self, rows: int, seconds: float, postprocess_s: float = 0.0) -> None:
        """A step of `rows` rows took `seconds`, `postprocess_s` of them postprocessing."""
        self.steps.observe(rows, seconds)
        self.postprocessing.observe(rows, postprocess_s)

    def observe_drafting(self, forwards: int, seconds: float) -> None:
        if forwards < 1:
            return
        self._drafts.append(seconds / forwards)
        self.draft_forward_s = statistics.median(self._drafts)

    @property
    def known(self) -> bool:
        return bool(self.steps.by_rows)

    def step(self, rows: int) -> float | None:
        """A decode step's whole time at `rows` rows (None before any was timed)."""
        return self.steps.at(rows)

    def postprocess(self, rows: int) -> float:
        """Its postprocessing (0 until timed)."""
        return self.postprocessing.at(rows) or 0.0

    def row_cost(self, rows: int, extra: int) -> float | None:
        """What `extra` more rows add to a step of `rows` rows."""
        base, wider = self.step(rows), self.step(rows + extra)
        if base is None or wider is None:
            return None
        return max(0.0, wider - base)


@dataclass(slots=True)
class _Acceptance:
    kept: list[float] = field(default_factory=list)  # decayed count of rounds keeping draft j
    reached: list[float] = field(default_factory=list)  # ... of rounds that examined draft j
    prior: float = 0.5  # the acceptance assumed before any round (one round's weight)
    decay: float = ACCEPTANCE_DECAY

    def record(self, examined: int, accepted: int) -> None:
        """A round (or a shadow round) examined its first `examined` drafts and kept `accepted`."""
        for counts in (self.kept, self.reached):
            for j in range(len(counts)):
                counts[j] *= self.decay
            counts.extend([0.0] * (examined - len(counts)))
        for j in range(examined):
            self.reached[j] += 1.0
            if j < accepted:
                self.kept[j] += 1.0

    def rate(self, j: int) -> float:
        """P(draft j kept | the drafts before it were), with a weak prior at the sequence's mean."""
        total_kept, total_reached = sum(self.kept), sum(self.reached)
        mean = (total_kept + self.prior) / (total_reached + 1.0)
        if j < len(self.reached):
            return (self.kept[j] + mean) / (self.reached[j] + 1.0)
        return mean

    def overall(self) -> float:
        reached = sum(self.reached)
        return sum(self.kept) / reached if reached else 0.0

    def expected_tokens(self, k: int) -> float:
        total, chain = 1.0, 1.0
        for j in range(k):
            chain *= self.rate(j)
            total += chain
        return total


@dataclass(slots=True)
class _Made:
    """The share of the drafts asked for that the proposer made (decayed counts like
    _Acceptance's): a confidence-gated drafter (the self-draft) makes none where it is unsure,
    and a lookup's match may be shorter than asked; a draft not made adds no verified row."""

    made: float = 0.0
    asked: float = 0.0
    decay: float = ACCEPTANCE_DECAY

    def record(self, made: int, asked: int) -> None:
        self.made = self.made * self.decay + made
        self.asked = self.asked * self.decay + asked

    def share(self, prior: float) -> float:
        """With one asked draft's weight at `prior` (the engine's share over every sequence)."""
        return (self.made + prior) / (self.asked + 1.0)


@dataclass(slots=True)
class SequenceTuning:
    """One sequence's draft length and what it was chosen from."""

    draft_length: int
    by_evidence: dict[int, _Acceptance] = field(default_factory=dict)  # class of evidence -> acceptance
    evidence: int = 0  # the class of this step's proposal
    plain_steps: int = 0  # plain steps since the last probe (costly proposers at length 0)
    probe_every: int = PROBE_FIRST
    probing: bool = False
    shadow_at: int = -1  # free proposers at length 0: where the shadow proposal starts
    shadow: list[int] = field(default_factory=list)
    shadow_evidence: int = 0
    saved_s: float = 0.0  # what its rounds saved (or lost: negative), measured
    made: _Made = field(default_factory=_Made)  # drafts made of those asked
    # whether a round was recorded since its length was last chosen: a costly proposer at length
    # 0 learns only from its probes, so its length is chosen again only after one (the choice
    # every plain step was ~1% of a packaged-model step: a self-draft that never drafted ran
    # 2.2% slower than plain decoding, the tuner's part of it)
    rounds_since_choice: bool = True

    def overall(self) -> float:
        """The share of its examined drafts kept, every class together."""
        reached = sum(sum(a.reached) for a in self.by_evidence.values())
        return sum(sum(a.kept) for a in self.by_evidence.values()) / reached if reached else 0.0


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    saved_s: float  # this round's saving against plain decoding (negative: a loss)
    draft_s: float  # its share of the drafting


class DraftTuner:
    """The draft lengths of an engine's sequences (`adaptive`), or the configured one always."""

    def __init__(self, most: int, adaptive: bool, free_proposer: bool):
        self.most, self.adaptive, self.free = most, adaptive, free_proposer
        self.costs = StepCosts()
        self._seqs: dict[int, SequenceTuning] = {}
        self.seen: dict[int, _Acceptance] = {}  # per class, every sequence's rounds: a new one's prior
        self.probe_start = PROBE_FIRST  # a new sequence's probe spacing: where the last probe left it
        self.made = _Made(decay=SEEN_DECAY)  # every sequence's drafts made of those asked: a prior

    def tuning(self, seq_id: int) -> SequenceTuning:
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = SequenceTuning(self.most, probe_every=self.probe_start)
        return state

    def _acceptance(self, state: SequenceTuning, evidence: int) -> _Acceptance:
        """A sequence's acceptance in one class, started from the engine's in that class."""
        acceptance = state.by_evidence.get(evidence)
        if acceptance is None:
            seen = self.seen.get(evidence)
            prior = seen.overall() if seen is not None and sum(seen.reached) > 0 else _Acceptance().prior
            acceptance = state.by_evidence[evidence] = _Acceptance(prior=prior)
        return acceptance

    def _record(
        self, state: SequenceTuning, examined: int, accepted: int, evidence: int | None = None
    ) -> None:
        """A round in the class of this step's proposal (or `evidence`: a shadow round's)."""
        cls = state.evidence if evidence is None else evidence
        state.rounds_since_choice = True
        self._acceptance(state, cls).record(examined, accepted)
        self.seen.setdefault(cls, _Acceptance(decay=SEEN_DECAY)).record(examined, accepted)

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    # ---- before the step ---------------------------------------------------------------------
    def choose(self, seq_id: int, decoding: int, cap: int, evidence: int = 0) -> int:
        """The draft length for this step of a sequence among `decoding` decoding sequences, at
        most `cap` (its tokens left), for a proposal of class `evidence` (Proposer.evidence).
        0: plain decoding this step."""
        state = self.tuning(seq_id)
        state.probing = False
        state.evidence = evidence
        if cap <= 0:
            return 0
        if not self.adaptive:
            return min(self.most, cap)
        if not self.costs.known:
            return 0  # the first decode step is plain: it times a plain step
        if self.free or state.draft_length > 0 or state.rounds_since_choice:
            state.draft_length = self._best(state, decoding)
            state.rounds_since_choice = False
        if state.draft_length == 0 and not self.free:
            state.plain_steps += 1
            if state.plain_steps >= state.probe_every:
                state.plain_steps = 0
                state.probing = True
                return 1
        return min(state.draft_length, cap)

    def may_draft_next(self, seq_id: int) -> bool:
        """Whether the sequence's next step may ask for drafts. False only for a costly
        proposer's sequence at length 0 whose next plain step is not a probe (its length is
        chosen again only after a round): what this step computes for a drafter (the hidden
        state the self-draft reads) it can then skip. Measured on the packaged model, keeping
        and handing over that state at every step was ~1% of a step."""
        state = self._seqs.get(seq_id)
        if self.free or not self.adaptive or state is None or not self.costs.known:
            return True
        return (
            state.draft_length > 0
            or state.probing
            or state.rounds_since_choice
            or state.plain_steps + 1 >= state.probe_every
        )

    def _best(self, state: SequenceTuning, decoding: int) -> int:
        """The draft length that gives the step the most tokens a second (0: a plain step's)."""
        decoding = max(1, decoding)
        plain = self.costs.step(decoding)
        if plain is None:
            return self.most
        acceptance = self._acceptance(state, state.evidence)
        best_k, best_rate = 0, decoding / plain
        made = self._made_share(state)
        for k in range(1, self.most + 1):
            rows = self.costs.row_cost(decoding, k)
            if rows is None:
                return self.most
            tokens = decoding - 1 + acceptance.expected_tokens(k)
            # the rows the drafts made add (a step's time is near linear in its rows)
            rate = tokens / (plain + rows * made + self._drafting(k, decoding))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _made_share(self, state: SequenceTuning) -> float:
        """The share of asked drafts the proposer makes for this sequence, from the engine's."""
        prior = self.made.share(1.0) if self.made.asked > 0 else 1.0
        return state.made.share(prior)

    def _record_made(self, state: SequenceTuning, made: int, asked: int) -> None:
        state.made.record(made, asked)
        self.made.record(made, asked)

    def _drafting(self, k: int, decoding: int) -> float:
        """A sequence's share of drafting k tokens: a model drafter runs k forwards for all the
        decoding sequences at once; a lookup is one call per step whatever k (0 until timed)."""
        per = self.costs.draft_forward_s or 0.0
        return (per if self.free else k * per) / max(1, decoding)

    # ---- shadow rounds (a free proposer at length 0) --------------------------------------------
    def wants_shadow(self, seq_id: int) -> bool:
        state = self.tuning(seq_id)
        return self.adaptive and self.free and state.shadow_at < 0

    def start_shadow(self, seq_id: int, at: int, drafts: list[int], evidence: int = 0) -> None:
        state = self.tuning(seq_id)
        if drafts:
            state.shadow_at, state.shadow, state.shadow_evidence = at, list(drafts), evidence

    def score_shadow(self, seq_id: int, tokens: list[int]) -> None:
        """Score a pending shadow proposal against the committed tokens once it is decided."""
        state = self._seqs.get(seq_id)
        if state is None or state.shadow_at < 0:
            return
        decoded = tokens[state.shadow_at : state.shadow_at + len(state.shadow)]
        agreed = 0
        while agreed < len(decoded) and decoded[agreed] == state.shadow[agreed]:
            agreed += 1
        if agreed < len(decoded) or len(decoded) == len(state.shadow):
            self._record(state, min(agreed + 1, len(state.shadow)), agreed, state.shadow_evidence)
            state.shadow_at, state.shadow = -1, []

    # ---- after the step ----------------------------------------------------------------------
    def observe_step(
        self, rows: int, seconds: float, postprocess_s: float, drafting_s: float, draft_forwards: int
    ) -> None:
        """A decode-only step's rows and time (drafting apart; `postprocess_s` of it
        postprocessing), and its drafting."""
        self.costs.observe_step(rows, seconds, postprocess_s)
        self.costs.observe_drafting(draft_forwards, drafting_s)

    def round_done(
        self,
        seq_id: int,
        drafted: int,
        accepted: int,
        step_rows: int,
        step_s: float,
        decoding: int,
        draft_share_s: float,
        asked: int = 0,
    ) -> RoundOutcome:
        """A verified round: its acceptance recorded, and what it saved measured against a plain
        step of the other rows. `step_s`: its step up to the postprocessing it is part of, which
        is not over yet; the postprocessing of steps of as many rows is added. `asked`: the
        drafts asked for; a proposer that stopped short of them (a draft below its confidence
        threshold) made a forward that gives nothing, which counts as a rejected draft:
        acceptance is then the share of draft positions that save a step, what a round's net
        needs."""
        state = self.tuning(seq_id)
        examined = min(accepted + 1, max(drafted, asked))
        self._record(state, examined, accepted)
        self._record_made(state, drafted, max(drafted, asked))
        if state.probing:
            self._probed(state, kept=accepted > 0)
        without = self.costs.step(max(1, step_rows - drafted))
        plain = self.costs.step(max(1, decoding))
        saved = 0.0
        if without is not None and plain is not None:
            whole = step_s + self.costs.postprocess(step_rows)
            saved = accepted * plain / max(1, decoding) - max(0.0, whole - without) - draft_share_s
        state.saved_s += saved
        return RoundOutcome(saved, draft_share_s)

    def nothing_drafted(self, seq_id: int, asked: int = 1) -> None:
        """The proposer made none of the `asked` drafts (its first was below its confidence
        threshold): a rejected first draft that added no row, and a failed probe (spaced out
        further)."""
        state = self.tuning(seq_id)
        self._record(state, 1, 0)
        self._record_made(state, 0, asked)
        if state.probing:
            self._probed(state, kept=False)

    def _probed(self, state: SequenceTuning, kept: bool) -> None:
        """A probe round's outcome: the spacing back to the first after a kept draft, else
        doubled; the engine's next sequences start where it is now."""
        state.probe_every = PROBE_FIRST if kept else min(PROBE_MOST, state.probe_every * 2)
        self.probe_start = state.probe_every

    def acceptance(self, seq_id: int) -> float:
        return self.tuning(seq_id).overall()
