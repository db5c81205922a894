"""Shapes of a decoder-only transformer read from its config: the single source for parameter
counts and the KV-cache memory formula (used by inspect-model, the KV pool sizing and the app)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}
# int8 KV keeps one float16 scale per (token, head) beside the codes (engine/model/kv_storage.py).
KV_INT8_SCALE_BYTES = 2


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, kv_dtype: str = "auto"
) -> int:
    """THE KV formula: 2 (K and V) x layers x kv_heads x (head_dim x element bytes), where int8 KV
    stores 1-byte codes plus a float16 scale per head. GQA/MQA shrink kv_heads. The pool, the
    inspect-model report and the KV calculator all use it. `kv_dtype`: "auto" (elements in
    `dtype`), "int8", or the element dtype itself (what `auto_kv_dtype` resolves "auto" to)."""
    if kv_dtype == "int8":
        per_head = head_dim + KV_INT8_SCALE_BYTES
    else:
        per_head = head_dim * DTYPE_BYTES[dtype if kv_dtype == "auto" else kv_dtype]
    return 2 * num_layers * num_kv_heads * per_head


def auto_kv_dtype(dtype: str, native_bits: bool) -> str:
    """What a KV pool stores when its config says "auto", for a model computing in `dtype`: that
    dtype, except float16 for a model whose weights stay at a GGUF's own bits and compute in
    float32. Such a model's K/V are computed in float32 from weights of 4-8 bits; llama.cpp keeps
    them in float16 by default, and float32 doubled both the pool's memory and what each decode
    step's attention reads (a 1.7B model at a few hundred tokens of context: ~4 ms of a ~45 ms
    token). A float32 model of a folder keeps a float32 pool: its parity with transformers is
    exact."""
    return "float16" if native_bits and dtype == "float32" else dtype


@dataclass(frozen=True, slots=True)
class ModelShapes:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @staticmethod
    def from_config(config: Any) -> ModelShapes:
        """`config` is a transformers PreTrainedConfig (or anything with the same attributes; typed
        Any because this module stays free of transformers, and a config's fields are dynamic)."""
        archs = getattr(config, "architectures", None) or [
            type(config).__name__.replace("Config", "ForCausalLM")
        ]
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return ModelShapes(
            architecture=archs[0],
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, "intermediate_size", 4 * config.hidden_size),
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def params(self) -> int:
        """Parameter count of a Llama-style block stack (q/k/v/o, gated MLP, two RMSNorms),
        the embedding, the final norm and the LM head unless tied."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + h + head

    def kv_bytes_per_token(self, dtype: str = "float32", kv_dtype: str = "auto") -> int:
        """KV bytes per token for weights in `dtype` and a pool of `kv_dtype` (see kv_bytes_per_token)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype, kv_dtype)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V values per token over all layers (times any element size gives bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def weight_bytes(self, dtype: str = "float32") -> int:
        return self.params * DTYPE_BYTES[dtype]
