"""Checked before any weight is read: whether the weights fit in the memory left (the device and
the dtype on it are engine.measure.device's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.errors import ModelLoadError
from engine.measure.memory import available_memory_bytes
from engine.shapes import ModelShapes
from engine.units import format_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def check_fits(
    config: PreTrainedConfig,
    dtype: str,
    device: torch.device,
    name: str,
    available_bytes: int | None = None,
    nbytes: int | None = None,
) -> int:
    """Refuse, before any weight is read, a model whose weights alone exceed the free memory.
    Returns the estimated weight bytes (`nbytes` when the caller knows them: a GGUF kept at its
    own bits takes about its file's size)."""
    try:
        needed = ModelShapes.from_config(config).weight_bytes(dtype) if nbytes is None else nbytes
    except AttributeError as exc:
        raise ModelLoadError(
            f"{name}'s configuration lacks a transformer shape kvscope needs ({exc}); it cannot be served."
        ) from None
    available = available_memory_bytes(device) if available_bytes is None else available_bytes
    if needed > available:
        where = "free GPU memory" if device.type == "cuda" else "available RAM"
        smaller = " bfloat16 halves it;" if dtype == "float32" else ""
        raise ModelLoadError(
            f"{name} will not fit: its weights need about {format_bytes(needed)}"
            f"{'' if nbytes is not None else ' in ' + dtype}, but only "
            f"{format_bytes(available)} of {where} is left.{smaller} choose a smaller model or close other programs."
        )
    return needed
