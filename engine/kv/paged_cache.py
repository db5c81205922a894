"""The real paged KV storage and the attention that reads it through block tables.

Per layer, K and V live in `[num_blocks, block_size, kv_heads, head_dim]` tensors. A forward
packs every scheduled token of every sequence into one row (batch 1) with explicit position ids;
`PagedCache.update` (called by transformers' attention layers) scatters the new K/V into their
slots, and `paged_attention_forward` (registered with transformers' `AttentionInterface`) gathers
each sequence's K/V through its block table and attends causally. One forward therefore serves
prefill chunks and decodes of many sequences at once (continuous batching).

The batch description travels to both through the model's forward kwargs (`paged_batch=`),
which transformers passes down to `cache.update(..., kwargs=...)` and to the attention function,
and through `paged_attention(model, batch)` for families whose decoder layers drop those kwargs
(StableLM, Persimmon, GPT-NeoX-Japanese...).

Each layer does what its family's attention does (probed at load: engine/model/layer_attention.py): a sliding
layer reads only the blocks of its window and masks the rest, Gemma 2 soft-caps its logits and
gpt-oss adds its sink logits (those two through an explicit softmax: SDPA has neither).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from engine.model.layer_attention import LayerAttention

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
        self,
        num_layers,
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        dtype,
        device,
        kv_dtype="auto",
        layers: tuple[LayerAttention, ...] | None = None,
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
        # Per layer: window, soft cap, sinks (probed once at load). None: what each call's kwargs
        # say (tests that build a storage by hand).
        if layers is not None and len(layers) != num_layers:
            raise ValueError(f"{len(layers)} layer descriptions for {num_layers} layers")
        self.layers = tuple(layers) if layers is not None else None
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

    def gather(self, layer_idx: int, blocks, context_len: int, dtype: torch.dtype, start: int = 0):
        """One sequence's K and V of positions [start, context_len) through its blocks (a
        `SeqSlice.blocks`), dequantized to `dtype` when stored as int8: two [L, kv_heads,
        head_dim] tensors. Blocks wholly before `start` are not read (a sliding window)."""
        skip = start // self.block_size
        blocks = drop_blocks(blocks, skip)
        first, last = start - skip * self.block_size, context_len - skip * self.block_size
        if not self.quantized:
            return [
                gather_blocks(pool[layer_idx], blocks).flatten(0, 1)[first:last] for pool in (self.k, self.v)
            ]
        out = []
        for pools, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            codes = gather_blocks(pools[layer_idx], blocks).flatten(0, 1)[first:last]
            scale = gather_blocks(scales[layer_idx], blocks).flatten(0, 1)[first:last]
            out.append(codes.to(dtype) * scale[..., None].to(dtype))
        return out

    def layer(self, layer_idx: int, call_kwargs: dict) -> LayerAttention:
        """What layer `layer_idx` does: as probed at load when given, else as this call says."""
        if self.layers is not None:
            return self.layers[layer_idx]
        return LayerAttention.of_call(call_kwargs)


def block_index(block_ids: list[int], device) -> slice | torch.Tensor:
    """How to reach a sequence's blocks in a pool: a slice when the ids are consecutive (the
    blocks are then one view of the pool, nothing is copied; a fresh pool hands out ids in
    order, so this is the common case of a single conversation), else an index tensor."""
    first = block_ids[0] if block_ids else 0
    if block_ids == list(range(first, first + len(block_ids))):
        return slice(first, first + len(block_ids))
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def drop_blocks(blocks: slice | torch.Tensor, n: int) -> slice | torch.Tensor:
    """A `block_index` without its first `n` blocks."""
    if n == 0:
        return blocks
    if isinstance(blocks, slice):
        return slice(blocks.start + n, blocks.stop)
    return blocks[n:]


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
    # Layers that wrote K/V and layers that attended through the pool, this forward: a layer
    # that writes but computes its own attention (Bloom's ALiBi) would read only the new
    # tokens' K/V and be silently wrong, so `paged_attention` refuses the forward instead.
    written: list[int] = field(default_factory=list)
    attended: list[int] = field(default_factory=list)


# The batch of the forward in progress, for layers that do not pass the forward's kwargs on.
_ACTIVE_BATCH: ContextVar[PagedBatch | None] = ContextVar("kvscope_paged_batch", default=None)


def batch_of(kwargs: dict | None) -> PagedBatch:
    batch = (kwargs or {}).get("paged_batch") or _ACTIVE_BATCH.get()
    if batch is None:
        raise RuntimeError("paged attention ran outside a paged forward (no batch given)")
    return batch


class PagedCache(Cache):
    """A transformers Cache whose `update` writes into the block pool instead of growing tensors."""

    def __init__(self):
        super().__init__(layers=[])

    def update(self, key_states, value_states, layer_idx, kwargs=None, *args, **extra):
        batch = batch_of(kwargs or extra)
        batch.written.append(layer_idx)
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


class AttentionMismatch(RuntimeError):
    """The model's attention is not what kvscope read from its config: stop rather than be wrong."""


