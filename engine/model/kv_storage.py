"""The real KV storage: per layer, K and V in `[num_blocks, kv_heads, block_size, head_dim]`.

Blocks outermost, then heads: a block's keys for one KV head are one contiguous [block_size,
head_dim] matrix, and a run of blocks is a uniform batch of them. Decode attention
(engine/model/decode_attention) multiplies exactly those matrices, so a sequence whose blocks are
consecutive (a fresh pool hands out ids in order: the common case of one conversation) is read
as a plain view of the pool, and a scattered block table is gathered with one index_select per
layer. A prefill chunk's attention wants [kv_heads, tokens, head_dim], which `read` assembles.
A new token's K/V is written with one index_copy per layer through `slot_rows`, the flat row of
each of its heads, computed once per step.

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

import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.limits import blocks_for_tokens
from engine.shapes import kv_bytes_per_token

if TYPE_CHECKING:
    from engine.model.layer_attention import AttentionSpec

KV_INT8_SCALE_DTYPE = torch.float16
_INT8_MAX = 127
# Scales stay inside float16's range: the smallest subnormal (a zero vector still gets a usable
# scale) up to the largest finite value (beyond it codes saturate instead of becoming inf).
_SCALE_MIN, _SCALE_MAX = 2.0**-24, 65504.0

Blocks = slice | torch.Tensor  # consecutive block ids as a slice, else an index tensor

# A pool's formats: "auto" stores the model's dtype; "float16" float16 whatever the model's dtype
# (`--kv-dtype float16`, and what LoadedModel.kv_dtype_for resolves "auto" to for a GGUF at its own
# bits: engine.shapes.auto_kv_dtype); "int8" codes with a scale per (token, head).
STORED_AS: dict[str, torch.dtype | None] = {"auto": None, "float16": torch.float16, "int8": torch.int8}


@dataclass(slots=True)
class SeqSlice:
    """One sequence's share of a packed forward."""

    q_start: int  # first of its query tokens in the packed row
    q_len: int  # query tokens this step
    context_len: int  # tokens in the cache after this step (past + new)
    blocks: Blocks  # the blocks covering context_len tokens (see storage.block_index)


def fills_lazily(device: torch.device | str) -> bool:
    """Whether a pool on `device` is resident only as its blocks are touched: on the CPU it lives
    in anonymous memory the kernel maps zero-filled on demand (`_zero_pool`), so unwritten slots
    read as zeros and untouched blocks cost nothing. The fit estimate counts a load's process
    without it."""
    return torch.device(device).type == "cpu"


