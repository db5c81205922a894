"""What each layer's attention does beyond causal softmax(Q K^T * scale) V, as transformers calls it.

The paged attention (engine/model/paged_attention.py) reads every layer's K/V through block tables; to
give the same tokens as the family's own attention it must also apply, per layer:

- a sliding window (Mistral, Starcoder2, Phi-3, the sliding layers of Gemma 2/3, Cohere 2,
  gpt-oss...): a query at position p sees keys in (p - window, p], transformers'
  `sliding_window_overlay`;
- logit soft-capping (Gemma 2's `attn_logit_softcapping`): logits -> cap * tanh(logits / cap)
  before the mask;
- attention sinks (gpt-oss, Granite-SWA: `s_aux=module.sinks`): one learned logit per head joins
  the softmax and carries no value.

The scaling needs nothing here: every family's attention passes its own `scaling` (Gemma's
`query_pre_attn_scalar`, Granite's `attention_multiplier`...) to the attention function.

Which layer does what is not guessed from config names, which differ per family (Phi-MoE passes
no `sliding_window` to its attention, yet its mask slides): `probe_attention` runs the model once
on two tokens with a recording attention function and a recording mask function, and keeps, per
layer, the window the call passes and the one its mask applies (a mask function is evaluated at
positions up to 10^6 to read its shape). The same probe finds what paged attention cannot do: a
layer that never calls the attention function (Bloom's ALiBi, computed by hand), calls it twice,
hands it a mask of another shape (chunks, bidirectional spans) or a position bias.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import first_line

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.shapes import ModelShapes

# transformers' mask function: (batch, head, q_idx, kv_idx) -> whether the key is visible
MaskFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any]
# One recorded attention call: what it asked for, the mask it was handed, the keyword arguments
# the paged attention would not apply, and (K heads, K width, V heads, V width)
Call = tuple["AttentionSpec", object, list[str], tuple[int, int, int, int]]

PROBE_IMPLEMENTATION = "kvscope_probe"

# Keyword arguments the attention function may receive that change nothing it computes.
INERT_KWARGS = frozenset(
    {
        "position_ids",
        "use_cache",
        "output_attentions",
        "output_router_logits",
        "output_hidden_states",
        "cache_position",
        "return_dict",
        "is_causal",
        "paged_batch",
    }
)
# ...and those it implements (the rest make a model unservable: ALiBi biases, relative positions).
HANDLED_KWARGS = frozenset({"sliding_window", "softcap", "s_aux", "dropout", "scaling"})


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer attends, as its family defines it."""

    scaling: float | None = None
    window: int | None = None  # sliding window in tokens, None for full attention
    softcap: float | None = None  # logit soft-capping (Gemma 2)
    sinks: torch.Tensor | None = None  # [heads] sink logits (gpt-oss)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    window: int | None = None  # sliding window in tokens (the query itself included); None = full
    softcap: float | None = None  # attention-logit soft cap; None = none
    sinks: bool = False  # the call's `s_aux` (per-head sink logits) joins the softmax

    @staticmethod
    def of_call(kwargs: dict[str, Any]) -> AttentionSpec:
        window = kwargs.get("sliding_window")
        softcap = kwargs.get("softcap")
        return AttentionSpec(
            int(window) if window else None,
            float(softcap) if softcap else None,
            kwargs.get("s_aux") is not None,
        )


class AttentionProbeError(ValueError):
    """The model's attention does something paged attention does not; str() says what, in one line."""


@dataclass(frozen=True, slots=True)
class MaskShape:
    """What a mask function lets a query see: 'causal' (every earlier key), 'sliding' (the last
    `window` keys, itself included) or 'other' (chunks, bidirectional spans, padding...)."""

    kind: str
    window: int | None = None


# Query positions at which a mask function is read: small ones, and far ones where any window
# of a real model (Gemma's 512 ... Mistral's 4096 ... 128k) has long begun to slide.
_MASK_PROBE_QUERIES = (0, 1, 5, 1000, 123_457, 1_000_003)


def _visible(mask_function: MaskFunction, q: int, kv: torch.Tensor) -> torch.Tensor:
    zero = torch.tensor(0)
    return torch.as_tensor(mask_function(zero, zero, torch.tensor(q), kv)).expand(kv.shape).bool()


def _span(mask_function: MaskFunction, q: int) -> int | None:
    """How many keys up to and including q the query at q sees, when they are the last ones
    before it (a causal window); None for any other pattern (a later key, a gap)."""
    if _visible(mask_function, q, torch.tensor([q + 1, q + 2])).any():
        return None  # sees the future: bidirectional
    # look-back distances: every one up to 64, then each power of two and its neighbours
    far = {d for k in range(6, 22) for d in (2**k - 1, 2**k, 2**k + 1)}
    dist = torch.tensor(sorted(d for d in set(range(65)) | far if d <= q))
    seen = _visible(mask_function, q, q - dist)
    if seen.all():
        return q + 1
    first_hidden = int((~seen).nonzero()[0])
    if first_hidden == 0 or seen[first_hidden:].any():
        return None  # not itself, or a gap before older visible keys
    lo, hi = int(dist[first_hidden - 1]), int(dist[first_hidden])  # seen at lo, hidden at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if bool(_visible(mask_function, q, torch.tensor([q - mid]))[0]) else (lo, mid)
    return hi


