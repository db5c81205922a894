"""The sampler: a pipeline of logit stages for one sequence, with optional per-stage snapshots.

Order (the one the probability panel draws, left to right): repetition penalty, presence
penalty, frequency penalty, temperature, top-k, top-p, min-p. A stage the params leave neutral
is not in the pipeline at all. Temperature 0 means greedy: the argmax of the penalized logits
(the truncation stages are skipped, as they cannot change the argmax).

transformers' own `LogitsProcessor` classes do the work where they exist; the OpenAI-style
presence and frequency penalties have no transformers class and are written here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from engine.config import SamplingParams
from engine.events import StageSnapshot, TokenSnapshot

PENALTY_STAGES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
WARPER_STAGES = ("temperature", "top_k", "top_p", "min_p")
# Raw logits kept in a snapshot for what-if: enough that the tail beyond them is usually
# negligible, small enough to ship with every token.
WHAT_IF_TOP = 256
# Masses are float32 sums of softmax outputs whose inputs were themselves rounded: a set whose
# mass is within this of top_p counts as reaching it, so that e.g. p=0.8 over probabilities
# [0.5, 0.3, 0.15, 0.05] keeps two tokens whatever constant the logits are offset by.
TOP_P_TOLERANCE = 1e-5
# what-if: the smallest tail mass it trusts; float64 rounding of 1 - (known mass) is ~1e-14.
MIN_TAIL_MASS = 1e-13


class SamplingError(RuntimeError):
    """The logits cannot be sampled from (e.g. the model produced NaN)."""


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: float  # log-prob of the token under the final distribution
    snapshot: TokenSnapshot | None


class PresencePenalty:
    """OpenAI presence penalty: subtract `penalty` once from every token already generated."""

    def __init__(self, penalty: float):
        self.penalty = penalty

    def __call__(self, output_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, output_ids, True)
        return scores - self.penalty * seen


class FrequencyPenalty:
    """OpenAI frequency penalty: subtract `penalty` once per occurrence in the generated text."""

    def __init__(self, penalty: float):
        self.penalty = penalty

    def __call__(self, output_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores).scatter_add_(
            1, output_ids, torch.ones_like(output_ids, dtype=scores.dtype)
        )
        return scores - self.penalty * counts


class TopP:
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches `top_p`.

    Same rule as transformers' `TopPLogitsWarper` (which it equals away from exact boundaries),
    but a token's fate is decided by the mass strictly above it, with `TOP_P_TOLERANCE`, instead
    of by an ascending float32 cumsum compared exactly against 1 - top_p: there, whether
    probabilities [0.5, 0.3, ...] with p=0.8 keep 2 or 3 tokens depends on rounding.
    """

    def __init__(self, top_p: float):
        self.top_p = top_p

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        # After top-k only a few tokens are left: ranking just those is far cheaper than
        # sorting the whole vocabulary (removed tokens carry no mass and need no decision).
        alive = int((scores[0] > -math.inf).sum())
        if alive < scores.shape[-1] // 2:
            sorted_logits, order = torch.topk(scores, alive, dim=-1)
        else:
            sorted_logits, order = torch.sort(scores, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_above >= self.top_p - TOP_P_TOLERANCE
        drop_sorted[..., 0] = False  # the likeliest token always stays
        drop = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, drop_sorted)
        return scores.masked_fill(drop, -math.inf)


@dataclass(frozen=True, slots=True)
class _Stage:
    name: str
    processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [1, L], scores [1, V])
    # Which token history the stage reads: the CTRL repetition penalty counts the prompt too,
    # the OpenAI penalties only what the model generated; warpers read none.
    history: str  # "prompt+output" | "output" | "none"


def enabled_warpers(params: SamplingParams) -> list[tuple[str, float]]:
    """The temperature/truncation stages the params switch on, in pipeline order (none if greedy)."""
    if params.greedy:
        return []
    wanted = [
        ("temperature", float(params.temperature), params.temperature != 1.0),
        ("top_k", params.top_k, params.top_k > 0),
        ("top_p", float(params.top_p), params.top_p < 1.0),
        ("min_p", float(params.min_p), params.min_p > 0.0),
    ]
    return [(name, value) for name, value, on in wanted if on]


