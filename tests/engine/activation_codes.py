"""Activations rounded as kvk's kernels round them (tests of the products' exactness)."""

from __future__ import annotations

import numpy as np
import torch


def rounded_activations(x: torch.Tensor) -> np.ndarray:
    """x quantized as kvk does, back in float64: per group of 256 inputs d = amax / 32767 and
    q = round(x * (32767 / amax)) (round to nearest even, float32 arithmetic), clamped to
    +-32767: x ~ d * q, one 16-bit plane."""
    f32 = np.float32
    v = x.numpy().astype(f32)
    out = np.zeros(v.shape, dtype=np.float64)
    for g in range(0, v.shape[1], 256):
        part = v[:, g : g + 256]
        amax = np.abs(part).max(-1, keepdims=True)
        d = (amax / f32(32767)).astype(f32)
        inv = np.where(amax > 0, f32(32767) / np.where(amax > 0, amax, 1), 0).astype(f32)
        q = np.clip(np.rint((part * inv).astype(f32)), -32767, 32767)
        out[:, g : g + 256] = d.astype(np.float64) * q
    return out
