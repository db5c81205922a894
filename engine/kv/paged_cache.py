"""The real paged KV storage and the attention that reads it through block tables.

Per layer, K and V live in `[num_blocks, block_size, kv_heads, head_dim]` tensors. A forward
packs every scheduled token of every sequence into one row (batch 1) with explicit position ids;
`PagedCache.update` (called by transformers' attention layers) scatters the new K/V into their
slots, and `paged_attention_forward` (registered with transformers' `AttentionInterface`) gathers
each sequence's K/V through its block table and attends causally. One forward therefore serves
prefill chunks and decodes of many sequences at once (continuous batching).

The batch description travels to both through the model's forward kwargs (`paged_batch=`),
which transformers passes down to `cache.update(..., kwargs=...)` and to the attention function.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

ATTN_IMPLEMENTATION = "kvscope_paged"


# int8 KV: one scale per (block, slot, kv_head), i.e. per token and head, not per block.
# - A token's K/V is written once and never rewritten. A per-block scale would have to be fixed
#   before the block's later tokens are known (decode fills a block one slot per step), or the
#   whole block re-quantized when a larger value arrives; and full blocks are shared by prefix
#   caching, so they must stay immutable.
# - Heads differ in range (some K heads carry outlier channels), so heads do not share a scale.
# - The cost is one float16 per head_dim int8 values: for head_dim 64, 66 bytes instead of 256
#   (fp32, 3.9x the blocks per budget) or 128 (fp16/bf16, 1.94x).
KV_INT8_SCALE_DTYPE = torch.float16
_INT8_MAX = 127
# Scales stay inside float16's range: the smallest subnormal (a zero vector still gets a usable
# scale) up to the largest finite value (beyond it codes saturate instead of becoming inf).
_SCALE_MIN, _SCALE_MAX = 2.0**-24, 65504.0


class PagedKVStorage:
    def __init__(
        self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, kv_dtype="auto"
    ):
        if kv_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'int8', got {kv_dtype!r}")
        self.quantized = kv_dtype == "int8"
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        store = torch.int8 if self.quantized else dtype
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.quantized:
            scale_shape = (num_blocks, block_size, num_kv_heads)
            for scales in (self.k_scale, self.v_scale):
                scales.extend(
                    torch.zeros(scale_shape, dtype=KV_INT8_SCALE_DTYPE, device=device)
                    for _ in range(num_layers)
                )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.kv_dtype = kv_dtype
        self.bytes_per_block = self.block_bytes(
            num_layers, block_size, num_kv_heads, head_dim, dtype, kv_dtype
        )

    @staticmethod
    def block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype, kv_dtype="auto") -> int:
        """Bytes one block takes over all layers, K and V, scales included (for pool sizing)."""
        if kv_dtype == "int8":
            per_head = head_dim + torch.empty((), dtype=KV_INT8_SCALE_DTYPE).element_size()
        else:
            per_head = head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * per_head

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def copy_block(self, src: int, dst: int) -> None:
        for pool in (*self.k, *self.v, *self.k_scale, *self.v_scale):
            pool[dst].copy_(pool[src])

    def write_int8(self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Quantize key/value [T, kv_heads, head_dim] per (token, head) into their slots."""
        heads = self.num_kv_heads
        for states, pools, scales in ((key, self.k, self.k_scale), (value, self.v, self.v_scale)):
            scale = (states.abs().amax(dim=-1).float() / _INT8_MAX).clamp(_SCALE_MIN, _SCALE_MAX)
            scale = scale.to(KV_INT8_SCALE_DTYPE)
            # quantize with the float16-rounded scale, the one dequantization will multiply by
            codes = torch.round(states.float() / scale.float()[..., None]).clamp(-_INT8_MAX, _INT8_MAX)
            pools[layer_idx].view(-1, heads, self.head_dim).index_copy_(0, slots, codes.to(torch.int8))
            scales[layer_idx].view(-1, heads).index_copy_(0, slots, scale)

    def gather(self, layer_idx: int, blocks, context_len: int, dtype: torch.dtype):
        """One sequence's first `context_len` K and V through its blocks (a `SeqSlice.blocks`),
        dequantized to `dtype` when stored as int8: two [L, kv_heads, head_dim] tensors."""
        if not self.quantized:
            return [
                gather_blocks(pool[layer_idx], blocks).flatten(0, 1)[:context_len]
                for pool in (self.k, self.v)
            ]
        out = []
        for pools, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            codes = gather_blocks(pools[layer_idx], blocks).flatten(0, 1)[:context_len]
            scale = gather_blocks(scales[layer_idx], blocks).flatten(0, 1)[:context_len]
            out.append(codes.to(dtype) * scale[..., None].to(dtype))
        return out


