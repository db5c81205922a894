"""Which device a model runs on and in which dtypes: 'auto' resolved, a device torch cannot use
refused with the reason, a dtype the device has no fast arithmetic for refused likewise."""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError

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
