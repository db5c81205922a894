"""KV-cache memory of a model config, for the calculator (no Qt here).

Per token, every layer stores a key and a value vector for each KV head:
    2 x layers x kv_heads x head_dim x bytes per element
(an int8 cache adds one float16 scale per head to each vector). Grouped-query attention
(kv_heads < query heads) and multi-query attention (kv_heads = 1) shrink it by the group size;
context and batch multiply it. The bytes are engine.shapes' `kv_bytes_per_token`, the one
formula the engine sizes its pool with, over the few shapes typed here, so any config can be
explored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import DTYPES
from engine.shapes import DTYPE_BYTES, KV_INT8_SCALE_BYTES, kv_bytes_per_token

# What the engine's KV pool can store: the model's own dtype (kv_dtype "auto") or int8 codes
# with float16 scales (kv_dtype "int8").
INT8 = "int8"
KV_DTYPES = (*DTYPES, INT8)


@dataclass(frozen=True, slots=True)
class KVConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # what the K/V are stored in: a model dtype, or "int8" (codes + float16 scales)
    context: int
    batch: int = 1
    num_heads: int = 0  # query heads; 0 when unknown (then no GQA comparison)
    weight_bytes: int = 0
    budget_bytes: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "context", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('num_', '').replace('_', ' ')} must be at least 1")
        if self.num_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} query heads cannot be shared evenly by {self.num_kv_heads} KV heads"
            )
        if self.weight_bytes < 0 or self.budget_bytes < 0:
            raise ValueError("weights and budget cannot be negative")

    @property
    def quantized(self) -> bool:
        return self.dtype == INT8

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def scale_bytes(self) -> int:
        """Bytes of the scale stored per head and vector (an int8 cache's float16 scale)."""
        return KV_INT8_SCALE_BYTES if self.quantized else 0

    @property
    def bytes_per_token(self) -> int:
        kv_dtype = "int8" if self.quantized else "auto"
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, kv_dtype)

    @property
    def bytes_per_sequence(self) -> int:
        return self.bytes_per_token * self.context

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_sequence * self.batch

    @property
    def mha_bytes_per_token(self) -> int | None:
        """What one token would take with a KV head per query head (plain multi-head attention)."""
        return self.bytes_per_token // self.num_kv_heads * self.num_heads if self.num_heads else None

    @property
    def bytes_beside_weights(self) -> int:
        return max(0, self.budget_bytes - self.weight_bytes)

    @property
    def tokens_in_budget(self) -> int:
        """KV tokens (over all sequences) that fit in the budget once the weights are in."""
        return self.bytes_beside_weights // self.bytes_per_token

    @property
    def tokens_per_sequence_in_budget(self) -> int:
        return self.tokens_in_budget // self.batch

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.bytes_beside_weights

    def kv_bytes(self, contexts: np.ndarray, batch: int) -> np.ndarray:
        """KV bytes of `batch` sequences at each of `contexts` tokens."""
        return np.asarray(contexts, dtype=np.float64) * self.bytes_per_token * batch


def kv_storage(dtype: str, kv_dtype: str) -> str:
    """The calculator's KV dtype for an engine whose "auto" pool stores `dtype`, configured with
    `kv_dtype` (engine.config.KV_DTYPES): what its pool stores."""
    return dtype if kv_dtype == "auto" else kv_dtype


def chart_batches(batch: int) -> list[int]:
    """The batch sizes the chart draws: 1, 4, 16, 64 (a decade of serving loads) and the chosen one."""
    return sorted({1, 4, 16, 64, batch})
