"""The self-draft that reads the target's own hidden state: no layer of its own, no KV cache.

After each step the engine hands the drafter what the target's head read at the row each
sequence's last token was drawn from (f_p: the final norm's output) and the residual entering a
middle layer at that row (m_p: layer two thirds up; `observe_hidden`). A draft estimates the next
position's: f_(p+1) ~ A [f_p, e(x_(p+1)), m_p] + b (each part at unit RMS), from those states and
the input embedding of the token drawn from f_p, then reads its head (the target's head rows over
the vocabulary's first V ids, 8 bits); the next draft chains on its own estimate, its own token and
the same m_p. A and b are a least-squares fit on the target's own greedy replies and the plan (V,
the confidence threshold) is chosen by measuring agreement (engine/speculative/self_draft.py,
`calibrate`, which weighs this draft against the first-layers drafts by the target steps each
saves).

This is EAGLE's idea (draft from the target's features and the sampled token; Li et al. 2024) with
a linear map where EAGLE trains a transformer layer, and, as EAGLE-3 does, features from a middle
layer beside the top one. Measured on the packaged SmolLM2-135M (fitted on its replies to 231
prompts), one draft a round at the plan's threshold (30% confidence): the target kept 31% of its
drafts on the speculation bench's fifteen chat prompts (of 1,599, 533 a round) with the map and
head as int8 rows, 30.4% (of 1,626) as Q8_0 blocks, and 42% on held-out calibration replies. The
draft before it (no middle layer, fitted on 116 replies, its inputs unscaled, which int8 rounding
cost 2 points) kept 27% on the same fifteen prompts and 35% on held-out replies. A first-6-layers
draft agreed less (38% held out) at 0.16 of a step's weights, where this one reads 0.037 (two
matmuls at 8 bits, hidden x 3 hidden and V x hidden: 0.13 ms a draft with its draw at 2 threads,
0.17 at 1, with its weights in cache; in the engine, right after a step's forward has streamed the
model's weights through the caches, 0.25 ms at 2 threads, 0.34 before its rows were Q8_0 blocks on
kvk's kernels (self_draft.draft_storage) and its input one tensor op).
Maps trained by cross-entropy instead (linear, or one hidden layer) agreed less on held-out
replies (19-20% of positions against 24%): a few thousand positions overfit them; other third
inputs (the previous hidden state, the previous token, a product) gained 0-2 points.

A stored hidden state belongs to the sequence while it has exactly the tokens it had then
(`length`); otherwise the sequence gets no draft until its next step gives a new one. A stale or
poor draft costs speed only: verification keeps the target's own tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.sampling.sampler import Sampler
from engine.speculative.proposers import Drafts, Sequence, draw_draft
from engine.speculative.self_draft import FittedDraft, hidden_draft_input


class HiddenStateDrafter:
    """The hidden-state self-draft as a proposer (engine.speculative.proposers.Proposer).

    A costly proposer to the engine (free = False): its drafts are made only where the tuner asks
    for them, and probed now and then where it asks none. Free, it proposed at every plain step
    (its first draft, ~0.1 ms, to learn from shadow rounds): on the packaged model that cost 0.2
    ms a token, more than its drafts saved (0.89-0.92x plain decoding on free chat)."""

    free = False
    forwards = 0  # draft steps (a map and a head matmul for the drafting sequences) `propose` ran
    reads_hidden = True

    def __init__(self, fitted: FittedDraft, embed: nn.Module, vocab_size: int):
        assert fitted.map is not None, "a hidden-state draft has a map"
        self.plan = fitted.plan
        self.middle_layer = fitted.plan.middle
        self.name = f"self ({fitted.plan.describe()})"
        self.head, self.map = fitted.head, fitted.map
        self.weight_bytes = fitted.weight_bytes()
        self.embed = embed
        self.vocab_size = vocab_size  # the target's: a draft's q spans it
        # seq_id -> (length, f [hidden], the middle layer's input m [hidden])
        self._hidden: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._samplers: dict[int, Sampler] = {}

    def observe_hidden(
        self, seq: Sequence, hidden: torch.Tensor, middle: torch.Tensor | None, length: int
    ) -> None:
        assert middle is not None, "the engine keeps the middle layer's input where this drafter may draft"
        self._hidden[seq.seq_id] = (length, hidden.detach().float().clone(), middle.detach().float().clone())

    def _step(self, f: torch.Tensor, tokens: list[int], m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft for each row: (the next position's hidden estimate, its logits)."""
        estimate = self.map(hidden_draft_input(f, self.embed(torch.tensor(tokens)).float(), m)).float()
        return estimate, self.head(estimate).float()

    def evidence(self, seq: Sequence) -> int:
        return 0  # one class (asked of free proposers only): the confidence threshold filters drafts

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        """Up to ks[i] drafts for each sequence that has its hidden state, batched, each while
        the draft's top probability is at least the plan's confidence threshold."""
        drafts: list[Drafts] = [([], []) for _ in seqs]
        running = [
            i
            for i, (seq, k) in enumerate(zip(seqs, ks))
            if k > 0 and self._hidden.get(seq.seq_id, (-1,))[0] == len(seq.token_ids)
        ]
        self.forwards = 0
        if not running:
            return drafts
        f = torch.stack([self._hidden[seqs[i].seq_id][1] for i in running])
        # a chained draft reads the last position the target ran's middle layer (measured on the
        # packaged model: second drafts after a kept first agreed 18.8% so, 18.0% with none; a
        # map estimating it too, 21.4%, for another matmul a draft)
        m = torch.stack([self._hidden[seqs[i].seq_id][2] for i in running])
        tokens = [seqs[i].token_ids[-1] for i in running]
        while running:
            f, logits = self._step(f, tokens, m)
            self.forwards += 1
            kept = []
            top = torch.softmax(logits, -1).amax(-1).tolist()  # each row's confidence
            for row, i in enumerate(running):
                if top[row] < self.plan.confidence:
                    continue  # not confident enough: the round ends here
                self._draw(seqs[i], logits[row], drafts[i])
                if len(drafts[i][0]) < ks[i]:
                    kept.append(row)
            running = [running[row] for row in kept]
            tokens = [drafts[i][0][-1] for i in running]
            f, m = f[kept], m[kept]
        return drafts

    def _draw(self, seq: Sequence, logits: torch.Tensor, into: Drafts) -> None:
        sampler = self._samplers.setdefault(seq.seq_id, Sampler(seq.params))
        token, q = draw_draft(sampler, logits, seq, into[0], self.vocab_size)
        into[0].append(token)
        into[1].append(q)

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        pass  # the stored state carries its length: a sequence that no longer has it gets no draft

    def release(self, seq: Sequence) -> None:
        self._hidden.pop(seq.seq_id, None)
        self._samplers.pop(seq.seq_id, None)

    def memory_bytes(self) -> tuple[int, int]:
        """(its map's and head's rows, the hidden states it keeps)."""
        kept = sum(t.numel() * t.element_size() for _, f, m in self._hidden.values() for t in (f, m))
        return self.weight_bytes, kept
