"""The engine's side of n-sample and beam-search requests: forks, beam steps, results.

`LLMEngine` runs the forwards and hands over logits; this module decides what the group's
sequences become: samples fork once the prompt is in the cache and then run on their own;
beams re-fork every step from the parents the search picked, and pruned beams free their
blocks. It emits the group events (SequenceForked, SequenceFinished, BeamStep) and the final
RequestFinished with every sequence ranked and the group's memory figures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams
from engine.core.beam_search import BeamSearch, Hypothesis, StepResult
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceGroup
from engine.core.stats import request_stats
from engine.events import (
    BeamStep,
    Event,
    FinishedBeam,
    RequestFailed,
    RequestFinished,
    SequenceFinished,
    SequenceForked,
    SequenceResult,
)
from engine.grammar.state import GrammarDeadEnd
from engine.kv.manager import KVCacheManager
from engine.limits import Limits
from engine.sampling.sampler import Sampler
from engine.text.token_text import TokenText

if TYPE_CHECKING:
    from engine.tools.use import ToolUse

# Forked sequences get ids from here up, so they never equal a request id (the service counts
# from 1, direct engine callers from 1_000_000).
FORK_SEQ_ID_BASE = 1 << 40


class GroupError(ValueError):
    """A group request this engine cannot run; the message is for the user."""


class GroupDriver:
    """Works through narrow collaborators: the event sink, the KV manager (forks share blocks),
    the scheduler (a group's members take each other's places), the table of live sequences,
    the tokenizer's text, and the limits."""

    def __init__(
        self,
        emit: Callable[[Event], None],
        kv: KVCacheManager,
        scheduler: Scheduler,
        seqs: dict[int, Sequence],
        text: TokenText,
        limits: Limits,
    ):
        self.emit, self.kv, self.scheduler, self.seqs = emit, kv, scheduler, seqs
        self.text, self.limits = text, limits
        self.active: dict[int, SequenceGroup] = {}
        self._next_seq_id = FORK_SEQ_ID_BASE
        # A request that offered tools: each of its sequences' replies is read for calls.
        self.tool_reply: Callable[[ToolUse, int, tuple[int, ...], int], None] | None = None

    # ---- start -----------------------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        problem = self.limits.group_refusal(params)
        if problem is not None:
            raise GroupError(problem)

    def start(self, seq: Sequence) -> SequenceGroup:
        params = seq.params
        beam = None
        if params.beam_search:
            eos = set() if params.ignore_eos else self.text.eos_ids
            beam = BeamSearch(
                params.num_beams, eos, params.max_new_tokens, params.length_penalty, params.early_stopping
            )
        group = SequenceGroup(seq.seq_id, params, seq, beam)
        self.active[group.request_id] = group
        return group

    # ---- forks -----------------------------------------------------------------------------
    def _fork(self, group: SequenceGroup, parent: Sequence, branch: int) -> Sequence:
        seq_id, self._next_seq_id = self._next_seq_id, self._next_seq_id + 1
        self.emit(
            SequenceForked(
                group.request_id, parent.seq_id, seq_id, branch, parent.num_tokens, time.perf_counter()
            )
        )
        child = group.fork(parent, seq_id, branch, self.kv)  # emits the "share"
        self.seqs[seq_id] = child
        return child

    def fork_samples(self, group: SequenceGroup) -> list[Sequence]:
        """The prompt is in the cache: n - 1 more samples share its blocks. Returns all n."""
        parent = group.members[0]
        prompt = parent.token_ids[: parent.num_prompt_tokens]
        for branch in range(1, group.size):
            child = self._fork(group, parent, branch)
            child.sampler = Sampler(group.sample_params(branch), decode_token=self.text.text)
            child.detokenizer = self.text.detokenizer(prompt, group.params.stop, parent.makes_text)
            if parent.grammar is not None:
                child.grammar = parent.grammar.fork()
            group.members.append(child)
        group.forked = True
        self.scheduler.replace_members([parent], group.members)
        group.measure_blocks()
        return list(group.members)

    def end_sample(self, seq: Sequence, reason: str, note: str = "") -> None:
        """One sample finished; the request finishes with its last sample."""
        group = seq.group
        assert group is not None, "a sample belongs to its group"
        seq.finish_reason = reason
        if note and not group.note:
            group.note = f"sample {seq.branch}: {note}"
        seq.detokenizer.flush()
        self._drop(group, seq, reason)
        group.ended.append(seq)
        if not group.members:
            self._finish(group, None, self._sample_results(group))

    def _drop(self, group: SequenceGroup, seq: Sequence, reason: str) -> None:
        self.emit(SequenceFinished(group.request_id, seq.seq_id, seq.branch, reason, time.perf_counter()))
        self.scheduler.remove(seq)  # emits the "free"
        self.seqs.pop(seq.seq_id, None)
        group.members.remove(seq)

    # ---- beams -----------------------------------------------------------------------------
    def beam_step(self, group: SequenceGroup, rows: dict[int, int], logits: torch.Tensor, step: int) -> None:
        """All running beams got logits (`rows`: seq_id -> row) in engine step `step`: rank,
        re-fork, prune."""
        members, k = list(group.members), group.size
        prompt = members[0].token_ids[: members[0].num_prompt_tokens]
        log_probs = torch.cat(
            [
                self._beam_scores(seq, torch.log_softmax(logits[rows[seq.seq_id]].float(), -1)[None], prompt)
                for seq in members
            ]
        )
        if members[0].grammar is not None and all(seq.grammar_dead_end for seq in members):
            # No beam can go on under the grammar: the search ends with what it has.
            group.note = members[0].grammar_dead_end
            search = group.search
            finished = [h for h, done in zip(search.ranked(), search.kept_finished.tolist()) if done]
            results = self._beam_results(group, finished, None) if finished else []
            self._finish(
                group, None, results or self._beam_results(group, search.running_ranked(), "grammar")
            )
            return
        if len(members) == 1:
            log_probs = log_probs.expand(k, -1)  # step 0: every beam is the prompt
        capped = members[0].num_tokens + 1 >= self.limits.context_window
        result = group.search.step(log_probs, length_capped=capped)
        slots = members if len(members) == k else members * k
        now = time.perf_counter()
        group.mark_token_step(step, now)
        if result.done:
            # No beam runs again: nothing to fork or extend (the kept hypotheses hold the
            # tokens); each slot is shown on the sequence that holds its parent's blocks.
            self._emit_beam_step(group, result, tuple(slots[p].seq_id for p in result.parents), now)
            self._finish(group, None, self._beam_results(group, group.search.ranked(), None))
            return

        # The first new beam from a parent continues in the parent's sequence; any other forks
        # it (before the parent's new token is appended, so the fork copies the same tokens).
        claimed: set[int] = set()
        new_members = []
        for branch, parent_slot in enumerate(result.parents):
            parent = slots[parent_slot]
            if id(parent) in claimed:
                child = self._fork(group, parent, branch)
                child.sampler = parent.sampler  # greedy: only its penalty stages are used
                if parent.grammar is not None:
                    child.grammar = parent.grammar.fork()  # at the parent's place, before its new token
                child.grammar_dead_end = parent.grammar_dead_end
                new_members.append(child)
            else:
                claimed.add(id(parent))
                new_members.append(parent)
        for seq in members:
            if id(seq) not in claimed:
                self._drop(group, seq, "pruned")
                group.pruned += 1
        for branch, (seq, token, score) in enumerate(zip(new_members, result.tokens, result.scores)):
            seq.branch = branch
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
            self._advance_grammar(seq, token)
        group.members = new_members
        self.scheduler.replace_members(members, new_members)
        group.measure_blocks()
        self._emit_beam_step(group, result, tuple(seq.seq_id for seq in new_members), now)

    def _beam_scores(self, seq: Sequence, log_probs: torch.Tensor, prompt: list[int]) -> torch.Tensor:
        """A beam's log-probs after its grammar's mask and the penalties; a beam its grammar has
        left with no next token can never be extended (every score -inf)."""
        if seq.grammar_dead_end:
            return torch.full_like(log_probs, -math.inf)
        mask = None if seq.grammar is None else seq.grammar.mask()
        return seq.sampler.penalize(log_probs, prompt, seq.output_ids, mask)

    def _advance_grammar(self, seq: Sequence, token: int) -> None:
        """A beam's new token into its grammar (a fork took its own copy before the token). A
        finished grammar permits only EOS next, which ends the beam as a hypothesis."""
        grammar = seq.grammar
        if grammar is None or seq.grammar_dead_end or token in self.text.eos_ids:
            return
        if not grammar.consume(token):
            # the search had fewer possible candidates than beams and filled a slot with one
            seq.grammar_dead_end = f"token {self.text.text(token)!r} does not follow the grammar"
            return
        try:
            grammar.mask()
        except GrammarDeadEnd as exc:
            seq.grammar_dead_end = str(exc)

    def _emit_beam_step(
        self, group: SequenceGroup, result: StepResult, seq_ids: tuple[int, ...], now: float
    ) -> None:
        self.emit(
            BeamStep(
                request_id=group.request_id,
                step=group.search.generated - 1,
                parents=result.parents,
                token_ids=result.tokens,
                token_texts=tuple(self.text.text(t) for t in result.tokens),
                scores=result.scores,
                seq_ids=seq_ids,
                finished=tuple(FinishedBeam(p, t, s) for p, t, s in result.finished),
                done=result.done,
                t=now,
            )
        )

    def _beam_results(
        self, group: SequenceGroup, hyps: list[Hypothesis], reason: str | None
    ) -> list[SequenceResult]:
        eos = set() if group.params.ignore_eos else self.text.eos_ids
        results = []
        for rank, hyp in enumerate(hyps):
            ended_on_eos = bool(hyp.token_ids) and hyp.token_ids[-1] in eos
            text_ids = hyp.token_ids[:-1] if ended_on_eos else hyp.token_ids
            why = reason or ("stop" if ended_on_eos else "length")
            results.append(SequenceResult(rank, self._text(group, text_ids), hyp.token_ids, hyp.score, why))
        return results

    def _text(self, group: SequenceGroup, token_ids: Iterable[int]) -> str:
        first = group.every_seq[0]
        detok = self.text.detokenizer(first.token_ids[: first.num_prompt_tokens])
        for token in token_ids:
            detok.push(token)
        detok.flush()
        return detok.text

    # ---- the end ---------------------------------------------------------------------------
    def _sample_results(self, group: SequenceGroup, reason: str | None = None) -> list[SequenceResult]:
        results = [
            SequenceResult(
                seq.branch,
                seq.detokenizer.text,
                tuple(seq.output_ids),
                seq.cumulative_logprob,
                seq.finish_reason or reason or "cancelled",
            )
            for seq in sorted(group.ended + group.members, key=lambda s: s.branch)
        ]
        return sorted(results, key=lambda r: -r.score)

    def cancel(self, request_id: int) -> None:
        group = self.active[request_id]
        if group.kind == "samples":
            results = self._sample_results(group, "cancelled")
        elif group.search.generated:
            results = self._beam_results(group, group.search.running_ranked(), "cancelled")
        else:
            results = []
        self._finish(group, "cancelled", results)

    def fail(self, group: SequenceGroup, message: str) -> None:
        self._release(group)
        self.emit(RequestFailed(group.request_id, message, time.perf_counter()))

    def _release(self, group: SequenceGroup) -> None:
        for seq in list(group.members):
            self.scheduler.remove(seq)
            self.seqs.pop(seq.seq_id, None)
        self.active.pop(group.request_id, None)

    def _finish(self, group: SequenceGroup, reason: str | None, results: list[SequenceResult]) -> None:
        self._release(group)
        best = results[0] if results else None
        first = group.every_seq[0]
        if first.tool_use is not None and self.tool_reply is not None and reason != "cancelled":
            for result in results:
                self.tool_reply(first.tool_use, group.request_id, result.token_ids, result.branch)
        stats = request_stats(
            first,
            group.token_times,
            sum(len(r.token_ids) for r in results),
            streams=group.size,
            preemptions=group.preemptions,
            peak_blocks=group.peak_shared,
            target_forwards=max(seq.target_forwards for seq in group.every_seq),
        )
        self.emit(
            RequestFinished(
                group.request_id,
                reason or (best.finish_reason if best else "cancelled"),
                best.text if best else "",
                best.token_ids if best else (),
                stats,
                time.perf_counter(),
                tuple(results),
                group.stats(),
                note=group.note,
            )
        )
