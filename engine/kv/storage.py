"""The real KV storage: per layer, K and V in `[kv_heads, num_blocks, block_size, head_dim]`.

Heads outermost so that a sequence whose blocks are consecutive (a fresh pool hands out ids in
order: the common case of one conversation) reads its keys as a plain view `[kv_heads, L,
head_dim]`, contiguous per head, which is what attention wants: no gather, no transposed view. A
scattered block table is gathered with one index_select per layer.

int8 KV: one scale per (token, head), not per block.
- A token's K/V is written once and never rewritten. A per-block scale would have to be fixed
  before the block's later tokens are known (decode fills a block one slot per step), or the whole
  block re-quantized when a larger value arrives; and full blocks are shared by prefix caching, so
  they must stay immutable.
- Heads differ in range (some K heads carry outlier channels), so heads do not share a scale.
- The cost is one float16 per head_dim int8 values: for head_dim 64, 66 bytes instead of 256
  (fp32, 3.9x the blocks per budget) or 128 (fp16/bf16, 1.94x).
The byte formula is `ModelShapes.kv_bytes_per_token` (one formula for the pool, inspect-model and
the KV calculator).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.model.layer_attention import AttentionSpec

KV_INT8_SCALE_DTYPE = torch.float16
_INT8_MAX = 127
# Scales stay inside float16's range: the smallest subnormal (a zero vector still gets a usable
# scale) up to the largest finite value (beyond it codes saturate instead of becoming inf).
_SCALE_MIN, _SCALE_MAX = 2.0**-24, 65504.0

Blocks = slice | torch.Tensor  # consecutive block ids as a slice, else an index tensor


class PagedKVStorage:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: str = "auto",
        layers: tuple[AttentionSpec, ...] | None = None,
    ):
        if kv_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'int8', got {kv_dtype!r}")
        self.quantized = kv_dtype == "int8"
        shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
        store = torch.int8 if self.quantized else dtype
        # K and V of a layer in one tensor, so one index_copy writes both (k and v are its views)
        self.kv = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.k = [pair[0] for pair in self.kv]
        self.v = [pair[1] for pair in self.kv]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.quantized:
            scale_shape = (num_kv_heads, num_blocks, block_size)
            for scales in (self.k_scale, self.v_scale):
                scales.extend(
                    torch.zeros(scale_shape, dtype=KV_INT8_SCALE_DTYPE, device=device)
                    for _ in range(num_layers)
                )
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.device = torch.device(device)
        # Per layer, the attention transformers' code calls (window, soft cap, sinks), probed at
        # load (engine.model.layer_attention.AttentionSpec); None: as each call says (hand-built).
        if layers is not None and len(layers) != num_layers:
            raise ValueError(f"{len(layers)} layer descriptions for {num_layers} layers")
        self.layers = tuple(layers) if layers is not None else None
        self.bytes_per_block = self.block_bytes(
            num_layers, block_size, num_kv_heads, head_dim, dtype, kv_dtype
        )

    @staticmethod
    def block_bytes(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
    ) -> int:
        """Bytes one block takes over all layers, K and V, scales included (pool sizing)."""
        from engine.model.shapes import kv_bytes_per_token

        return block_size * kv_bytes_per_token(
            num_layers, num_kv_heads, head_dim, _dtype_name(dtype), kv_dtype
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def copy_block(self, src: int, dst: int) -> None:
        for pool in (*self.k, *self.v, *self.k_scale, *self.v_scale):
            pool[:, dst].copy_(pool[:, src])

    def write_kv(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """K and V together, kv [T, 2, kv_heads, head_dim] (as a fused projection lays them out):
        one index_copy into the layer's pool (or, int8, the per-token quantizing write)."""
        if self.quantized:
            self._write_int8(layer, slots, kv[:, 0], kv[:, 1])
            return
        flat = self.kv[layer].view(2, self.num_kv_heads, -1, self.head_dim)
        flat.index_copy_(2, slots, kv.permute(1, 2, 0, 3).to(self.dtype))

    # ---- writing ---------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [T, kv_heads, head_dim] into flat slots (block * block_size + offset)."""
        if self.quantized:
            self._write_int8(layer, slots, key, value)
            return
        flat = (self.num_kv_heads, -1, self.head_dim)
        self.k[layer].view(flat).index_copy_(1, slots, key.transpose(0, 1).to(self.dtype))
        self.v[layer].view(flat).index_copy_(1, slots, value.transpose(0, 1).to(self.dtype))

    def _write_int8(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        heads, dim = self.num_kv_heads, self.head_dim
        for states, pools, scales in ((key, self.k, self.k_scale), (value, self.v, self.v_scale)):
            scale = (states.abs().amax(dim=-1).float() / _INT8_MAX).clamp(_SCALE_MIN, _SCALE_MAX)
            scale = scale.to(KV_INT8_SCALE_DTYPE)
            # quantize with the float16-rounded scale, the one dequantization will multiply by
            codes = torch.round(states.float() / scale.float()[..., None]).clamp(-_INT8_MAX, _INT8_MAX)
            pools[layer].view(heads, -1, dim).index_copy_(1, slots, codes.to(torch.int8).transpose(0, 1))
            scales[layer].view(heads, -1).index_copy_(1, slots, scale.t())

    # ---- reading ---------------------------------------------------------------------------
    def read(
        self, layer: int, blocks: Blocks, start: int, stop: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V at positions [start, stop), through its blocks (a `block_index`
        result covering at least `stop` tokens): two [kv_heads, stop - start, head_dim] tensors,
        dequantized to `dtype` when stored as int8. A view of the pool when the blocks are
        consecutive and the pool holds `dtype` already."""
        skip = start // self.block_size  # blocks wholly before the window are not read at all
        if skip:
            blocks = (
                blocks[skip:] if not isinstance(blocks, slice) else slice(blocks.start + skip, blocks.stop)
            )
            start, stop = start - skip * self.block_size, stop - skip * self.block_size
        out = []
        for pools, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            codes = _tokens(pools[layer], blocks)[:, start:stop]
            if not self.quantized:
                out.append(codes if codes.dtype == dtype else codes.to(dtype))
                continue
            scale = _tokens(scales[layer], blocks)[:, start:stop]
            out.append(codes.to(dtype) * scale[..., None].to(dtype))
        return out[0], out[1]

    def gather(
        self, layer: int, blocks: Blocks, context_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `context_len` K and V of a sequence: [kv_heads, context_len, head_dim] each."""
        return self.read(layer, blocks, 0, context_len, dtype)


def _tokens(pool: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """pool [heads, blocks, block_size, ...] at `blocks`, flattened to [heads, tokens, ...].
    index_select, not pool[tensor]: advanced indexing takes a slow generic path on CPU (~300x
    slower for a decode-sized gather, measured)."""
    picked = pool[:, blocks] if isinstance(blocks, slice) else pool.index_select(1, blocks)
    return picked.flatten(1, 2)


def block_index(block_ids: list[int], device: torch.device) -> Blocks:
    """How to reach a sequence's blocks in a pool: a slice when the ids are consecutive (the
    blocks are then one view of the pool, nothing is copied), else an index tensor."""
    first = block_ids[0] if block_ids else 0
    if block_ids == list(range(first, first + len(block_ids))):
        return slice(first, first + len(block_ids))
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
