"""torch's packed int4 CPU layout (`_convert_weight_to_int4pack_for_cpu`), read back.

The packed kernel is the fast path for decode-sized rows; prefill-sized rows are faster through a
dense matmul, so the codes must be readable again to dequantize a layer on the fly. torch does not
document the layout, and it depends on the CPU's vector width (blocks of 64 output rows with
AVX-512, 32 with AVX2), so it is found at first use by packing a probe whose codes name their own
position and matching it against the candidates. A layout no candidate explains is an error at
load, never a silent misread.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True, slots=True)
class Int4CpuLayout:
    """Packed uint8 [N, K/2]: output rows in blocks of `block_n`; within a block, for each input
    column k, `block_n / 2` bytes whose low nibble holds row n and high nibble row n + block_n/2."""

    block_n: int

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The uint8 codes [N, K] (0..15) held by `packed`."""
        blocks = n // self.block_n
        half = self.block_n // 2
        flat = packed.reshape(blocks, k, half)
        low, high = flat & 0x0F, flat >> 4
        return torch.cat([low, high], dim=2).permute(0, 2, 1).reshape(n, k)


_CANDIDATE_BLOCKS = (64, 32, 16)


@cache
def cpu_layout() -> Int4CpuLayout:
    n, k = 128, 64
    rows = torch.arange(n)[:, None]
    cols = torch.arange(k)[None, :]
    codes = ((rows * 7 + cols * 3) % 16).to(torch.int32)  # no two neighbours alike
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    for block_n in _CANDIDATE_BLOCKS:
        layout = Int4CpuLayout(block_n)
        if torch.equal(layout.unpack(packed, n, k).to(torch.int32), codes):
            return layout
    raise RuntimeError(
        f"torch {torch.__version__} packs int4 weights in a layout kvscope does not know; "
        "choose another quantization scheme, or 'none'"
    )


def pack_cpu(codes: torch.Tensor) -> torch.Tensor:
    """int codes [N, K] (0..15) -> torch's packed CPU layout, checked to read back exactly."""
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).contiguous(), 1
    )
    return packed


def rows_multiple() -> int:
    """Output rows must come in whole blocks of the packed layout."""
    return cpu_layout().block_n
