"""The logit lens and every head's attention for one drawn token, from one replay of its context.

The token drawn after a context was drawn from the logits of the context's last row. That row is
run again (engine/core/replay.py: the context's cached blocks reused as the reply's steps wrote
them, the rest recomputed, the row itself alone, as a decode row runs) with a probe that keeps
- the residual stream of the row after the embedding and after every layer, each read through the
  final norm and the head as the model reads its last layer's (the logit lens: the drawn token's
  rank and probability per layer, the top candidates, the layer where it first leads);
- every head's attention probabilities over the positions the row attended, as the attention
  computed them (kvk's row attention writes them: the same blocks, window, sinks and soft cap).
The lens's last stage is checked (`last_gap`) against the logits the token was drawn from, where
the engine still keeps them for it, else against the replay's own: 0.0 when the last layer read
through the head is that distribution to the bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from engine.core.llm_engine import LLMEngine
from engine.core.replay import Replay
from engine.core.runner import ForwardProbe
from engine.errors import InspectionError
from engine.inside import (
    REPLAY_LOGITS,
    STEP_LOGITS,
    AttentionMap,
    Candidates,
    LayerAttentionMap,
    LensLayer,
    LogitLens,
    TokenInside,
)
from engine.limits import blocks_for_tokens
from engine.model.attention_probs import AttentionRecorder
from engine.model.layer_hooks import NoLens, lens_head
from engine.request import Request

Tensor = torch.Tensor


def context_of(core: LLMEngine, request: Request, output_ids: Sequence[int]) -> list[int]:
    """The tokens a reply's token was drawn after: the request's prompt, then the reply before it."""
    vocab = core.loaded.info.vocab_size
    bad = [t for t in output_ids if not 0 <= int(t) < vocab]
    if bad:
        raise InspectionError(f"token {bad[0]} is outside the model's vocabulary of {vocab}")
    return [*core.prompt_ids(request), *map(int, output_ids)]


def head_of(core: LLMEngine) -> Callable[[Tensor], Tensor]:
    """Residual stream [R, hidden] -> logits [R, vocab] as the model reads its last layer's."""
    own = core.runner.own_forward
    if own is not None:
        return own.final_logits
    return lens_head(core.loaded.model)


def inside_token(
    core: LLMEngine, request: Request, output_ids: Sequence[int], token_id: int, top_k: int = 5
) -> TokenInside:
    started = time.perf_counter()
    context = context_of(core, request, output_ids)
    vocab = core.loaded.info.vocab_size
    if not 0 <= token_id < vocab:
        raise InspectionError(f"token {token_id} is outside the model's vocabulary of {vocab}")
    residuals: dict[int, Tensor] = {}
    unavailable = ""
    try:
        head = head_of(core)
    except NoLens as exc:
        head, unavailable = None, f"no logit lens for this model: {exc}"
    recorder = AttentionRecorder()
    probe = ForwardProbe(
        residual=(lambda stage, hidden: residuals.__setitem__(stage, hidden[0].clone())) if head else None,
        attention=recorder,
    )
    with Replay(core, context, prompt_tokens=len(context) - len(output_ids)) as replay:
        logits = replay.last_row(probe)
        block_ids = replay.block_ids[: blocks_for_tokens(len(context), core.kv.block_size)]
        reused = replay.reused
    lens = None
    if head is not None:
        kept = core.kept_logits.get(context)  # what the step drew from, while it is kept
        against = REPLAY_LOGITS if kept is None else STEP_LOGITS
        reference = logits if kept is None else kept.to(logits.device)
        lens = _lens(core, head, residuals, reference, against, token_id, top_k)
    attention = _attention(core, recorder, context, block_ids)
    return TokenInside(
        lens,
        unavailable,
        attention,
        len(context),
        reused,
        len(context) - reused,
        time.perf_counter() - started,
        core.runner.executor,
    )


@torch.inference_mode()
def _lens(
    core: LLMEngine,
    head: Callable[[Tensor], Tensor],
    residuals: dict[int, Tensor],
    logits: Tensor,
    against: str,
    token_id: int,
    top_k: int,
) -> LogitLens:
    stages = sorted(residuals)
    stack = torch.stack([residuals[s] for s in stages])
    # The last stage alone, as the step read its row (one row through the head's kernel), the
    # others together: a float32 GEMM's last bits follow its row count.
    lens_logits = torch.cat([head(stack[:-1]).float(), head(stack[-1:]).float()])  # [stages, vocab]
    gap = float((lens_logits[-1] - logits.float()).abs().max())
    logprobs = torch.log_softmax(lens_logits, dim=-1)
    probs = logprobs.exp()
    ranks = (lens_logits > lens_logits[:, token_id : token_id + 1]).sum(dim=-1) + 1
    entropy = -(probs * logprobs.nan_to_num(neginf=0.0)).sum(dim=-1)
    top_p, top_i = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    text = core.text.text
    layers = []
    for row, stage in enumerate(stages):
        ids = tuple(int(i) for i in top_i[row])
        layers.append(
            LensLayer(
                stage,
                int(ranks[row]),
                float(probs[row, token_id]),
                Candidates(ids, tuple(text(i) for i in ids), tuple(float(p) for p in top_p[row])),
                float(entropy[row]),
            )
        )
    first = next((layer.stage for layer in layers if layer.token_rank == 1), None)
    return LogitLens(token_id, text(token_id), tuple(layers), first, gap, against)


def _attention(
    core: LLMEngine, recorder: AttentionRecorder, context: list[int], block_ids: tuple[int, ...]
) -> AttentionMap:
    layers = []
    kernel = ""
    for layer in range(core.loaded.info.num_layers):
        record = recorder.layers.get(layer)
        if record is None:
            raise InspectionError(
                f"layer {layer} did not attend row by row, so its attention was not recorded"
            )
        start, stop = int(record.starts[-1]), int(record.stops[-1])
        row = record.probs[-1, :, : stop - start]
        kernel = record.kernel
        how = record.how
        layers.append(
            LayerAttentionMap(
                layer,
                start,
                how.window,
                how.softcap,
                how.sinks is not None,
                tuple(tuple(head) for head in row.tolist()),
            )
        )
    text = core.text.text
    return AttentionMap(
        len(context) - 1,
        tuple(context),
        tuple(text(t) for t in context),
        core.kv.block_size,
        block_ids,
        tuple(layers),
        kernel,
    )
