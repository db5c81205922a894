"""Which experts a mixture-of-experts model routed each token to, read from its routers.

transformers' MoE blocks (Mixtral, Qwen2/3-MoE, OLMoE, Phi-MoE, Granite MoE, gpt-oss, GLM-4 MoE,
dots.llm1, ...) route through a router module whose forward returns (router_logits [T, experts],
top_k_weights [T, k], top_k_index [T, k]): the family's own routing (softmax then top-k, top-k
then softmax, grouped top-k with a bias correction...) is done there, and its experts are run on
exactly those indices and weights. `record_routes` hooks every router for one forward and keeps
those three tensors per layer, so a route shown is the one the model took.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


@dataclass(slots=True)
class LayerRoutes:
    logits: torch.Tensor  # float32 [T, experts]: the router's logits
    weights: torch.Tensor  # float32 [T, k]: the weight each chosen expert's output gets
    experts: torch.Tensor  # int64 [T, k]: the chosen experts


@dataclass(slots=True)
class RouteRecorder:
    layers: dict[int, LayerRoutes] = field(default_factory=dict)


def routers(model: PreTrainedModel) -> dict[int, nn.Module]:
    """The router module of each MoE layer, by decoder layer index (empty: a dense model)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Router"):
            continue
        match = _LAYER.search(name + ".")
        if match is not None:
            found.setdefault(int(match.group(1)), module)
    return found


def num_experts(model: PreTrainedModel) -> int:
    config: Any = model.config
    for name in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


@contextmanager
def record_routes(model: PreTrainedModel, recorder: RouteRecorder) -> Iterator[None]:
    """Keep every router's (logits, weights, experts) of the forward run inside, per layer."""
    handles = []
    for layer, router in routers(model).items():

        def keep(_module: nn.Module, _args: Any, output: Any, layer: int = layer) -> None:
            if not (isinstance(output, tuple) and len(output) == 3):
                raise RuntimeError(
                    f"layer {layer}'s router returned {type(output).__name__}, not transformers' "
                    "(router logits, top-k weights, top-k experts)"
                )
            logits, weights, experts = output
            recorder.layers[layer] = LayerRoutes(
                logits.detach().float().reshape(-1, logits.shape[-1]),
                weights.detach().float().reshape(-1, experts.shape[-1]),
                experts.detach().long().reshape(-1, experts.shape[-1]),
            )

        handles.append(router.register_forward_hook(keep))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
