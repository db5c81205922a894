"""Tiny random configs of every family kvscope serves (engine/model/support.py SUPPORTED).

Small enough to build in well under a second: 2 layers, hidden 64, 4 query heads over 2 KV heads
where the family has separate KV heads. Two things make them real tests rather than formalities:
- weights drawn with a large initializer range (0.2, not 0.02): with the usual range a tiny
  model's attention barely moves its logits, and a paged attention that forgot the history, the
  window or the soft cap would still give the same greedy tokens (measured: GPT-2, Cohere, Gemma
  and a dozen more did);
- a sliding window of 8 tokens on one of the two layers wherever the family has sliding layers,
  so prompts of 40 tokens run far past it.
tests/engine/test_family_parity.py proves, per family, that breaking each of those changes the
tokens.
"""

from __future__ import annotations

import inspect

import torch

VOCAB = 300
WINDOW = 8

GENERIC = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
    # mixtures of experts: a handful of small experts
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
    shared_expert_intermediate_size=32,
    sliding_window=WINDOW,
    # GPT-2-style names
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=256,
    n_inner=128,
)

# What the generic sizes do not cover, per family.
OVERRIDES: dict[str, dict] = {
    "gptj": dict(rotary_dim=8),
    "codegen": dict(rotary_dim=8),
    # Gemma scales queries by query_pre_attn_scalar ** -0.5 (256 by default: logits 4x smaller
    # than 1/sqrt(head_dim) here, too flat for the test to see the window or the soft cap), and
    # its embeddings by sqrt(hidden): with a tied head, the last input token outscores any
    # attention effect, so the tiny Gemmas get a head of their own.
    "gemma": dict(tie_word_embeddings=False),
    "gemma2": dict(query_pre_attn_scalar=16, attn_logit_softcapping=5.0, tie_word_embeddings=False),
    "gemma3_text": dict(query_pre_attn_scalar=16, tie_word_embeddings=False),
    "vaultgemma": dict(query_pre_attn_scalar=16, attn_logit_softcapping=5.0, tie_word_embeddings=False),
    # Qwen2-style configs slide only from max_window_layers on, and only with use_sliding_window
    "qwen2": dict(use_sliding_window=True, max_window_layers=1),
    "qwen2_moe": dict(use_sliding_window=True, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, max_window_layers=1),
    "qwen3_moe": dict(use_sliding_window=True, max_window_layers=1),
    # SmolLM3 drops RoPE on every no_rope_layer_interval-th layer (its 4 would keep both layers
    # rotary here): the second layer is NoPE, and its config makes the NoPE layers the sliding ones
    "smollm3": dict(use_sliding_window=True, max_window_layers=1, no_rope_layer_interval=2),
    # Phi-4-mini rotates only part of each head (0.75 of it): kvscope's forward rotates what the
    # rotary module's tables cover
    "phi3": dict(partial_rotary_factor=0.5),
    # Granite's multipliers are 1.0 by default, where a forward that forgot them would still agree:
    # granite-3.0-2b's embedding, residual and logit scaling
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0),
    # ModernBERT's window is half its local_attention span
    "modernbert-decoder": dict(local_attention=2 * WINDOW),
    # not served (tests/engine/test_support.py shows why), but built by the refusal tests
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
}

SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]


def _accepted(cls) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    accepted = _accepted(cls)
    kwargs = {k: v for k, v in GENERIC.items() if k in accepted}
    for std, alias in getattr(cls, "attribute_map", {}).items():
        if std in kwargs and alias in kwargs:  # one name per setting
            kwargs.pop(alias)
    overrides = OVERRIDES.get(model_type, {})
    # Families with per-layer types get one sliding and one full layer (unless told otherwise).
    if "layer_types" in accepted and "sliding_window" in accepted and "use_sliding_window" not in overrides:
        kwargs["layer_types"] = SLIDING_THEN_FULL
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_model(model_type: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # no SDPA kernel for this family: transformers' eager attention
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()
