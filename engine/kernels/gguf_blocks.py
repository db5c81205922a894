"""GGUF's quantized blocks read into the storages kvscope's kernels use, codes exact.

  Q4_0  per 32 weights: float16 d, 16 bytes of nibbles       w = (q - 8) * d
  Q4_1  per 32 weights: float16 d, float16 m, 16 bytes       w = q * d + m
  Q4_K  per 256 weights: float16 d, dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes:
        per 32 weights w = q * (d * sc) - dmin * mn
  Q8_0  per 32 weights: float16 d, 32 int8                    w = q * d
Nibbles: byte j of a 32-weight group holds weight j (low nibble) and weight j + 16 (high).

Each decoder returns the codes and the per-group (scale, offset) in float32 such that
`codes * scale + offset` (Q4) or `codes * scale` (Q8_0) is gguf's own dequantization bit for bit;
the tests hold them to that. The int4 kernel stores (scale, zero = offset + 8 * scale) and
computes (code - 8) * scale + zero, so Q4 codes map onto it unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K as _Q4K

from engine.kernels.weights import Int4GroupWeight, Q8BlockWeight

if TYPE_CHECKING:
    from engine.kernels.weights import Int4GroupWeight, Q8BlockWeight

INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
KEPT_TYPES = (*INT4_TYPES, Q.Q8_0)
GROUP = 32


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes (low nibbles first, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_int4(blocks: np.ndarray, qtype: Q, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw rows [N, bytes] of a Q4_0/Q4_1/Q4_K tensor -> (codes uint8 [N, K], scale [N, K/32],
    offset [N, K/32]) as float32 numpy arrays."""
    n = blocks.shape[0]
    groups = cols // GROUP
    if qtype == Q.Q4_0:
        b = blocks.reshape(n, groups, 18)
        scale = _fp16(b[..., :2]).reshape(n, groups)
        codes = _nibbles(b[..., 2:])
        offset = -8.0 * scale  # (q - 8) * d == q * d + (-8 d): the same float32 product and sum
        return codes.reshape(n, cols), scale, offset
    if qtype == Q.Q4_1:
        b = blocks.reshape(n, groups, 20)
        scale = _fp16(b[..., :2]).reshape(n, groups)
        offset = _fp16(b[..., 2:4]).reshape(n, groups)
        return _nibbles(b[..., 4:]).reshape(n, cols), scale, offset
    if qtype == Q.Q4_K:
        supers = cols // 256
        rows = blocks.reshape(n * supers, 144)
        d, dmin = _fp16(rows[:, :2]), _fp16(rows[:, 2:4])
        sc, mn = _Q4K.get_scale_min(rows[:, 4:16])
        scale = (d * sc.astype(np.float32)).reshape(n, groups)
        offset = -(dmin * mn.astype(np.float32)).reshape(n, groups)
        # 128 bytes per super-block: four 32-byte chunks, each holding sub-blocks 2c (low nibbles)
        # and 2c + 1 (high nibbles)
        qs = rows[:, 16:].reshape(n * supers, 4, 32)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, cols)
        return codes, scale, offset
    raise ValueError(f"not a 4-bit GGUF type: {qtype}")


def dequantize_int4(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, qtype: Q) -> np.ndarray:
    """The float32 weights, computed the way gguf computes them."""
    n, cols = codes.shape
    q = codes.reshape(n, cols // GROUP, GROUP).astype(np.float32)
    weights: np.ndarray
    if qtype == Q.Q4_0:
        weights = scale[..., None] * (q - 8.0)
    else:  # Q4_1 and Q4_K: a scale and an offset per group of 32
        weights = scale[..., None] * q + offset[..., None]
    return weights.reshape(n, cols)


def decode_q8_0(blocks: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw rows [N, bytes] of a Q8_0 tensor -> (codes int8 [N, K], scale float32 [N, K/32])."""
    n = blocks.shape[0]
    b = blocks.reshape(n, cols // GROUP, 34)
    scale = _fp16(b[..., :2]).reshape(n, cols // GROUP)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, cols)
    return codes, scale


def int4_storage(
    blocks: np.ndarray, qtype: Q, cols: int, row_order: np.ndarray | None = None
) -> Int4GroupWeight:

    codes, scale, offset = decode_int4(blocks, qtype, cols)
    if row_order is not None:
        codes, scale, offset = codes[row_order], scale[row_order], offset[row_order]
    scale_t = torch.from_numpy(np.ascontiguousarray(scale))
    zero = torch.from_numpy(np.ascontiguousarray(offset)) + 8.0 * scale_t
    return Int4GroupWeight(torch.from_numpy(np.ascontiguousarray(codes)), scale_t, zero)


def q8_storage(blocks: np.ndarray, cols: int, row_order: np.ndarray | None = None) -> Q8BlockWeight:
    codes, scale = decode_q8_0(blocks, cols)
    if row_order is not None:
        codes, scale = codes[row_order], scale[row_order]
    return Q8BlockWeight(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scale).half())
