"""Checks made before any weight is read: the device, the dtype on it, and whether the weights fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.measure.memory import available_memory_bytes
from engine.model.errors import ModelLoadError
from engine.model.shapes import ModelShapes
from engine.units import format_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

# ---- device, dtype, memory -------------------------------------------------------------------
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when torch can use it; 'cuda' without CUDA is refused with the reason."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = (
            "this PyTorch build has no CUDA support (a CPU-only wheel)"
            if torch.version.cuda is None
            else "PyTorch finds no usable NVIDIA GPU or driver"
        )
        raise ModelLoadError(f"The GPU (cuda) was requested, but {why}. Choose device 'cpu' or 'auto'.")
    return torch.device(name)


def check_dtype_on_device(dtype: str, device: torch.device) -> None:
    if dtype == "float16" and device.type == "cpu":
        raise ModelLoadError(
            "float16 is not offered on the CPU: most CPUs have no fast float16 arithmetic, and PyTorch "
            "would run it slower than float32. Choose float32 or bfloat16 on the CPU, or float16 on a GPU."
        )
    if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ModelLoadError(
            f"bfloat16 is not supported by {torch.cuda.get_device_name(device)}. Choose float16 or float32."
        )


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