def mask_shape(mask_function: MaskFunction) -> MaskShape:
    """Read a transformers mask function (batch, head, q_idx, kv_idx) -> bool at a few positions."""
    try:
        found = [_span(mask_function, q) for q in _MASK_PROBE_QUERIES]
    except Exception:  # noqa: BLE001 - a mask that needs more than positions (padding, chunks)
        return MaskShape("other")
    spans = [span for span in found if span is not None]
    if len(spans) != len(found):
        return MaskShape("other")
    if all(span == q + 1 for span, q in zip(spans, _MASK_PROBE_QUERIES)):
        return MaskShape("causal")
    window = spans[-1]
    if all(span == min(q + 1, window) for span, q in zip(spans, _MASK_PROBE_QUERIES)):
        return MaskShape("sliding", window)
    return MaskShape("other")


def _record_calls(model: PreTrainedModel, calls: dict[int | None, list[Call]]) -> None:
    # transformers takes seconds to import: only once a model is read
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    def record(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        unknown = sorted(
            k for k, v in kwargs.items() if k not in INERT_KWARGS | HANDLED_KWARGS and v is not None
        )
        kv_shape = (key.shape[1], key.shape[-1], value.shape[1], value.shape[-1])
        calls.setdefault(getattr(module, "layer_idx", None), []).append(
            (AttentionSpec.of_call(kwargs), attention_mask, unknown, kv_shape)
        )
        # The output is never used: zeros of the shape attention returns ([batch, T, heads, d]).
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    def record_mask(*args: Any, mask_function: MaskFunction | None = None, **kwargs: Any) -> MaskShape:
        return MaskShape("causal") if mask_function is None else mask_shape(mask_function)

    AttentionInterface.register(PROBE_IMPLEMENTATION, record)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_IMPLEMENTATION, record_mask)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = PROBE_IMPLEMENTATION
    try:
        device = next(model.parameters()).device
        with torch.inference_mode():
            model(
                input_ids=torch.tensor([[1, 2]], device=device),
                position_ids=torch.tensor([[0, 1]], device=device),
                use_cache=False,
            )
    finally:
        config._attn_implementation = previous


def probe_attention(model: PreTrainedModel, shapes: ModelShapes) -> tuple[AttentionSpec, ...]:
    """One AttentionSpec per layer, from one two-token forward. Raises AttentionProbeError.
    `shapes` (ModelShapes) is what the paged KV pool will hold per layer: the K and V each layer
    attends with must be exactly that (not heads tiled after the cache, not V of another width)."""
    num_layers = shapes.num_layers
    calls: dict[int | None, list[Call]] = {}  # by the module's layer_idx
    try:
        _record_calls(model, calls)
    except AttentionProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model that cannot even run two tokens is not servable
        if "MaskShape" in str(exc):  # the model's own code used the mask the probe handed out
            raise AttentionProbeError(
                "its layers process the attention mask themselves (ALiBi biases, or attention code of "
                "their own), which kvscope's paged attention cannot follow"
            ) from None
        raise AttentionProbeError(
            f"a trial forward of two tokens through kvscope's attention probe failed "
            f"({type(exc).__name__}: {first_line(exc)}), so kvscope cannot follow its attention"
        ) from None
    missing = [i for i in range(num_layers) if i not in calls]
    if missing:
        raise AttentionProbeError(
            f"layers {_layers(missing)} compute attention by hand instead of through transformers' attention "
            "functions, so kvscope's paged attention cannot serve them"
        )
    layers = []
    for i in range(num_layers):
        if len(calls[i]) != 1:
            raise AttentionProbeError(
                f"layer {i} attends {len(calls[i])} times per token (cross- or differential attention); "
                "kvscope's paged attention attends once"
            )
        layer, mask, unknown, kv_shape = calls[i][0]
        expected = (shapes.num_kv_heads, shapes.head_dim) * 2
        if kv_shape != expected:
            raise AttentionProbeError(
                f"layer {i} attends with K/V of (heads, width) {kv_shape[:2]} and {kv_shape[2:]}, not the "
                f"{expected[:2]} of its config that the paged KV pool stores (heads tiled after the cache, "
                "values of another width, or layers of different shapes)"
            )
        if unknown:
            raise AttentionProbeError(
                f"layer {i} passes {', '.join(unknown)} to its attention, which kvscope's paged attention "
                "does not apply"
            )
        layers.append(_with_mask(i, layer, mask))
    return tuple(layers)


def _with_mask(i: int, layer: AttentionSpec, mask: object) -> AttentionSpec:
    """The layer's attention once its mask is taken into account: a sliding mask gives the window
    (a family may pass none to the attention function); anything but a causal or sliding mask is
    refused, and so is a mask that disagrees with the window the call passes."""
    if mask is None:  # the family relies on the attention's own causality (is_causal)
        mask = MaskShape("causal")
    if not isinstance(mask, MaskShape):
        raise AttentionProbeError(
            f"layer {i} builds an attention mask of its own (position biases such as ALiBi), which "
            "kvscope's paged attention does not apply"
        )
    if mask.kind == "other":
        raise AttentionProbeError(
            f"layer {i}'s attention mask is neither causal nor a sliding window (chunked or bidirectional "
            "attention), which kvscope's paged attention does not apply"
        )
    if layer.window is not None and mask.window != layer.window:
        raise AttentionProbeError(
            f"layer {i} passes a sliding window of {layer.window} but its mask "
            f"{'slides over ' + str(mask.window) if mask.window else 'is fully causal'}; transformers' own "
            "attention paths disagree, so kvscope has no reference to match"
        )
    return AttentionSpec(mask.window, layer.softcap, layer.sinks)


def _layers(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 2 else ", ".join(map(str, ids))
