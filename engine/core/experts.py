"""Which experts a mixture-of-experts model routed every token of a conversation to, per layer,
with the router's weights, and the load per expert over the reply.

Every position is run again (engine/core/replay.py without the prefix cache: a cached block's
tokens would not pass through the routers) through the engine's paged forward, transformers' MoE
code with its routers hooked (engine/model/routers.py): each route is the router's own top-k, the
experts the layer then ran on that token with those weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.core.inside_token import context_of
from engine.core.llm_engine import LLMEngine
from engine.core.replay import Replay
from engine.core.runner import ForwardProbe, ForwardResult
from engine.errors import InspectionError
from engine.inside import ExpertRoutes, TokenRoute
from engine.model.routers import RouteRecorder, num_experts, routers
from engine.request import Request


def expert_routes(core: LLMEngine, request: Request, output_ids: Sequence[int]) -> ExpertRoutes:
    started = time.perf_counter()
    model = core.loaded.model
    layers = sorted(routers(model))
    if not layers:
        raise InspectionError(
            f"{core.loaded.info.architecture} is not a mixture of experts: it has no expert routes to show"
        )
    context = context_of(core, request, output_ids)
    reply_start = len(context) - len(output_ids)
    experts: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    weights: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    recorders: list[RouteRecorder] = []

    def probe(_start: int, _count: int) -> ForwardProbe:
        recorders.append(RouteRecorder())
        return ForwardProbe(routes=recorders[-1])

    def collect(_start: int, count: int, _result: ForwardResult) -> None:
        recorded = recorders[-1].layers
        for layer in layers:
            routes = recorded.get(layer)
            if routes is None or routes.experts.shape[0] != count:
                raise InspectionError(f"layer {layer}'s router did not route this forward's {count} tokens")
            experts[layer].append(routes.experts)
            weights[layer].append(routes.weights)

    with Replay(core, context, reuse=False) as replay:
        replay.run(len(context), probe=probe, on_result=collect)
    chosen = {layer: torch.cat(experts[layer]) for layer in layers}  # [T, k]
    weight = {layer: torch.cat(weights[layer]) for layer in layers}
    count = num_experts(model) or int(max(int(c.max()) for c in chosen.values()) + 1)
    top_k = int(chosen[layers[0]].shape[1])
    per_layer_ids = {layer: chosen[layer].tolist() for layer in layers}
    per_layer_weights = {layer: weight[layer].tolist() for layer in layers}
    routes = tuple(
        tuple(
            TokenRoute(tuple(per_layer_ids[layer][p]), tuple(per_layer_weights[layer][p])) for layer in layers
        )
        for p in range(len(context))
    )
    load = tuple(
        tuple(int(n) for n in torch.bincount(chosen[layer][reply_start:].reshape(-1), minlength=count))
        for layer in layers
    )
    text = core.text.text
    return ExpertRoutes(
        count,
        top_k,
        tuple(layers),
        tuple(context),
        tuple(text(t) for t in context),
        reply_start,
        routes,
        load,
        time.perf_counter() - started,
    )