def check_call(layer: LayerAttention, layer_idx: int, kwargs: dict) -> None:
    """What transformers passes this layer must be what the load-time probe saw
    (engine/model/layer_attention.py): the soft cap, the sinks, and the window where the call
    names one (some families slide through their mask alone). Three lookups per layer and step."""
    called = LayerAttention.of_call(kwargs)
    window_differs = called.window is not None and called.window != layer.window
    if window_differs or (called.softcap, called.sinks) != (layer.softcap, layer.sinks):
        raise AttentionMismatch(
            f"layer {layer_idx} attends with {called}, but kvscope probed {layer} at load; "
            "it stops rather than give wrong tokens"
        )


def visible_keys(past: int, q_len: int, window: int | None) -> int:
    """First key position any of a chunk's queries (positions past .. past + q_len - 1) sees."""
    return 0 if window is None else max(0, past - window + 1)


def chunk_mask(past: int, q_len: int, first_key: int, context_len: int, window: int | None, device):
    """(mask, is_causal) for a chunk's queries over keys [first_key, context_len): query at p sees
    key j when j <= p and, in a sliding window, j > p - window (transformers' overlay). None and
    a flag where SDPA needs no explicit mask."""
    if q_len == 1:
        return None, False  # a decode reads exactly the keys it sees (first_key: visible_keys)
    if past == 0 and (window is None or q_len <= window):
        return None, True
    rows = torch.arange(q_len, device=device)[:, None] + past
    cols = torch.arange(first_key, context_len, device=device)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask, False


def attend_explicit(q, k, v, mask, causal: bool, scale, softcap: float | None, sinks):
    """softmax(Q K^T * scale) V by hand, for what SDPA lacks: Gemma 2's soft cap (as its eager
    attention: cap before the mask, softmax in float32) and gpt-oss's sinks (a per-head logit in
    the softmax, dropped after it). q [heads, n, d], k/v [kv_heads, L, d] -> [heads, n, d]."""
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = torch.matmul(q, k.transpose(1, 2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    else:
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, heads, T, head_dim] packed over sequences. Returns ([1, T, heads, head_dim], None)."""
    batch = batch_of(kwargs)
    batch.attended.append(module.layer_idx)
    storage = batch.storage
    layer = storage.layer(module.layer_idx, kwargs)
    check_call(layer, module.layer_idx, kwargs)
    sinks = kwargs.get("s_aux") if layer.sinks else None
    q_all = query[0]
    single = len(batch.seqs) == 1  # one sequence fills the whole row: no output buffer to assemble
    out = (
        None if single else query.new_empty(q_all.shape[1], q_all.shape[0], q_all.shape[2])
    )  # [T, heads, head_dim]
    for s in batch.seqs:
        past = s.context_len - s.q_len
        first = visible_keys(past, s.q_len, layer.window)
        k, v = storage.gather(module.layer_idx, s.blocks, s.context_len, query.dtype, start=first)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, L, head_dim]
        q = q_all[:, s.q_start : s.q_start + s.q_len]  # [heads, n, head_dim]
        mask, causal = chunk_mask(past, s.q_len, first, s.context_len, layer.window, q.device)
        if layer.plain:
            o = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True
            )[0]
        else:
            o = attend_explicit(q, k, v, mask, causal, scaling, layer.softcap, sinks)
        if single:
            return o.transpose(0, 1)[None], None
        out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1)
    return out[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@contextmanager
def paged_attention(model, batch: PagedBatch | None = None):
    """Route the model's attention through the paged kernel for one forward, then restore it
    (so the same model object still serves transformers' own generate() as a reference).
    `batch` reaches layers that drop the forward's kwargs."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_IMPLEMENTATION
    token = _ACTIVE_BATCH.set(batch)
    try:
        yield
    finally:
        _ACTIVE_BATCH.reset(token)
        config._attn_implementation = previous
    if batch is not None and sorted(batch.written) != sorted(batch.attended):
        raise AttentionMismatch(
            f"layers {sorted(set(batch.written) ^ set(batch.attended))} wrote K/V without attending through "
            "the paged cache (or the reverse): this model's attention bypasses kvscope's, whose tokens would be wrong"
        )
