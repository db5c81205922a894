"""The residual stream of transformers' decoder layers, observed or changed during one forward: the
families kvscope's own forward does not run get its observer and edit (engine/model/llama_forward.py)
through forward hooks on their decoder layers, and a logit lens head (final norm, LM head, the
family's logit scaling) read off the model.

The hooks live only inside `layer_hooks(...)`: a step of generation registers none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Tensor = torch.Tensor
ResidualObserver = Callable[[int, Tensor], None]
ResidualEdit = Callable[[int, Tensor], Tensor]

# Where transformers' decoders keep their final norm, by family.
_FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f", "final_norm")


class NoLens(ValueError):
    """Why a model's residual stream cannot be read through its head; str() says it in one line."""


def decoder_layers(model: PreTrainedModel) -> tuple[nn.Module, nn.ModuleList]:
    """(the decoder that owns the layers, its ModuleList of `num_hidden_layers` layers)."""
    count = _num_layers(model)
    for _name, module in model.named_modules():
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) == count:
                return module, child
    raise NoLens(f"no list of its {count} decoder layers where transformers' decoders keep them")


def _num_layers(model: PreTrainedModel) -> int:
    config: Any = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0))


def _hidden_of(output: Any) -> Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _with_hidden(output: Any, hidden: Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return hidden
    return (hidden, *output[1:])


@contextmanager
def layer_hooks(
    model: PreTrainedModel,
    rows: Tensor,
    observer: ResidualObserver | None = None,
    edit: ResidualEdit | None = None,
) -> Iterator[None]:
    """For one forward over a packed row [1, T, hidden]: `observer(stage, hidden[rows])` with stage 0
    what enters the first layer and i + 1 what layer i leaves; `edit(i + 1, x [T, hidden])` replaces
    what layer i leaves (the embedding, stage 0, is not edited here)."""
    _, layers = decoder_layers(model)
    handles = []
    if observer is not None:

        def before_first(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            observer(0, hidden[0].index_select(0, rows))

        handles.append(layers[0].register_forward_pre_hook(before_first, with_kwargs=True))

    for index, layer in enumerate(layers):

        def after(_module: nn.Module, _args: Any, output: Any, stage: int = index + 1) -> Any:
            hidden = _hidden_of(output)
            if edit is not None:
                hidden = edit(stage, hidden[0])[None]
                output = _with_hidden(output, hidden)
            if observer is not None:
                observer(stage, hidden[0].index_select(0, rows))
            return output if edit is not None else None

        handles.append(layer.register_forward_hook(after))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def lens_head(model: PreTrainedModel) -> Callable[[Tensor], Tensor]:
    """[R, hidden] residual stream -> [R, vocab] logits as the family's forward makes them from its
    last layer's output: its final norm, its LM head, its logit scaling and soft cap. Raises NoLens
    where the model keeps no such pieces (the caller also checks the last layer against the real
    logits, which catches a family that does more)."""
    decoder, _ = decoder_layers(model)
    norm = next(
        (getattr(decoder, n) for n in _FINAL_NORMS if isinstance(getattr(decoder, n, None), nn.Module)), None
    )
    if norm is None:
        raise NoLens(f"no final norm where {type(decoder).__name__} would keep one")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Module):
        raise NoLens("no LM head module")
    config: Any = model.config
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    divisor = getattr(config, "logits_scaling", None)  # Granite divides
    softcap = getattr(config, "final_logit_softcapping", None)
    project = getattr(decoder, "project_out", None)  # OPT's smaller models project back to the embedding

    def head_of(hidden: Tensor) -> Tensor:
        x = norm(hidden)
        if isinstance(project, nn.Module):
            x = project(x)
        logits: Tensor = head(x)
        if isinstance(scale, (int, float)) and scale != 1:
            logits = logits * scale
        if isinstance(divisor, (int, float)) and divisor != 1:
            logits = logits / divisor
        if isinstance(softcap, (int, float)) and softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return head_of
