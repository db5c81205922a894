"""Steering: a control vector added to the residual stream, and how the next token's distribution
moves.

The direction (times the strength) is added to every row's residual stream after the chosen
decoder layer(s), as llama.cpp applies a control vector: every position of the context, so the
K/V of the layers after it change too. So the steered forward recomputes the whole context
(engine/core/replay.py without the prefix cache, its blocks never entering it: they are not the
model's K/V) and reads the last row; the plain distribution is the same context computed the same
way without it.

A vector comes from a file in llama.cpp's format (engine/model/control_vector.py), or from two
contrasting prompts (`contrast_vector`): per layer, the residual stream of the first prompt's last
token minus the second's, the simplest of the difference-of-means recipes (repeng, llama.cpp's
cvector-generator).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.core.inside_token import context_of
from engine.core.llm_engine import LLMEngine
from engine.core.replay import Replay
from engine.core.runner import ForwardProbe
from engine.core.scoring import text_ids
from engine.errors import InspectionError
from engine.inside import Candidates, ControlVector, Steered
from engine.model.control_vector import check_control_vector
from engine.request import Request

Tensor = torch.Tensor
MAX_STRENGTH = 100.0


def steer(
    core: LLMEngine,
    request: Request,
    output_ids: Sequence[int],
    vector: ControlVector,
    layer: int | None,
    strength: float,
    top_n: int = 10,
) -> Steered:
    started = time.perf_counter()
    info = core.loaded.info
    check_control_vector(vector, info.hidden_size, info.num_layers)
    if not -MAX_STRENGTH <= strength <= MAX_STRENGTH:
        raise InspectionError(
            f"a strength must be in [-{MAX_STRENGTH:g}, {MAX_STRENGTH:g}], got {strength:g}"
        )
    if layer is not None and layer not in vector.layers:
        raise InspectionError(
            f"the control vector has no direction for layer {layer} (it has {_span(vector)})"
        )
    chosen = vector.layers if layer is None else (layer,)
    context = context_of(core, request, output_ids)
    param = next(core.loaded.model.parameters())
    by_stage = {
        i + 1: torch.tensor(vector.directions[vector.layers.index(i)], dtype=param.dtype, device=param.device)
        * strength
        for i in chosen
    }

    def edit(stage: int, x: Tensor) -> Tensor:
        direction = by_stage.get(stage)
        return x if direction is None else x + direction

    # Both computed alike (every position run, chunked the same way), so that the direction is
    # all that differs between them: a strength of 0 moves nothing, to the bit.
    with Replay(core, context, reuse=False, keep=False) as replay:
        plain = replay.last_row()
    probe = ForwardProbe(edit=edit)
    with Replay(core, context, reuse=False, keep=False) as replay:
        steered = replay.last_row(probe, prefix_probe=probe)
    p, q = torch.log_softmax(plain.float(), -1), torch.log_softmax(steered.float(), -1)
    kl = float((q.exp() * (q - p)).sum())
    return Steered(
        tuple(chosen),
        strength,
        _top(core, p, top_n),
        _top(core, q, top_n),
        kl,
        time.perf_counter() - started,
    )


def _span(vector: ControlVector) -> str:
    layers = vector.layers
    return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"


def _top(core: LLMEngine, logprobs: Tensor, n: int) -> Candidates:
    values, ids = logprobs.topk(n)
    tokens = tuple(int(i) for i in ids)
    return Candidates(tokens, tuple(core.text.text(t) for t in tokens), tuple(float(v) for v in values.exp()))


def contrast_vector(core: LLMEngine, positive: str, negative: str) -> ControlVector:
    """Per layer: the residual stream of `positive`'s last token minus `negative`'s."""
    if not positive.strip() or not negative.strip():
        raise InspectionError("a contrast needs two prompts, neither empty")
    residuals = []
    for text in (positive, negative):
        stages: dict[int, Tensor] = {}

        def keep(stage: int, hidden: Tensor, stages: dict[int, Tensor] = stages) -> None:
            stages[stage] = hidden[0]

        with Replay(core, text_ids(core, text)) as replay:
            replay.last_row(ForwardProbe(residual=keep))
        residuals.append(stages)
    info = core.loaded.info
    layers = tuple(range(info.num_layers))
    directions = tuple(
        tuple(float(x) for x in (residuals[0][i + 1] - residuals[1][i + 1]).float()) for i in layers
    )

    def short(s: str) -> str:
        return s if len(s) <= 40 else s[:37] + "..."

    return ControlVector(
        f"{short(positive)} - {short(negative)}",
        layers,
        directions,
        f"computed from two prompts: {positive!r} minus {negative!r}",
        info.architecture,
    )
