"""Beam search bookkeeping, step for step the algorithm of transformers' `_beam_search`.

Pure tensors and token lists, no model and no KV cache: the engine runs the K beams' forwards
through the paged cache and hands `step` their log-probs; `step` says which beam each new beam
extends with which token, which hypotheses finished, and whether the search is over. Matching
transformers 5.x exactly (same float32 operations in the same order, so the same top-k ties):

- scores: log_softmax(logits) (then the penalty processors) + each beam's running sum;
- candidates: top `max(2, 1 + n_eos) * K` over all K * V continuations, so at least K of them do
  not end (EOS) and the search can go on;
- running beams: the best K candidates that did not hit a stopping criterion;
- finished hypotheses: those of the first K candidates that hit one (EOS, or max_new_tokens),
  scored sum / generated_len ** length_penalty, kept in a best-K set;
- the end: when the kept set cannot improve (early_stopping True: it is full; False: the best
  running beam at its current length cannot beat the worst kept one; "never": nor at the most
  favourable length), or every candidate hit a criterion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# transformers' stand-in for "impossible" in float32 score arithmetic.
NEG = -1.0e9


@dataclass(frozen=True, slots=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens (the last may be EOS)
    score: float  # length-penalised; for a running beam cut short, its running sum


@dataclass(frozen=True, slots=True)
class StepResult:
    parents: tuple[int, ...]  # for each new running beam, the slot it extends
    tokens: tuple[int, ...]  # and the token it adds
    scores: tuple[float, ...]  # its running sum of log-probs
    finished: tuple[tuple[int, int, float], ...]  # (parent slot, token, score) newly kept
    done: bool


class BeamSearch:
    def __init__(
        self,
        num_beams: int,
        eos_ids: set[int] | frozenset[int],
        max_new_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ):
        self.k = num_beams
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self.max_new_tokens = max_new_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.beams_to_keep = max(2, 1 + len(self.eos)) * num_beams
        self.top_num_beam_mask = torch.arange(self.beams_to_keep) < num_beams
        # Running beams: all start as the prompt; only the first counts at step 0 (the others'
        # NEG keeps the K identical rows from giving K identical candidates).
        self.running_scores = torch.full((num_beams,), NEG, dtype=torch.float32)
        self.running_scores[0] = 0.0
        self.running: list[tuple[int, ...]] = [()] * num_beams
        # The kept set of finished hypotheses (slots not yet filled hold NEG and are unfinished).
        self.kept: list[tuple[int, ...]] = [()] * num_beams
        self.kept_scores = torch.full((num_beams,), NEG, dtype=torch.float32)
        self.kept_finished = torch.zeros(num_beams, dtype=torch.bool)
        self.heuristic_unsatisfied = True
        self.generated = 0  # tokens of each running beam
        self.done = False

    def step(self, log_probs: torch.Tensor, length_capped: bool = False) -> StepResult:
        """Advance by one token. `log_probs` [K, V]: row j for running slot j (at step 0 every
        row is the prompt's). `length_capped`: the context is full after this token."""
        k, vocab = self.k, log_probs.shape[-1]
        # [1, K * V] and [1, ...] shapes below as in transformers (batch of one), so torch.topk
        # breaks ties the same way.
        accumulated = (log_probs.float() + self.running_scores[:, None]).reshape(1, -1)
        top_scores, top_index = (x[0] for x in torch.topk(accumulated, k=self.beams_to_keep))
        parents = top_index // vocab
        tokens = top_index % vocab
        candidates = [self.running[p] + (t,) for p, t in zip(parents.tolist(), tokens.tolist())]
        hits = torch.isin(tokens, self.eos)
        if self.generated + 1 >= self.max_new_tokens or length_capped:
            hits = torch.ones_like(hits)

        # e. the next running beams: the best K candidates that go on
        running_scores = top_scores + hits.to(torch.float32) * NEG
        next_index = torch.topk(running_scores[None], k=k)[1][0]
        self.running = [candidates[i] for i in next_index.tolist()]
        self.running_scores = running_scores[next_index]
        new_parents = parents[next_index]
        new_tokens = tokens[next_index]

        # f. finished hypotheses of the first K candidates join the kept set if good enough
        just_finished = hits & self.top_num_beam_mask
        finished_scores = top_scores / ((self.generated + 1) ** self.length_penalty)
        kept_full = bool(self.kept_finished.all()) and self.early_stopping is True
        finished_scores = finished_scores + float(kept_full) * NEG
        finished_scores = finished_scores + float(not self.heuristic_unsatisfied) * NEG
        finished_scores = finished_scores + (~just_finished) * NEG
        merged = self.kept + candidates
        merged_scores = torch.cat((self.kept_scores, finished_scores))
        merged_finished = torch.cat((self.kept_finished, just_finished))
        keep = torch.topk(merged_scores[None], k=k)[1][0]
        newly_kept = [
            (int(parents[i - k]), int(tokens[i - k]), float(merged_scores[i]))
            for i in keep.tolist()
            if i >= k and bool(merged_finished[i])
        ]
        self.kept = [merged[i] for i in keep.tolist()]
        self.kept_scores = merged_scores[keep]
        self.kept_finished = merged_finished[keep]

        # g. can the search still improve?
        self.generated += 1
        self.heuristic_unsatisfied = self._improvement_possible()
        open_beam = not (bool(self.kept_finished.all()) and self.early_stopping is True)
        self.done = not (self.heuristic_unsatisfied and open_beam and not bool(hits.all()))
        return StepResult(
            parents=tuple(new_parents.tolist()),
            tokens=tuple(new_tokens.tolist()),
            scores=tuple(self.running_scores.tolist()),
            finished=tuple(newly_kept),
            done=self.done,
        )

    def _improvement_possible(self) -> bool:
        """transformers' `_check_early_stop_heuristic` (see its docstring for the reasoning)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.generated
        best_running = self.running_scores[:1] / (best_length**self.length_penalty)
        worst_kept = torch.where(self.kept_finished, torch.min(self.kept_scores), NEG)
        return self.heuristic_unsatisfied and bool(torch.any(best_running > worst_kept))

    def ranked(self) -> list[Hypothesis]:
        """The kept hypotheses, best first (the search keeps them sorted)."""
        return [Hypothesis(t, float(s)) for t, s in zip(self.kept, self.kept_scores.tolist())]

    def running_ranked(self) -> list[Hypothesis]:
        """The running beams by running score, best first (for a search cut short)."""
        order = torch.argsort(self.running_scores, descending=True, stable=True).tolist()
        return [Hypothesis(self.running[i], float(self.running_scores[i])) for i in order]
