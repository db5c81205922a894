"""inspect-model: what a model costs in memory, read from its config or GGUF metadata only.

Answers "will it fit, and how much context can I afford?" before anything is loaded: weights
for a dtype, KV-cache bytes per token (GQA included), KV for a context, and the longest context
whose KV fits in a memory budget next to the weights.
"""

from __future__ import annotations

from engine.config import DTYPES, ConfigError
from engine.measure.memory import available_memory_bytes
from engine.model.checks import resolve_device
from engine.model.configs import read_config
from engine.model.shapes import ModelShapes
from engine.model.sources import resolve_source


def inspect_model(
    source: str, dtype: str = "float32", context: int | None = None, budget_gib: float | None = None
) -> dict:
    """Shapes and memory figures of `source` ('default', a folder, a .gguf file or a cached repo
    id) in `dtype`. `context` defaults to the model's maximum; `budget_gib` defaults to the memory
    available now on the device a load would pick.

    Raises ModelLoadError for a missing or unreadable source, ConfigError for bad numbers."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if context is not None and context < 1:
        raise ConfigError(f"context must be at least 1 token, got {context}")
    if budget_gib is not None and budget_gib <= 0:
        raise ConfigError(f"the memory budget must be more than 0 GiB, got {budget_gib}")

    src = resolve_source(source)
    shapes = ModelShapes.from_config(read_config(src))
    context = shapes.max_position_embeddings if context is None else context
    weight_bytes = shapes.weight_bytes(dtype)
    kv_per_token = shapes.kv_bytes_per_token(dtype)
    if budget_gib is None:
        device = resolve_device("auto")
        budget_bytes = available_memory_bytes(device)
        budget_source = f"available {'GPU memory' if device.type == 'cuda' else 'RAM'} now"
    else:
        budget_bytes = int(budget_gib * 2**30)
        budget_source = "given"
    return {
        "name": src.name,
        "source": source,
        "path": str(src.path),
        "dtype": dtype,
        "architecture": shapes.architecture,
        "num_layers": shapes.num_layers,
        "num_kv_heads": shapes.num_kv_heads,
        "num_heads": shapes.num_heads,
        "head_dim": shapes.head_dim,
        "hidden_size": shapes.hidden_size,
        "vocab_size": shapes.vocab_size,
        "max_position_embeddings": shapes.max_position_embeddings,
        "params": shapes.params,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "context": context,
        "kv_bytes_for_context": kv_per_token * context,
        "budget_bytes": budget_bytes,
        "budget_source": budget_source,
        "weights_fit_in_budget": weight_bytes <= budget_bytes,
        # What is left after the weights, in whole tokens of KV (0 when the weights alone overflow).
        "max_context_tokens_in_budget": max(0, budget_bytes - weight_bytes) // kv_per_token,
    }
