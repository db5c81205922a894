"""inspect-model: what a model costs in memory, read from its config or GGUF metadata only.

Answers "will it fit, and how much context can I afford?" before anything is loaded: the weights
as the load will hold them (a GGUF's per tensor type, kept at its bits or dequantized, the head's
extra copy: engine.model.gguf_plan, the loader's own table; other models' parameters in the
dtype), KV-cache bytes per token (GQA included), KV for a context, the longest context whose KV
fits in a memory budget next to the weights, and the runtime the load sits beside, measured
(engine.model.runtime_memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import AUTO, DTYPES, ConfigError
from engine.errors import ModelLoadError
from engine.measure.device import resolve_device
from engine.measure.memory import available_memory_bytes
from engine.model.configs import read_config
from engine.model.gguf_native import NATIVE
from engine.model.gguf_plan import plan_file
from engine.model.loading import resolve_scheme
from engine.model.runtime_memory import runtime_estimate
from engine.model.sources import ModelSource, resolve_source
from engine.model.support import support_for
from engine.shapes import ModelShapes, auto_kv_dtype

if TYPE_CHECKING:
    from engine.model.gguf_plan import GGUFPlan


def inspect_model(
    source: str,
    dtype: str = "float32",
    context: int | None = None,
    budget_gib: float | None = None,
    quantization: str = "auto",
) -> dict[str, Any]:
    """Shapes and memory figures of `source` ('default', a folder, a .gguf file or a cached repo
    id) in `dtype`. `context` defaults to the model's maximum; `budget_gib` defaults to the memory
    available now on the device a load would pick. A GGUF's weights count at their own bits where
    `quantization` keeps them so ('auto' or 'native', on the CPU), else in `dtype`.

    Raises ModelLoadError for a missing or unreadable source, ConfigError for bad numbers."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if context is not None and context < 1:
        raise ConfigError(f"context must be at least 1 token, got {context}")
    if budget_gib is not None and budget_gib <= 0:
        raise ConfigError(f"the memory budget must be more than 0 GiB, got {budget_gib}")

    src = resolve_source(source)
    config = read_config(src)
    support = support_for(config)
    try:
        shapes = ModelShapes.from_config(config)
    except Exception:  # noqa: BLE001 - per-layer shapes (heterogeneous configs), missing fields
        why = support.refusal or "its configuration lacks a transformer shape kvscope reads"
        raise ModelLoadError(f"{src.name} cannot be inspected: {why}.") from None
    report: dict[str, Any] = {"name": src.name, "source": source, "path": str(src.path)}
    plan = None
    if src.gguf is not None:
        # a GGUF's tensors as the load will hold them: natively, or dequantized to the dtype (a
        # scheme that requantizes them counts the dequantized parameters, as any folder does)
        native = keeps_own_bits(quantization, src)
        if native or quantization in ("none", AUTO):
            plan = plan_file(src.gguf, dtype, native=native)
    report.update(memory_estimate(shapes, dtype, context, budget_bytes_for(budget_gib), plan))
    # the process with those weights and the KV of `context` tokens beside its runtime, measured
    runtime = runtime_estimate(resolve_device("auto").type)
    report.update(runtime.as_dict(report["weight_bytes"], report["kv_bytes_for_context"]))
    report["supported"] = support.ok
    report["support"] = support.family if support.ok else support.refusal
    return report


def budget_bytes_for(budget_gib: float | None) -> tuple[int, str]:
    """(bytes, where the figure comes from): the given budget, or the memory free now on the
    device a load would pick."""
    if budget_gib is not None:
        return int(budget_gib * 2**30), "given"
    device = resolve_device("auto")
    return available_memory_bytes(device), f"available {'GPU memory' if device.type == 'cuda' else 'RAM'} now"


def keeps_own_bits(quantization: str, src: ModelSource) -> bool:
    """Whether loading `src` with `quantization` on the device a load picks keeps a GGUF's own
    blocks (the loader's own rule), so that its weights take about the file's size: its tensors,
    plus a little metadata. A choice the loader refuses counts as not kept."""

    try:
        return resolve_scheme(quantization, src, resolve_device("auto")) == NATIVE
    except ModelLoadError:
        return False


def memory_estimate(
    shapes: ModelShapes,
    dtype: str,
    context: int | None,
    budget: tuple[int, str],
    plan: GGUFPlan | None = None,
) -> dict[str, Any]:
    """Weights + KV for `context` tokens (the model's maximum when None) against `budget`, the
    figures inspect-model prints and the Hub's file list shows before a download. A GGUF's
    weights are its `plan`'s: what the load holds for each of its tensors (engine.model.gguf_plan);
    other weights count their parameters in `dtype`."""
    budget_bytes, budget_source = budget
    context = shapes.max_position_embeddings if context is None else context
    weights = shapes.weight_bytes(dtype) if plan is None else plan.held_bytes
    native = plan is not None and plan.native
    kv_dtype = auto_kv_dtype(dtype, native)  # as the engine's "auto" pool will store it
    kv_per_token = shapes.kv_bytes_per_token(dtype, kv_dtype)
    return {
        "dtype": dtype,
        # the weights' format: the chosen dtype, or a GGUF's own bits where the load keeps them
        "weights_as": "native" if native else dtype,
        # per GGML type: kept (as which storage) or dequantized (to which dtype), and its bytes
        "weight_plan": plan.as_dict() if plan is not None else None,
        "weights_summary": plan.summary() if plan is not None else f"{shapes.params:,} parameters in {dtype}",
        "architecture": shapes.architecture,
        "num_layers": shapes.num_layers,
        "num_kv_heads": shapes.num_kv_heads,
        "num_heads": shapes.num_heads,
        "head_dim": shapes.head_dim,
        "hidden_size": shapes.hidden_size,
        "vocab_size": shapes.vocab_size,
        "max_position_embeddings": shapes.max_position_embeddings,
        "params": shapes.params,
        "weight_bytes": weights,
        "kv_dtype": kv_dtype,
        "kv_bytes_per_token": kv_per_token,
        "context": context,
        "kv_bytes_for_context": kv_per_token * context,
        "budget_bytes": budget_bytes,
        "budget_source": budget_source,
        "weights_fit_in_budget": weights <= budget_bytes,
        "fits_with_context": weights + kv_per_token * context <= budget_bytes,
        # What is left after the weights, in whole tokens of KV (0 when the weights alone overflow).
        "max_context_tokens_in_budget": max(0, budget_bytes - weights) // kv_per_token,
    }
