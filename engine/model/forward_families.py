"""The Llama-shaped families kvscope's own forward runs, each described by what it does unlike Llama.

A Llama-shaped decoder layer is: norm, q/k/v projections, RoPE, attention, o_proj, residual add,
norm, gate/up projections, act(gate) * up, down_proj, residual add. The families differ in a few
places, and only there (engine/model/llama_forward.py reads this table once, at construction, and
runs no op a family does not need):

- how an RMSNorm applies its weight: Llama's `weight * normed.to(dtype)`, OLMo 2's
  `(weight * normed).to(dtype)`, Gemma's `(normed * (1 + weight)).to(dtype)` (the same thing in
  float32 but for Gemma's 1 +);
- where the norms sit: before attention and the MLP (Llama), also on their outputs (Gemma 2/3's
  sandwich), or on their outputs only (OLMo 2);
- q/k norms (Qwen3 and Gemma 3 per head, OLMo 2 over the whole projection: read off the norm's
  width);
- RoPE per layer: Gemma 3's local and global bases (the rotary module takes the layer type),
  SmolLM3's NoPE layers (no rotation at all);
- multipliers: Granite's embedding, residual and logit scaling (its attention multiplier is the
  attention's own `scaling`, like Gemma's query_pre_attn_scalar), Gemma 2/3's final logit soft cap;
- projections the family fuses itself (Phi-3's qkv_proj and gate_up_proj).

What is the same for all of them is read off the model: the activation (the MLP's own function),
the rotary module (every rope scaling type), the embedding (Gemma's sqrt(hidden) scale in the
model's dtype is its embedding module's), biases (the linear layers'), the attention's scaling,
sliding windows and logit soft caps (the load-time probe, engine/model/layer_attention.py).

Each entry names the transformers decoder layer class its parity test ran against
(tests/engine/test_own_forward.py): a model whose layers are of another class runs transformers'
code instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How an RMSNorm applies its weight (see the module docstring).
NormKind = Literal["llama", "olmo", "gemma"]


@dataclass(frozen=True, slots=True)
class ForwardFamily:
    decoder_layer: str  # transformers' decoder layer class this description was checked against
    norm: NormKind = "llama"
    # the decoder layer's norm modules by place; None: the family has no norm there
    before_attention: str | None = "input_layernorm"
    after_attention: str | None = None
    before_mlp: str | None = "post_attention_layernorm"
    after_mlp: str | None = None
    qk_norm: bool = False  # the attention's q_norm / k_norm
    rope_by_layer_type: bool = False  # the rotary module's forward takes the layer's type (Gemma 3)
    rope_switch: str | None = None  # attention attribute that is 0 on a layer without RoPE (SmolLM3)
    # config attributes holding the family's scalars
    embedding_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_divisor: str | None = None
    final_softcap: str | None = None
    # projections the family's own modules fuse (the loader fuses the others where it can)
    qkv_module: str | None = None
    gate_up_module: str | None = None


_SANDWICH_AFTER_ATTENTION = "post_attention_layernorm"  # Gemma 2/3 and OLMo 2 use Llama's name there

FAMILIES: dict[str, ForwardFamily] = {
    "llama": ForwardFamily("LlamaDecoderLayer"),
    "mistral": ForwardFamily("MistralDecoderLayer"),
    "ministral": ForwardFamily("MinistralDecoderLayer"),
    "seed_oss": ForwardFamily("SeedOssDecoderLayer"),
    "qwen2": ForwardFamily("Qwen2DecoderLayer"),
    "qwen3": ForwardFamily("Qwen3DecoderLayer", qk_norm=True),
    "phi3": ForwardFamily("Phi3DecoderLayer", qkv_module="qkv_proj", gate_up_module="gate_up_proj"),
    "gemma": ForwardFamily("GemmaDecoderLayer", norm="gemma"),
    "gemma2": ForwardFamily(
        "Gemma2DecoderLayer",
        norm="gemma",
        after_attention=_SANDWICH_AFTER_ATTENTION,
        before_mlp="pre_feedforward_layernorm",
        after_mlp="post_feedforward_layernorm",
        final_softcap="final_logit_softcapping",
    ),
    "gemma3_text": ForwardFamily(
        "Gemma3DecoderLayer",
        norm="gemma",
        after_attention=_SANDWICH_AFTER_ATTENTION,
        before_mlp="pre_feedforward_layernorm",
        after_mlp="post_feedforward_layernorm",
        qk_norm=True,
        rope_by_layer_type=True,
        final_softcap="final_logit_softcapping",
    ),
    "granite": ForwardFamily(
        "GraniteDecoderLayer",
        embedding_multiplier="embedding_multiplier",
        residual_multiplier="residual_multiplier",
        logits_divisor="logits_scaling",
    ),
    "olmo2": ForwardFamily(
        "Olmo2DecoderLayer",
        norm="olmo",
        before_attention=None,
        after_attention=_SANDWICH_AFTER_ATTENTION,
        before_mlp=None,
        after_mlp="post_feedforward_layernorm",
        qk_norm=True,
    ),
    "olmo3": ForwardFamily(
        "Olmo3DecoderLayer",
        norm="olmo",
        before_attention=None,
        after_attention=_SANDWICH_AFTER_ATTENTION,
        before_mlp=None,
        after_mlp="post_feedforward_layernorm",
        qk_norm=True,
        rope_by_layer_type=True,
    ),
    "smollm3": ForwardFamily("SmolLM3DecoderLayer", rope_switch="use_rope"),
}