def block_index(block_ids: list[int], device) -> slice | torch.Tensor:
    """How to reach a sequence's blocks in a pool: a slice when the ids are consecutive (the
    blocks are then one view of the pool, nothing is copied; a fresh pool hands out ids in
    order, so this is the common case of a single conversation), else an index tensor."""
    first = block_ids[0] if block_ids else 0
    if block_ids == list(range(first, first + len(block_ids))):
        return slice(first, first + len(block_ids))
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def gather_blocks(pool: torch.Tensor, blocks: slice | torch.Tensor) -> torch.Tensor:
    """pool[blocks] along the block dimension. index_select, not pool[tensor]: advanced indexing
    takes a slow generic path on CPU (~300x slower for a decode-sized gather, measured)."""
    return pool[blocks] if isinstance(blocks, slice) else pool.index_select(0, blocks)


@dataclass(slots=True)
class SeqSlice:
    """One sequence's share of a packed forward."""

    q_start: int  # first of its query tokens in the packed row
    q_len: int  # query tokens this step
    context_len: int  # tokens in the cache after this step (past + new)
    blocks: slice | torch.Tensor  # the blocks covering context_len tokens (see block_index)


@dataclass(slots=True)
class PagedBatch:
    storage: PagedKVStorage
    slot_mapping: torch.Tensor  # [T] flat slot id (block * block_size + offset) of each new token
    seqs: list[SeqSlice]


class PagedCache(Cache):
    """A transformers Cache whose `update` writes into the block pool instead of growing tensors."""

    def __init__(self):
        super().__init__(layers=[])

    def update(self, key_states, value_states, layer_idx, kwargs=None, *args, **extra):
        batch: PagedBatch = (kwargs or {}).get("paged_batch") or extra.get("paged_batch")
        storage = batch.storage
        if storage.quantized:
            key, value = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
            storage.write_int8(layer_idx, batch.slot_mapping, key, value)
            return key_states, value_states
        flat = (-1, storage.num_kv_heads, storage.head_dim)
        # [1, kv_heads, T, head_dim] -> [T, kv_heads, head_dim], scattered into the slots
        storage.k[layer_idx].view(flat).index_copy_(0, batch.slot_mapping, key_states[0].transpose(0, 1))
        storage.v[layer_idx].view(flat).index_copy_(0, batch.slot_mapping, value_states[0].transpose(0, 1))
        return key_states, value_states  # unused: attention reads the pool

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return query_length, 0


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, heads, T, head_dim] packed over sequences. Returns ([1, T, heads, head_dim], None)."""
    batch: PagedBatch = kwargs["paged_batch"]
    storage = batch.storage
    q_all = query[0]
    single = len(batch.seqs) == 1  # one sequence fills the whole row: no output buffer to assemble
    out = (
        None if single else query.new_empty(q_all.shape[1], q_all.shape[0], q_all.shape[2])
    )  # [T, heads, head_dim]
    for s in batch.seqs:
        k, v = storage.gather(module.layer_idx, s.blocks, s.context_len, query.dtype)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, L, head_dim]
        q = q_all[:, s.q_start : s.q_start + s.q_len]  # [heads, n, head_dim]
        past = s.context_len - s.q_len
        if s.q_len == 1:
            mask, causal = None, False
        elif past == 0:
            mask, causal = None, True
        else:  # a prefill chunk after cached tokens: query j sees keys <= past + j
            rows = torch.arange(s.q_len, device=q.device)[:, None] + past
            mask, causal = torch.arange(s.context_len, device=q.device)[None, :] <= rows, False
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True
        )
        if single:
            return o.transpose(1, 2), None
        out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
    return out[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@contextmanager
def paged_attention(model):
    """Route the model's attention through the paged kernel for one forward, then restore it
    (so the same model object still serves transformers' own generate() as a reference)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = previous