def _zero_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor. On the CPU, in an anonymous mapping rather than torch.zeros's memset:
    its pages are zero and not resident until touched. The engine touches only the blocks its
    sequences hold (kvk's rows read written positions; the int8 gather and the torch decode path
    read whole held blocks, whose unwritten slots read as zeros), so a 256 MiB pool for a short
    chat costs what the chat holds."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    # the tensor keeps the mapping alive (torch.frombuffer holds the buffer); unmapped with it
    return torch.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=dtype, count=count).view(shape)


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
        if kv_dtype not in STORED_AS:
            raise ValueError(f"kv_dtype must be one of {', '.join(STORED_AS)}, got {kv_dtype!r}")
        self.quantized = kv_dtype == "int8"
        shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
        store = STORED_AS[kv_dtype] or dtype
        self.store_dtype = store
        # K and V of a layer in one tensor, so one index_select gathers both (k and v are its views).
        # Every slot reads as zero until written (the torch decode path reads whole blocks under a
        # mask, so each must hold a finite value); on the CPU its pages become resident only as
        # blocks are written (_zero_pool).
        self.lazy = fills_lazily(device)
        self.kv = [_zero_pool(shape, store, device) for _ in range(num_layers)]
        self.k = [pair[0] for pair in self.kv]
        self.v = [pair[1] for pair in self.kv]
        # each layer's (K, V) pool address: the fused layers' C calls read them every step
        self.kv_addresses = [(k.data_ptr(), v.data_ptr()) for k, v in zip(self.k, self.v)]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.quantized:
            scale_shape = (num_blocks, num_kv_heads, block_size)
            for scales in (self.k_scale, self.v_scale):
                scales.extend(_zero_pool(scale_shape, KV_INT8_SCALE_DTYPE, device) for _ in range(num_layers))
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

        return block_size * kv_bytes_per_token(
            num_layers, num_kv_heads, head_dim, _dtype_name(dtype), kv_dtype
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def copy_block(self, src: int, dst: int) -> None:
        for pair in self.kv:
            pair[:, dst].copy_(pair[:, src])
        for scales in (*self.k_scale, *self.v_scale):
            scales[dst].copy_(scales[src])

    def copy_positions(
        self, source: PagedKVStorage, layers: int, src_slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> None:
        """The K/V (and int8 scales) of `source`'s first `layers` layers at flat slots
        `src_slots` into this pool's `dst_slots`: a self-draft's layers are its target's first
        layers, so the K/V its target computed are the ones it would compute (the same layout,
        heads and formats; checked by the caller)."""
        src_rows, dst_rows = source.slot_rows(src_slots), self.slot_rows(dst_slots)
        for layer in range(layers):
            into = self.kv[layer].view(2, -1, self.head_dim)
            into.index_copy_(
                1, dst_rows, source.kv[layer].view(2, -1, self.head_dim).index_select(1, src_rows)
            )
            for mine, theirs in ((self.k_scale, source.k_scale), (self.v_scale, source.v_scale)):
                if mine:
                    mine[layer].view(-1).index_copy_(
                        0, dst_rows, theirs[layer].view(-1).index_select(0, src_rows)
                    )

    # ---- writing ---------------------------------------------------------------------------
    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows the new tokens' heads occupy in a layer's pool seen as [num_blocks * kv_heads
        * block_size, head_dim]: [T * kv_heads], token by token, head by head. Built once per
        step from the flat slot ids (block * block_size + offset) and used by every layer."""
        block, offset = slots // self.block_size, slots % self.block_size
        heads = torch.arange(self.num_kv_heads, device=slots.device)
        return ((block[:, None] * self.num_kv_heads + heads) * self.block_size + offset[:, None]).flatten()

    def write_kv(self, layer: int, rows: torch.Tensor, kv: torch.Tensor) -> None:
        """K and V together, kv [T, 2, kv_heads, head_dim] (as a fused projection lays them out),
        into `slot_rows`: one index_copy into the layer's pool (or, int8, the quantizing write)."""
        if self.quantized:
            self._write_int8(layer, rows, kv[:, 0], kv[:, 1])
            return
        pair = self.kv[layer].view(2, -1, self.head_dim)
        pair.index_copy_(1, rows, kv.transpose(0, 1).reshape(2, -1, self.head_dim).to(self.store_dtype))

    def write(self, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [T, kv_heads, head_dim] into `slot_rows`."""
        if self.quantized:
            self._write_int8(layer, rows, key, value)
            return
        for pool, states in ((self.k[layer], key), (self.v[layer], value)):
            pool.view(-1, self.head_dim).index_copy_(
                0, rows, states.reshape(-1, self.head_dim).to(self.store_dtype)
            )

    def _write_int8(self, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        for states, pools, scales in ((key, self.k, self.k_scale), (value, self.v, self.v_scale)):
            scale = (states.abs().amax(dim=-1).float() / _INT8_MAX).clamp(_SCALE_MIN, _SCALE_MAX)
            scale = scale.to(KV_INT8_SCALE_DTYPE)
            # quantize with the float16-rounded scale, the one dequantization will multiply by
            codes = torch.round(states.float() / scale.float()[..., None]).clamp(-_INT8_MAX, _INT8_MAX)
            pools[layer].view(-1, self.head_dim).index_copy_(
                0, rows, codes.to(torch.int8).reshape(-1, self.head_dim)
            )
            scales[layer].view(-1).index_copy_(0, rows, scale.reshape(-1))

    # ---- reading ---------------------------------------------------------------------------
    def gather_blocks(self, layer: int, blocks: Blocks, dtype: torch.dtype) -> torch.Tensor:
        """Whole blocks, in the order `blocks` names them (an index may repeat ids): K and V as
        one [2, len(blocks), kv_heads, block_size, head_dim] tensor in `dtype`. A view of the pool
        for consecutive blocks (a slice) in the pool's dtype; else one index_select for both."""
        if isinstance(blocks, slice):
            pair = self.kv[layer][:, blocks]  # [2, n, kv_heads, block_size, head_dim]
        else:  # one index_select over the rows of K then V: dim 0 is the fast (memcpy) path
            rows = torch.cat([blocks, blocks + self.num_blocks])
            pair = self.kv[layer].view(2 * self.num_blocks, *self.kv[layer].shape[2:]).index_select(0, rows)
            pair = pair.view(2, -1, *pair.shape[1:])
        if not self.quantized:
            return pair if pair.dtype == dtype else pair.to(dtype)
        scales = torch.stack([_pick(self.k_scale[layer], 0, blocks), _pick(self.v_scale[layer], 0, blocks)])
        return pair.to(dtype) * scales[..., None].to(dtype)

    def read(
        self, layer: int, blocks: Blocks, start: int, stop: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V at positions [start, stop), through its blocks (a `block_index`
        result covering at least `stop` tokens): two [kv_heads, stop - start, head_dim] tensors
        in `dtype` (dequantized when stored as int8)."""
        skip = start // self.block_size  # blocks wholly before the window are not read at all
        last = blocks_for_tokens(stop, self.block_size)
        blocks = (
            blocks[skip:last]
            if not isinstance(blocks, slice)
            else slice(blocks.start + skip, blocks.start + last)
        )
        start, stop = start - skip * self.block_size, stop - skip * self.block_size
        # [2, n, kv_heads, block_size, head_dim] -> [2, kv_heads, n * block_size, head_dim]
        k, v = self.gather_blocks(layer, blocks, dtype).transpose(1, 2).flatten(2, 3)[:, :, start:stop]
        return k, v

    def gather(
        self, layer: int, blocks: Blocks, context_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `context_len` K and V of a sequence: [kv_heads, context_len, head_dim] each."""
        return self.read(layer, blocks, 0, context_len, dtype)


def _pick(pool: torch.Tensor, dim: int, blocks: Blocks) -> torch.Tensor:
    """`pool` at `blocks` along its block dimension `dim`. index_select, not pool[tensor]:
    advanced indexing takes a slow generic path on CPU (~300x slower for a decode-sized gather,
    measured)."""
    if isinstance(blocks, slice):
        return pool[(slice(None),) * dim + (blocks,)]
    return pool.index_select(dim, blocks)


def block_index(block_ids: list[int], device: torch.device | str) -> Blocks:
    """How to reach a sequence's blocks in a pool: a slice when the ids are consecutive (the
    blocks are then one view of the pool, nothing is copied), else an index tensor."""
    first = block_ids[0] if block_ids else 0
    if block_ids == list(range(first, first + len(block_ids))):
        return slice(first, first + len(block_ids))
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
