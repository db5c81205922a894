"""What each layer's attention does beyond causal softmax(Q K^T * scale) V, read once from the config.

The paged attention (engine/kv/paged_cache.py) reads every layer's K/V through block tables; to
give the same tokens as the family's own attention it must also apply, per layer:

- a sliding window: `layer_types[i] == "sliding_attention"` (Gemma 2/3, Cohere 2, gpt-oss, Qwen2
  with `use_sliding_window`...) or, for families without `layer_types`, `sliding_window` on every
  layer (Mistral, Mixtral, Starcoder2, Phi-3). A query at position p sees keys in (p - window, p],
  transformers' `sliding_window_overlay`;
- logit soft-capping (Gemma 2's `attn_logit_softcapping`): logits -> cap * tanh(logits / cap)
  before the mask;
- attention sinks (gpt-oss's `module.sinks`): one learned logit per head joins the softmax and
  carries no value.

The scaling needs nothing here: every family's attention passes its own `scaling` (Gemma's
`query_pre_attn_scalar`, Granite's `attention_multiplier`...) to the attention function.
tests/engine/test_family_parity.py checks, for every supported family, that this reading equals
what transformers' modules pass to the attention function, and that the tokens equal generate().
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING, FULL = "sliding_attention", "full_attention"

# Families whose attention adds per-head sink logits (transformers passes `s_aux=module.sinks`).
SINK_FAMILIES = frozenset({"gpt_oss"})


@dataclass(frozen=True, slots=True)
class LayerAttention:
    window: int | None = None  # sliding window in tokens (the query itself included); None = full
    softcap: float | None = None  # attention-logit soft cap; None = none
    sinks: bool = False  # the module's `sinks` parameter joins the softmax

    @property
    def plain(self) -> bool:
        """Causal attention that SDPA computes as is (a window only narrows the keys and mask)."""
        return self.softcap is None and not self.sinks


class LayerTypeError(ValueError):
    """A layer type the paged attention does not implement (linear attention, chunks, Mamba...)."""


def text_config(config):
    """The decoder's config (multimodal wrappers keep it in `text_config`)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def layer_types_of(config) -> list[str]:
    """Each layer's attention type, as the family's own config names it."""
    config = text_config(config)
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    uses_window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return [SLIDING if uses_window else FULL] * config.num_hidden_layers


def layer_attention(config) -> tuple[LayerAttention, ...]:
    """One LayerAttention per layer. Raises LayerTypeError for a layer type it cannot serve."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    softcap = getattr(text, "attn_logit_softcapping", None) or None
    sinks = getattr(text, "model_type", None) in SINK_FAMILIES
    layers = []
    for i, kind in enumerate(layer_types_of(text)):
        if kind == SLIDING:
            if not window:
                raise LayerTypeError(f"layer {i} slides but the config gives no sliding_window")
            layers.append(LayerAttention(int(window), softcap, sinks))
        elif kind == FULL:
            layers.append(LayerAttention(None, softcap, sinks))
        else:
            raise LayerTypeError(f"layer {i} is a '{kind}' layer, which paged attention does not implement")
    return tuple(layers)
