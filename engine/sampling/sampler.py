"""The sampler: a pipeline of logit stages for one sequence, with optional per-stage snapshots.

The stages and their order are engine.sampling.stages. Temperature 0 means greedy: the argmax
of the penalized logits (the truncation stages are skipped, as they cannot change the argmax).
A sequence under a grammar passes its `TokenMask` (engine.sampling.mask): the mask is then the
first stage, "grammar", before the penalties, in greedy decoding too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.config import SamplingParams
from engine.events import TokenSnapshot
from engine.kernels import native
from engine.sampling.mask import GRAMMAR_STAGE, TokenMask, apply_mask
from engine.sampling.snapshot import take_snapshot
from engine.sampling.stages import PENALTY_STAGES, build_stages


class SamplingError(RuntimeError):
    """The logits cannot be sampled from (e.g. the model produced NaN)."""


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: float  # log-prob of the token under the final distribution
    snapshot: TokenSnapshot | None


def _history_tensor(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.long, device=device).reshape(1, -1)
    # Embedding tables can be larger than the LM head; ids the head cannot produce need no penalty.
    return t[t < vocab].reshape(1, -1)


def greedy_row(row: torch.Tensor) -> tuple[int, float]:
    """(first index of the largest, log-sum-exp) of one float32 score row: plain greedy decoding's
    token and its normalizer. One C call where kvk runs (torch's argmax and logsumexp took
    0.1-0.3 ms a row); every greedy row, a lone decode's or a speculative round's, takes it here,
    so a round keeps and scores its tokens as decoding one at a time would."""
    lib = native.kernels()
    if lib is not None and row.device.type == "cpu" and row.is_contiguous():
        found = lib.argmax_logsumexp(row)
        if found is not None:
            return found
    return int(row.argmax()), float(row.logsumexp(0))


class Sampler:
    """Samples one sequence's next token from its logits under fixed `SamplingParams`."""

    def __init__(self, params: SamplingParams, decode_token: Callable[[int], str] | None = None):
        self.params = params
        self._decode_token = decode_token or (lambda token_id: f"#{token_id}")
        # One generator per device, made lazily (the logits' device is only known at the first
        # call): draws on the GPU and uniforms on the CPU (XTC's coin, speculative acceptance)
        # each keep their own stream instead of reseeding one another.
        self._generators: dict[torch.device, torch.Generator] = {}
        self.stages = build_stages(params, decode_token=self._decode_token, uniform=self.uniform)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no stage and no snapshot: the token is the raw logits' argmax (the hot
        path of sampling, and of verifying a greedy speculative round)."""
        return self.params.greedy and not self.stages and self.params.snapshot_top_n == 0

    def _generator_for(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
            if self.params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.params.seed)
        return generator

    def sample(
        self,
        logits: torch.Tensor,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        mask: TokenMask | None = None,
    ) -> SampleResult:
        scores = logits.detach().to(torch.float32).reshape(1, -1)
        want_snapshot = self.params.snapshot_top_n > 0
        if self.plain_greedy:
            # The hot path of plain greedy decoding: an argmax and one log-sum-exp (after the
            # grammar's mask, when there is one).
            if mask is not None:
                scores = apply_mask(scores, mask)
            row = scores[0]
            token, lse = greedy_row(row)
            return SampleResult(token, self._checked(float(row[token]) - lse), None)

        scores, trace, penalized = self._process(scores, prompt_ids, output_ids, want_snapshot, mask)
        if self.params.greedy:
            token = int(scores[0].argmax())
        else:
            token = self.draw(torch.softmax(scores[0], dim=0))
        return self._result(scores, trace, penalized, token, mask)

    def distribution(
        self,
        logits: torch.Tensor,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        mask: TokenMask | None = None,
    ) -> torch.Tensor:
        """The final sampling distribution [V] after every stage (one-hot at the argmax when
        greedy): the p (or q) of speculative verification."""
        scores = logits.detach().to(torch.float32).reshape(1, -1)
        scores, _, _ = self._process(scores, prompt_ids, output_ids, False, mask)
        if self.params.greedy:
            return torch.zeros_like(scores[0]).scatter_(0, scores[0].argmax().reshape(1), 1.0)
        return torch.softmax(scores[0], dim=0)

    def penalize(
        self,
        scores: torch.Tensor,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        mask: TokenMask | None = None,
    ) -> torch.Tensor:
        """The grammar's mask and the penalty stages alone on scores [1, V] (beam search runs
        them on log-probs, as transformers does); greedy params have no other stages."""
        if not self.stages and mask is None:
            return scores
        return self._process(scores, prompt_ids, output_ids, False, mask)[0]

    def draw(self, probs: torch.Tensor) -> int:
        """One token from a probability vector, with this request's generator (seeded or not)."""
        if not bool(torch.isfinite(probs).all()):
            self._checked(math.nan)
        # among the tokens that can be drawn only: the same distribution, and after top-p or
        # top-k most of a vocabulary cannot (torch draws one exponential per entry: 0.75 ms a
        # token over the packaged model's 49,152 at one thread, 0.05 over a top-p's few dozen)
        support = probs.nonzero().squeeze(1)
        pick = torch.multinomial(probs[support], 1, generator=self._generator_for(probs.device))
        return int(support[pick])

    def uniform(self) -> float:
        """A U(0, 1) draw from this request's generator (speculative acceptance tests)."""
        return float(torch.rand((), generator=self._generator_for(torch.device("cpu"))))

    def result_for(
        self,
        logits: torch.Tensor,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        token: int,
        mask: TokenMask | None = None,
    ) -> SampleResult:
        """Logprob (and snapshot, when asked) of a token chosen elsewhere, e.g. by the
        speculative verifier, under this request's pipeline."""
        scores = logits.detach().to(torch.float32).reshape(1, -1)
        scores, trace, penalized = self._process(
            scores, prompt_ids, output_ids, self.params.snapshot_top_n > 0, mask
        )
        return self._result(scores, trace, penalized, token, mask)

    def greedy_results(
        self, logits: torch.Tensor, tokens: Sequence[int], log_normalizers: Sequence[float]
    ) -> list[SampleResult]:
        """Plain greedy (`plain_greedy`): each row's token and its log-prob, the rows of a
        speculative round (logits [len(tokens), V]) with their log-sum-exps as `greedy_row` took
        them (verify_greedy), so each as `sample` computes a lone row."""
        assert len(log_normalizers) == len(tokens), "a log-sum-exp for each emitted row"
        rows = logits.detach().to(torch.float32)
        return [
            SampleResult(token, self._checked(float(rows[i, token]) - lse), None)
            for i, (token, lse) in enumerate(zip(tokens, log_normalizers))
        ]

    def _process(
        self,
        scores: torch.Tensor,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        want_trace: bool,
        mask: TokenMask | None = None,
    ) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]] | None, torch.Tensor]:
        """Run the stages; returns the final scores [1, V], the per-stage trace (or None) and
        the scores after the penalty stages."""
        trace = [("raw", scores)] if want_trace else None
        if mask is not None:
            scores = apply_mask(scores, mask)
            if trace is not None:
                trace.append((GRAMMAR_STAGE, scores))
        penalized = scores
        histories: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            ids: torch.Tensor | Sequence[int] | None
            if stage.history == "none":
                ids = None
            elif stage.history == "prompt+output tokens":  # our own stages read the ids as they are
                ids = [*prompt_ids, *output_ids]
            elif stage.history == "output tokens":
                ids = output_ids
            elif stage.history not in histories:
                history = [*prompt_ids, *output_ids] if stage.history == "prompt+output" else output_ids
                ids = histories[stage.history] = _history_tensor(history, scores.shape[1], scores.device)
            else:
                ids = histories[stage.history]
            scores = stage.processor(ids, scores)
            if stage.name in PENALTY_STAGES:
                penalized = scores
            if trace is not None:
                trace.append((stage.name, scores))
        return scores, trace, penalized

    def _result(
        self,
        scores: torch.Tensor,
        trace: list[tuple[str, torch.Tensor]] | None,
        penalized: torch.Tensor,
        token: int,
        mask: TokenMask | None = None,
    ) -> SampleResult:
        logprob = self._checked(float(scores[0, token] - scores[0].logsumexp(0)))
        snapshot = None
        if trace is not None:
            snapshot = take_snapshot(
                trace, penalized[0], token, self.params.snapshot_top_n, self._decode_token, mask
            )
        return SampleResult(token, logprob, snapshot)

    @staticmethod
    def _checked(logprob: float) -> float:
        if math.isnan(logprob):
            raise SamplingError(
                "the model produced invalid logits (NaN), so no token can be chosen; "
                "this usually means the weights overflowed in this dtype: try float32"
            )
        return logprob
