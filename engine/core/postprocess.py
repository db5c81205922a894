"""The third part of a step: commit the new K/V, then give each sequence's logit rows to the
handler of its kind, and stream what they choose.

  plain        sample one token (engine.sampling) and stream it
  speculative  verify the round's drafts against the target's rows (engine.speculative.verify),
               keep the accepted prefix (its K/V; the rest is rolled back), stream the round
  samples      the first time a group's prompt is in: fork n ways (shared blocks), each sample
               draws from the same logits with its own generator; then each on its own, as plain
  beams        all of a group's beams at once: rank, re-fork, prune (engine.core.group_driver)

Each sequence's part runs guarded: one that raises (a sampler given impossible logits, a
detokenizer's error) fails its own request (`fail`) and the others' go on. Every token of one
step is stamped with the step's time, so a speculative round's tokens share one time and ITL is
one gap per step (vLLM's meaning).

Under a grammar each sequence's mask comes from its own matcher (engine.grammar.state), which
consumes every token as it is committed here; a token that completes the grammar ends the reply
("stop"), one after which the grammar permits nothing ends it with the reason ("grammar").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.group_driver import GroupDriver
from engine.core.kept_logits import KeptLogits
from engine.core.runner import ForwardResult
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.events import Event, SpecRound, TokenGenerated
from engine.grammar.state import GrammarDeadEnd
from engine.kv.manager import KVCacheManager
from engine.sampling.mask import TokenMask
from engine.sampling.sampler import SampleResult, greedy_row
from engine.speculative.adaptive import DraftTuner
from engine.speculative.proposers import Proposer
from engine.speculative.verify import Verdict, verify, verify_greedy
from engine.text.token_text import TokenText


@dataclass(frozen=True, slots=True)
class RoundContext:
    """What a step's speculative rounds are measured against: the step's time up to its
    postprocess (scheduling and the forward), its decode rows (drafts included) and how many
    sequences decoded in it."""

    step_s: float
    rows: int
    decoding: int


class Postprocessor:
    """Works through the engine's collaborators: the KV manager (commits), the group driver
    (forks, beams, a sample's end), the tokenizer's text, the event sink, `finish` for a plain
    request's end, and the speculative proposer with its config (None when speculation is off)."""

    def __init__(
        self,
        kv: KVCacheManager,
        groups: GroupDriver,
        text: TokenText,
        emit: Callable[[Event], None],
        finish: Callable[[Sequence, str, str], None],
        max_model_len: int,
        proposer: Proposer | None,
        tuner: DraftTuner | None,
        fail: Callable[[Sequence, str], None],
        kept: KeptLogits | None = None,
    ):
        self.kv, self.groups, self.text, self.emit, self.finish = kv, groups, text, emit, finish
        self.max_model_len = max_model_len
        self.proposer, self.tuner = proposer, tuner
        self.fail = fail  # fails a sequence's request alone
        self.live: Callable[[Sequence], bool] = lambda seq: True  # still in the engine (LLMEngine sets it)
        # the logits of the tokens that record a snapshot, for exact what-ifs (None: none kept)
        self.kept = kept
        self.step_count = 0  # the step being postprocessed (run() sets it)
        self.step_t = 0.0  # its time, every token it gives is stamped with
        self.rounds = RoundContext(0.0, 0, 0)  # the step's, for its speculative rounds

    def _guarded(self, seq: Sequence, work: Callable[..., object], *args: Any) -> None:
        """`work(*args)` for `seq`, unless its request already failed this step; if it raises,
        the request fails alone with the error."""
        if not self.live(seq):
            return  # failed (or finished with its group) earlier in this step
        try:
            work(*args)
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the step's
            self.fail(seq, f"the request failed after the forward: {type(exc).__name__}: {exc}")

    def run(
        self, batch: ScheduledBatch, result: ForwardResult, step: int, rounds: RoundContext | None = None
    ) -> None:
        self.step_count = step
        if rounds is not None:
            self.rounds = rounds
        self.step_t = time.perf_counter()
        logits = result.logits
        rows = result.rows
        verdicts: dict[int, Verdict] = {}

        def verify_round(seq: Sequence, first: int, count: int) -> None:
            verdicts[seq.seq_id] = self._verify(seq, logits[first : first + count])

        for seq in batch.seqs:
            row = rows.get(seq.seq_id)
            if row is not None and row[1] > 1:
                self._guarded(seq, verify_round, seq, *row)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            verdict = verdicts.get(seq.seq_id)
            self._guarded(seq, self.kv.commit, seq, n, None if verdict is None else 1 + verdict.accepted)
        beam_rows: dict[int, dict[int, int]] = {}
        # what the head read, for a proposer that drafts from it (before the tokens are emitted:
        # a sequence that finishes on one is released)
        hidden = result.hidden if self.proposer is not None and self.proposer.reads_hidden else None
        middle = result.middle if hidden is not None else None
        for seq in batch.seqs:
            if seq.seq_id not in rows:
                continue  # a prefill chunk short of the prompt's end: nothing to sample
            start, count = rows[seq.seq_id]
            verdict = verdicts.get(seq.seq_id)
            if verdict is not None:
                if hidden is not None:  # the row the round's last token is drawn from
                    length = seq.num_tokens + verdict.accepted + 1
                    self._guarded(seq, self._observe, seq, hidden, middle, start + verdict.accepted, length)
                self._guarded(seq, self._emit_round, seq, verdict, logits[start : start + count])
            elif seq.group is None:
                if hidden is not None:
                    self._guarded(seq, self._observe, seq, hidden, middle, start, seq.num_tokens + 1)
                self._guarded(seq, self.sample, seq, logits[start])
            elif seq.group.kind == "beams":
                beam_rows.setdefault(seq.group.request_id, {})[seq.seq_id] = start
            elif not seq.group.forked:  # the prompt is in: every sample draws from its logits
                self._guarded(seq, self._fork_and_sample, seq, logits[start])
            else:
                self._guarded(seq, self.sample, seq, logits[start])
        for request_id, seq_rows in beam_rows.items():
            group = self.groups.active.get(request_id)
            if group is not None:
                self._guarded(group.members[0], self.groups.beam_step, group, seq_rows, logits, step)

    def _observe(
        self, seq: Sequence, hidden: torch.Tensor, middle: torch.Tensor | None, row: int, length: int
    ) -> None:
        """Hand the drafter the state it drafts from, where the sequence's next step may draft
        (the forward kept the middle residual then: LLMEngine._keep_middle)."""
        assert self.proposer is not None
        if self.tuner is not None and not self.tuner.may_draft_next(seq.seq_id):
            return
        self.proposer.observe_hidden(seq, hidden[row], None if middle is None else middle[row], length)

    def _fork_and_sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        assert seq.group is not None
        for member in self.groups.fork_samples(seq.group):
            self.sample(member, logits)

    # ---- plain ---------------------------------------------------------------------------
    def sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        self._keep(seq, logits)
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        result = seq.sampler.sample(logits, prompt, seq.output_ids, mask_of(seq))
        self.emit_token(seq, result)

    def _keep(self, seq: Sequence, logits: torch.Tensor) -> None:
        """The row the sequence's next token is drawn from, kept when the token records a snapshot."""
        if self.kept is not None and seq.params.snapshot_top_n > 0:
            self.kept.keep(seq.token_ids, logits)

    def _grammar_end(self, seq: Sequence, token: int) -> tuple[str | None, str]:
        """Consume the committed `token` in the sequence's grammar: (reason the reply ends, why)."""
        grammar = seq.grammar
        if grammar is None:
            return None, ""
        if not grammar.consume(token):
            # Only a token chosen outside the mask gets here (a beam forced onto an impossible
            # candidate): the reply stops rather than leave its grammar.
            return "grammar", f"token {self.text.text(token)!r} does not follow the grammar"
        if grammar.finished:
            return "stop", ""
        try:
            grammar.mask()  # the next position's mask, now: a dead end ends the reply here
        except GrammarDeadEnd as exc:
            return "grammar", str(exc)
        return None, ""

    def emit_token(self, seq: Sequence, result: SampleResult, spec: str = "", spec_round: int = -1) -> bool:
        """Append a chosen token, stream it, and finish the request if it ends here."""
        now = self.step_t or time.perf_counter()
        token = result.token_id
        seq.token_ids.append(token)
        if not seq.token_times or seq.token_times[-1] != now:
            seq.token_times.append(now)
        seq.cumulative_logprob += result.logprob
        if seq.group is not None:
            seq.group.mark_token_step(self.step_count, now)
        is_eos = self.text.stops(token, seq.params.ignore_eos)
        delta = "" if is_eos else seq.detokenizer.push(token)
        grammar_reason, note = (None, "") if is_eos else self._grammar_end(seq, token)
        if is_eos or seq.detokenizer.stopped:
            reason = "stop"
        elif grammar_reason is not None:
            reason = grammar_reason
        elif seq.num_output_tokens >= seq.params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        else:
            reason = None
        if reason is not None:
            delta += seq.detokenizer.flush()  # text held back for a possible stop string
        self.emit(
            TokenGenerated(
                seq.group.request_id if seq.group is not None else seq.seq_id,
                seq.num_output_tokens - 1,
                token,
                self.text.text(token) if seq.makes_text else "",
                delta,
                result.logprob,
                result.snapshot,
                spec,
                spec_round,
                now,
                seq.branch,
            )
        )
        if reason is not None:
            if seq.group is not None:
                self.groups.end_sample(seq, reason, note)
            else:
                self.finish(seq, reason, note)
        return reason is not None

    # ---- speculative ---------------------------------------------------------------------
    def _verify(self, seq: Sequence, logits: torch.Tensor) -> Verdict:
        d = seq.num_draft_tokens
        drafts = list(seq.spec_token_ids)
        if seq.sampler.plain_greedy and seq.grammar is None:
            rows = logits.detach().to(torch.float32)  # each row's argmax as a lone decode takes it
            return verify_greedy(lambda i: greedy_row(rows[i]), drafts)
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        history = seq.output_ids
        # Under a grammar: each position's mask, the matcher walked through the drafts and back.
        masks: list[TokenMask | None] = [None] * (d + 1)
        if seq.grammar is not None:
            masks = seq.grammar.masks_along(drafts)
        p = torch.stack(
            [
                seq.sampler.distribution(logits[i], prompt, history + drafts[:i], masks[i])
                for i in range(d + 1)
            ]
        )
        return verify(p, drafts, seq.draft_q, seq.sampler.draw, seq.sampler.uniform)

    def _emit_round(self, seq: Sequence, verdict: Verdict, logits: torch.Tensor) -> None:
        proposer, tuner = self.proposer, self.tuner
        assert proposer is not None and tuner is not None
        drafts = list(seq.spec_token_ids)
        seq.drop_drafts(0)
        emitted = drafts[: verdict.accepted] + [verdict.token]
        proposer.on_verified(seq, seq.num_tokens + verdict.accepted)
        seq.spec_rounds += 1
        seq.spec_drafted += len(drafts)
        seq.spec_accepted += verdict.accepted
        for counts, n in (
            (seq.spec_drafted_by_position, len(drafts)),
            (seq.spec_accepted_by_position, verdict.accepted),
        ):
            counts.extend([0] * (len(drafts) - len(counts)))
            for j in range(n):
                counts[j] += 1
        context = self.rounds
        outcome = tuner.round_done(
            seq.seq_id,
            len(drafts),
            verdict.accepted,
            context.rows,
            context.step_s,
            context.decoding,
            seq.draft_s,
            asked=seq.draft_length,
        )
        seq.spec_saved_s += outcome.saved_s
        self.emit(
            SpecRound(
                seq.seq_id,
                seq.spec_rounds,
                proposer.name,
                tuple(drafts),
                verdict.q_of_draft,
                verdict.p_of_draft,
                verdict.accept_probs,
                verdict.accepted,
                tuple(emitted),
                verdict.bonus,
                time.perf_counter(),
                seq.draft_length,
                outcome.draft_s,
                outcome.saved_s,
            )
        )
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        # a greedy round with no grammar: its rows' log-sum-exps, taken once by verify_greedy
        plain = seq.sampler.plain_greedy and seq.grammar is None
        greedy = seq.sampler.greedy_results(logits, emitted, verdict.log_normalizers) if plain else None
        for i, token in enumerate(emitted):
            kind = "accepted" if i < verdict.accepted else ("bonus" if verdict.bonus else "resampled")
            self._keep(seq, logits[i])
            if greedy is not None:
                result = greedy[i]
            else:
                result = seq.sampler.result_for(logits[i], prompt, seq.output_ids, token, mask_of(seq))
            if self.emit_token(seq, result, kind, seq.spec_rounds):
                return  # finished: the rest of the round is dropped


def mask_of(seq: Sequence) -> TokenMask | None:
    """The sequence's grammar mask at its next token (with what it forces, when a snapshot will
    show it), or None without a grammar."""
    if seq.grammar is None:
        return None
    return seq.grammar.mask(with_forced=seq.params.snapshot_top_n > 0)
