"""Tensor math shared by the schemes: symmetric int8 per-channel quantization, asymmetric
group-wise int4 quantization, and the int4 nibble packing torch's CPU kernel consumes.

All functions are pure (tensors in, tensors out), so the tests can check each round trip
without building a layer.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT4_LEVELS = 15  # unsigned 4-bit codes 0..15
INT4_MID = 8  # torch's int4 kernels subtract 8 from every code before scaling
# A row (or group) of zeros would get a zero scale and divide by zero; any positive floor works
# because the codes of an all-zero row are zero anyway.
MIN_SCALE = 1e-8


def quantize_int8_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int8 codes [N, K], float32 scales [N]) with w ~= codes * scales[:, None].

    Symmetric around 0 with +-127 (not -128) so that negation is exact and the grid is centred."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=MIN_SCALE)
    codes = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def dequantize_int8_per_row(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]


def quantize_int4_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes int32 [N, K] in 0..15, scales [N, K/g], zeros [N, K/g]) such that
    w ~= (codes - 8) * scale + zero within each group of `group_size` input columns.

    Asymmetric (min/max) groups, the layout torch's `_weight_int4pack_mm*` kernels expect:
    `zero` is the value of code 8, so the kernel computes (code - 8) * scale + zero."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"input width {k} is not a multiple of the int4 group size {group_size}")
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / INT4_LEVELS).clamp(min=MIN_SCALE)
    codes = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, INT4_LEVELS)
    zeros = lo + INT4_MID * scales
    return codes.to(torch.int32).reshape(n, k), scales, zeros


def dequantize_int4_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    n, k = codes.shape
    groups = codes.float().reshape(n, k // group_size, group_size) - INT4_MID
    return (groups * scales[..., None] + zeros[..., None]).reshape(n, k)


def pack_int4_pairs(codes: torch.Tensor) -> torch.Tensor:
    """int32 codes [N, K] (0..15) -> uint8 [N, K/2]: column 2j in the high nibble, 2j+1 in the
    low one (the input torch's CUDA `_convert_weight_to_int4pack` takes, as torchao packs it;
    the CPU converter takes the unpacked int32 codes instead)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] << 4) | c[:, 1::2]


def unpack_int4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4_pairs`: uint8 [N, K/2] -> int32 codes [N, K]."""
    high, low = packed >> 4, packed & 0x0F
    return torch.stack([high, low], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, G] scales and zeros -> the [G, N, 2] tensor the int4 kernels take."""
    return torch.stack([scales.t(), zeros.t()], dim=-1).contiguous().to(dtype)