def build_stages(params: SamplingParams) -> list[_Stage]:
    stages = []
    if params.repetition_penalty != 1.0:
        rep = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))
        stages.append(_Stage("repetition_penalty", rep, "prompt+output"))
    if params.presence_penalty != 0.0:
        stages.append(_Stage("presence_penalty", PresencePenalty(params.presence_penalty), "output"))
    if params.frequency_penalty != 0.0:
        stages.append(_Stage("frequency_penalty", FrequencyPenalty(params.frequency_penalty), "output"))
    warper_classes = {
        "temperature": TemperatureLogitsWarper,
        "top_k": TopKLogitsWarper,
        "top_p": TopP,
        "min_p": MinPLogitsWarper,
    }
    for name, value in enabled_warpers(params):
        stages.append(_Stage(name, warper_classes[name](value), "none"))
    return stages


def _history_tensor(ids: Sequence[int], vocab: int, device: torch.device) -> torch.LongTensor:
    t = torch.as_tensor(list(ids), dtype=torch.long, device=device).reshape(1, -1)
    # Embedding tables can be larger than the LM head; ids the head cannot produce need no penalty.
    return t[t < vocab].reshape(1, -1)


class Sampler:
    """Samples one sequence's next token from its logits under fixed `SamplingParams`."""

    def __init__(self, params: SamplingParams, decode_token: Callable[[int], str] | None = None):
        self.params = params
        self.stages = build_stages(params)
        self._decode_token = decode_token or (lambda token_id: f"#{token_id}")
        self._generator: torch.Generator | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        # Made lazily: the logits' device is only known at the first call.
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            if self.params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.params.seed)
        return self._generator

    def sample(
        self, logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> SampleResult:
        scores = logits.detach().to(torch.float32).reshape(1, -1)
        want_snapshot = self.params.snapshot_top_n > 0
        if self.params.greedy and not self.stages and not want_snapshot:
            # The hot path of plain greedy decoding: an argmax and one log-sum-exp.
            token = int(scores[0].argmax())
            return SampleResult(token, self._checked(float(scores[0, token] - scores[0].logsumexp(0))), None)

        scores, trace, penalized = self._process(scores, prompt_ids, output_ids, want_snapshot)
        if self.params.greedy:
            token = int(scores[0].argmax())
        else:
            token = self.draw(torch.softmax(scores[0], dim=0))
        return self._result(scores, trace, penalized, token)

    def distribution(
        self, logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> torch.Tensor:
        """The final sampling distribution [V] after every stage (one-hot at the argmax when
        greedy): the p (or q) of speculative verification."""
        scores = logits.detach().to(torch.float32).reshape(1, -1)
        scores, _, _ = self._process(scores, prompt_ids, output_ids, want_trace=False)
        if self.params.greedy:
            return torch.zeros_like(scores[0]).scatter_(0, scores[0].argmax().reshape(1), 1.0)
        return torch.softmax(scores[0], dim=0)

    def penalize(
        self, scores: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> torch.Tensor:
        """The penalty stages alone on scores [1, V] (beam search runs them on log-probs, as
        transformers does); greedy params have no other stages."""
        if not self.stages:
            return scores
        return self._process(scores, prompt_ids, output_ids, want_trace=False)[0]

    def draw(self, probs: torch.Tensor) -> int:
        """One token from a probability vector, with this request's generator (seeded or not)."""
        if not bool(torch.isfinite(probs).all()):
            self._checked(math.nan)
        return int(torch.multinomial(probs, 1, generator=self._generator_for(probs.device)))

    def uniform(self) -> float:
        """A U(0, 1) draw from this request's generator (speculative acceptance tests)."""
        return float(torch.rand((), generator=self._generator_for(torch.device("cpu"))))

    def result_for(
        self, logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int], token: int
    ) -> SampleResult:
        """Logprob (and snapshot, when asked) of a token chosen elsewhere, e.g. by the
        speculative verifier, under this request's pipeline."""
        scores = logits.detach().to(torch.float32).reshape(1, -1)
        scores, trace, penalized = self._process(
            scores, prompt_ids, output_ids, self.params.snapshot_top_n > 0
        )
        return self._result(scores, trace, penalized, token)

    def _process(self, scores, prompt_ids, output_ids, want_trace: bool):
        """Run the stages; returns the final scores [1, V], the per-stage trace (or None) and
        the scores after the penalty stages."""
        trace = [("raw", scores)] if want_trace else None
        penalized = scores
        histories: dict[str, torch.LongTensor] = {}
        for stage in self.stages:
            if stage.history == "none":
                ids = None
            elif stage.history not in histories:
                ids = [*prompt_ids, *output_ids] if stage.history == "prompt+output" else output_ids
                ids = histories[stage.history] = _history_tensor(ids, scores.shape[1], scores.device)
            else:
                ids = histories[stage.history]
            scores = stage.processor(ids, scores)
            if stage.name in PENALTY_STAGES:
                penalized = scores
            if trace is not None:
                trace.append((stage.name, scores))
        return scores, trace, penalized

    def _result(self, scores, trace, penalized, token: int) -> SampleResult:
        logprob = self._checked(float(scores[0, token] - scores[0].logsumexp(0)))
        snapshot = None
        if trace is not None:
            snapshot = _snapshot(trace, penalized[0], token, self.params.snapshot_top_n, self._decode_token)
        return SampleResult(token, logprob, snapshot)

    @staticmethod
    def _checked(logprob: float) -> float:
        if math.isnan(logprob):
            raise SamplingError(
                "the model produced invalid logits (NaN), so no token can be chosen; "
                "this usually means the weights overflowed in this dtype: try float32"
            )
        return logprob


def _snapshot(
    trace: list[tuple[str, torch.Tensor]],
    penalized: torch.Tensor,
    drawn: int,
    top_n: int,
    decode_token: Callable[[int], str],
) -> TokenSnapshot:
    raw = trace[0][1][0]
    vocab = raw.numel()
    top_logits, top_ids = torch.topk(raw, min(vocab, max(top_n, WHAT_IF_TOP)))
    candidates = top_ids[: min(top_n, vocab)]
    if not bool((candidates == drawn).any()):
        candidates = torch.cat([candidates, torch.tensor([drawn], device=candidates.device)])

    # Build every number as a tensor first and move them to Python in one go: on a GPU each
    # separate .item() would be a device sync.
    probs_rows, removed_rows, kept_counts, kept_masses = [], [], [], []
    prev_probs = prev_alive = None
    for _, scores in trace:
        s = scores[0]
        alive = s > -math.inf
        probs = torch.softmax(s, dim=0)
        probs_rows.append(probs[candidates])
        kept_counts.append(alive.sum())
        if prev_probs is None:
            removed_rows.append(torch.zeros_like(candidates, dtype=torch.bool))
            kept_masses.append(probs.new_ones(()))
        else:
            removed_rows.append(prev_alive[candidates] & ~alive[candidates])
            kept_masses.append(prev_probs[alive].sum())
        prev_probs, prev_alive = probs, alive
    final_probs = prev_probs
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
    probs_rows = torch.stack(probs_rows).tolist()
    removed_rows = torch.stack(removed_rows).tolist()
    kept_counts = torch.stack(kept_counts).tolist()
    kept_masses = torch.stack(kept_masses).tolist()
    stages = tuple(
        StageSnapshot(name, tuple(p), tuple(r), int(n), float(m))
        for (name, _), p, r, n, m in zip(trace, probs_rows, removed_rows, kept_counts, kept_masses)
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
    )


def what_if(snapshot: TokenSnapshot, params: SamplingParams) -> tuple[StageSnapshot, ...]:
    """Recompute a recorded token's temperature/top-k/top-p/min-p stages under other `params`.

    Works from the snapshot alone (no model), so it is an approximation, labelled "what-if" in
    the app:
    - Only the top raw logits kept in the snapshot (`raw_top_ids`, 256 or more) are known one by
      one. The rest of the vocabulary (the tail) is known only through its total probability,
      implied by `raw_logsumexp`; it is modelled as that many tokens sharing the tail mass
      equally, each below every known token. Where the tail mass is negligible the result equals
      the real pipeline's; otherwise a heavy tail is spread more evenly than it really is.
    - Penalties cannot be recomputed (the token history is not in the snapshot): the recorded
      "raw" and penalty stages are returned as they were, and the new warpers act on the
      recorded penalized logits of the known tokens; the tail is taken as untouched by the
      penalties (exact when every penalized token is among the known ones). A candidate
      outside the known top set gets one tail token's share.
    With greedy params (temperature 0) only the recorded raw and penalty stages remain.
    """
    recorded = tuple(s for s in snapshot.stages if s.name == "raw" or s.name in PENALTY_STAGES)
    warpers = enabled_warpers(params)
    if not warpers or not snapshot.raw_top_ids:
        return recorded
    dist = _TruncatedDistribution(snapshot)
    return recorded + tuple(dist.apply(name, value) for name, value in warpers)


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
