"""What-if: a generated token's sampling stages recomputed under other settings, exactly.

The stages run on the logits the token was drawn from, over the whole vocabulary, through the
request's own stage code (engine.sampling.sampler / stages, penalties included). Which logits:
- the step's own, kept for the token when it was drawn (engine/core/kept_logits.py): under the
  token's own settings the result is then its recorded snapshot bit for bit, on any weights;
- when they were no longer kept (a budget of the last few hundred tokens), recomputed through the
  engine's own paged forward and kernels (engine/core/replay.py: the context's cached blocks as
  the reply's steps wrote them, the token's row alone, as a decode step runs it). Those are the
  step's numbers up to the float rounding of a forward whose neighbours differ (a float32 GEMM's
  last bits follow the batch's rows); the answer says which it used.
Nothing is approximated from the top candidates a snapshot recorded. One stage is random: XTC
fires on a coin; the what-if shows it as if its coin came up, and `what_if_notes` says so. A reply
made under a grammar keeps it: its matcher is replayed over the reply's tokens before the token,
and its mask is the first stage as it was.

`WhatIf.recompute` runs on the engine thread (Engine's question queue): it uses the engine's
model, pool and tokenizer. It keeps the last recomputed logits, so moving a slider re-runs only
the stages.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams
from engine.core.replay import Replay
from engine.events import TokenSnapshot
from engine.inside import KEPT, RECOMPUTED, WhatIfAnswer
from engine.request import Request
from engine.sampling.sampler import Sampler
from engine.sampling.stages import build_stages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.core.llm_engine import LLMEngine

# How the app says what the numbers are (shown beside every what-if), by the logits' source.
HOW = {
    KEPT: "exact: the step's own logits, kept for this token, through the sampler's own stages "
    "under the new settings",
    RECOMPUTED: "this token's logits recomputed through the engine's paged forward and kernels (the "
    "step's own were no longer kept), through the sampler's own stages under the new settings",
}


def what_if_notes(params: SamplingParams) -> tuple[str, ...]:
    """One line per way a what-if under `params` differs from what one real draw would show."""
    if 0.0 < params.xtc_probability < 1.0 and not params.greedy:
        return (f"XTC shown as if its coin came up (it does with probability {params.xtc_probability:g})",)
    return ()


def recorded_top_n(snapshot: TokenSnapshot) -> int:
    """The snapshot size a token was recorded with: its candidates are the top N, then the drawn
    token when it was not among them. A drawn token last is either appended or the N-th itself,
    and top N - 1 plus it lists the same candidates either way."""
    ids = snapshot.candidate_ids
    return max(1, len(ids) - 1 if ids and ids[-1] == snapshot.drawn_id else len(ids))


class WhatIf:
    """Recomputes tokens' stages on the engine thread, keeping the last token's logits."""

    def __init__(self) -> None:
        # The last recomputed context, the model it ran through (weakly: a model the engine has
        # dropped is not kept alive here) and its logits.
        self._key: tuple[int, ...] | None = None
        self._model: weakref.ref[PreTrainedModel] | None = None
        self._logits: torch.Tensor | None = None

    def recompute(
        self,
        core: LLMEngine,
        request: Request,
        output_ids: Sequence[int],
        recorded: TokenSnapshot,
        params: SamplingParams,
    ) -> WhatIfAnswer:
        """The snapshot the token would have had under `params`: `request`'s prompt, the reply's
        `output_ids` before the token, the token `recorded.drawn_id` as drawn. As many candidates
        as the recorded snapshot shows."""
        prompt = core.prompt_ids(request)
        logits, source = self._logits_for(core, [*prompt, *output_ids], len(prompt))
        shown = replace(
            params,
            snapshot_top_n=recorded_top_n(recorded),
            grammar=params.grammar or request.sampling.grammar,  # the reply's grammar stays
        )
        sampler = Sampler(shown, decode_token=core.text.text)
        # XTC as if its coin came up: a what-if shows what the setting does, not one coin's luck.
        sampler.stages = build_stages(shown, decode_token=core.text.text, uniform=lambda: 0.0)
        mask = None
        if shown.grammar is not None:
            grammar = core.start_grammar(shown, request.reply_prefix_ids)
            if grammar.replay(output_ids) < len(output_ids):
                raise ValueError("the reply's tokens do not follow its grammar")
            mask = grammar.mask(with_forced=True)
        snapshot = sampler.result_for(logits, prompt, list(output_ids), recorded.drawn_id, mask).snapshot
        assert snapshot is not None  # snapshot_top_n > 0 always records one
        return WhatIfAnswer(snapshot, source, HOW[source])

    def _logits_for(
        self, core: LLMEngine, context: list[int], prompt_tokens: int
    ) -> tuple[torch.Tensor, str]:
        kept = core.kept_logits.get(context)
        if kept is not None:
            return kept, KEPT
        model, key = core.loaded.model, tuple(context)
        same_model = self._model is not None and self._model() is model
        if self._logits is None or key != self._key or not same_model:
            with Replay(core, context, prompt_tokens=prompt_tokens) as replay:
                self._logits = replay.last_row()
            self._key, self._model = key, weakref.ref(model)
        return self._logits, RECOMPUTED
