"""Attention over the paged KV storage, for one packed forward of many sequences.

A forward packs every scheduled token of every sequence into one row with explicit positions. The
step's metadata (`PagedBatch`) is built once per step (the slot of every new token, each
sequence's blocks as a view or an index, the causal masks of prefill chunks), not once per layer.

Each sequence attends over exactly its own keys. With kvk every row of every sequence attends
row by row on its C kernel (engine/model/row_attention), prefill chunks too; without kvk every
sequence with at most ROW_LIMIT rows this step (a decode, a speculative verification's k + 1
rows, a tiny chunk) does, each row over exactly the positions before it, in one batched torch
computation per layer (engine/model/decode_attention: one
gather of their blocks, fixed-shape products per block, a sequential sum over blocks). Both are
batch invariant by construction: a request's tokens never depend on its neighbours, and a
verification row equals the decode at its position. Without kvk each longer prefill chunk is
causal after its cached tokens, one SDPA per chunk.

Per layer the attention honours what the family's own attention does: a sliding window (keys in
(position - window, position]), logit soft-capping (Gemma 2), attention sinks (gpt-oss: one extra
logit per head in the softmax), and the module's scaling. In a prefill chunk, soft-capping and
sinks have no fused kernel and take an explicit matmul-softmax path; the decode computation has
both built in.

Two callers: kvscope's own forward (engine/model/forward) calls `attend`; transformers' modeling
code reaches it through `paged_attention_forward`, registered with AttentionInterface, with the
metadata passed down in the forward kwargs (`paged_batch=`) and K/V written by `PagedCache.update`.
For transformers' code, what each layer does (window, soft cap, sinks) is what the load-time probe
saw it called with (engine/model/layer_attention.py, in `storage.layers`): that covers families
whose window lives in their mask alone (Phi-MoE, Qwen2-MoE) and is checked against every call.
Families whose decoder layers drop the forward's kwargs (StableLM, Persimmon) reach the batch
through `paged_attention(model, batch)`; a layer that writes K/V but attends by its own code would
read only the new tokens, so a forward where the two differ is refused (AttentionMismatch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from engine.model.attention_probs import AttentionRecorder
from engine.model.decode_attention import DecodeGroup, decode_attention
from engine.model.kv_storage import PagedKVStorage, SeqSlice
from engine.model.layer_attention import LayerAttention
from engine.model.row_attention import ROW_LIMIT, RowPlan, row_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTN_IMPLEMENTATION = "kvscope_paged"


@dataclass(slots=True)
class PagedBatch:
    storage: PagedKVStorage
    slot_mapping: torch.Tensor  # [T] flat slot id (block * block_size + offset) of each new token
    seqs: list[SeqSlice]
    # (seq index, window) -> mask, and window -> the decoding sequences' layout: once per step
    _causal: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)
    _decode: dict[int | None, DecodeGroup | None] = field(default_factory=dict)
    _rows: torch.Tensor | None = None
    _row_plan: RowPlan | None | bool = False  # False: not built yet this step
    # transformers' layers that wrote K/V and that attended through the pool, this forward
    written: list[int] = field(default_factory=list)
    attended: list[int] = field(default_factory=list)
    # Keeps every head's probabilities of the short rows (engine/model/attention_probs.py): set
    # only by a forward that inspects a token, None for every step of generation.
    recorder: AttentionRecorder | None = None

    def slot_rows(self) -> torch.Tensor:
        """Where the new tokens' K/V go in every layer's pool (storage.slot_rows), once per step."""
        if self._rows is None:
            self._rows = self.storage.slot_rows(self.slot_mapping)
        return self._rows

    def row_plan(self) -> RowPlan | None:
        """The sequences that attend row by row on kvk this step (engine/model/row_attention), or
        None without kvk."""
        if self._row_plan is False:
            self._row_plan = RowPlan.build(self.storage, self.seqs)
        plan = self._row_plan
        return plan if isinstance(plan, RowPlan) else None

    def decode_group(self, window: int | None) -> DecodeGroup | None:
        """Without kvk: the rows of every sequence with at most ROW_LIMIT rows this step, each
        one a decode at its own position over exactly the keys before it (None: there are none).
        A speculative round's verification rows are then the decodes they stand for, bit for bit,
        as on kvk's row attention (SDPA over a chunk would round them otherwise)."""
        if window not in self._decode:
            rows = [
                SeqSlice(seq.q_start + r, 1, seq.context_len - seq.q_len + r + 1, seq.blocks)
                for seq in self.seqs
                if seq.q_len <= ROW_LIMIT
                for r in range(seq.q_len)
            ]
            self._decode[window] = DecodeGroup.build(self.storage, rows, window) if rows else None
        return self._decode[window]

    def causal_mask(self, index: int, seq: SeqSlice, window: int | None) -> torch.Tensor | None:
        """Mask [q_len, context] of a prefill chunk after `past` cached tokens (None: plain causal
        from position 0, which SDPA does itself)."""
        past = seq.context_len - seq.q_len
        if past == 0 and window is None:
            return None
        key = (index, window)
        mask = self._causal.get(key)
        if mask is None:
            device = self.slot_mapping.device
            pos = torch.arange(seq.q_len, device=device)[:, None] + past
            keys = torch.arange(seq.context_len, device=device)[None, :]
            mask = keys <= pos
            if window is not None:
                mask &= keys > pos - window
            self._causal[key] = mask
        return mask


def attend(
    storage: PagedKVStorage, layer: int, q: torch.Tensor, batch: PagedBatch, how: LayerAttention
) -> torch.Tensor:
    """q [T, heads, head_dim] packed over the batch's sequences (their K/V already written) ->
    [T, heads, head_dim]. With kvk: every row of every sequence row by row in one C call
    (row_attention), prefill chunks too. Without: the rows of every sequence with at most ROW_LIMIT
    rows in one batched torch computation (decode_attention, each row a decode at its own
    position), each longer chunk by itself (SDPA). A batch with a recorder keeps every head's
    probabilities of the rows that attend row by row."""
    plan = batch.row_plan()
    recorder = batch.recorder
    if plan is not None:
        probs = None if recorder is None else recorder.kvk_buffer(layer, plan, q.shape[1], how)
        if plan.count == q.shape[0]:  # every row (a decode-only step, the common one)
            return row_attention(storage, layer, q, plan, how, probs).to(q.dtype)
        out = torch.empty_like(q)
        out[plan.rows] = row_attention(storage, layer, q[plan.rows], plan, how, probs).to(q.dtype)
        _chunks(storage, layer, q, batch, how, out, skip=plan.covered)
        return out
    if recorder is not None:
        recorder.record_torch(storage, layer, q, batch.seqs, how)
    group = batch.decode_group(how.window)
    if group is not None and group.count == q.shape[0]:  # every row (a decode-only step, the common one)
        return decode_attention(storage, layer, q[group.rows], group, how)
    out = torch.empty_like(q)
    if group is not None:
        out[group.rows] = decode_attention(storage, layer, q[group.rows], group, how)
    _chunks(
        storage,
        layer,
        q,
        batch,
        how,
        out,
        skip=frozenset(i for i, s in enumerate(batch.seqs) if s.q_len <= ROW_LIMIT),
    )
    return out


def _chunks(
    storage: PagedKVStorage,
    layer: int,
    q: torch.Tensor,
    batch: PagedBatch,
    how: LayerAttention,
    out: torch.Tensor,
    skip: frozenset[int],
) -> None:
    """Each sequence not in `skip`: one SDPA over its chunk, causal after its cached tokens."""
    for index, seq in enumerate(batch.seqs):
        if index in skip:
            continue
        start = 0 if how.window is None else max(0, seq.context_len - seq.q_len - how.window + 1)
        k, v = storage.read(layer, seq.blocks, start, seq.context_len, q.dtype)  # [kv_heads, L, d]
        rows = q[seq.q_start : seq.q_start + seq.q_len]
        mask = batch.causal_mask(index, seq, how.window)
        if mask is not None and start:
            mask = mask[:, start:]
        o = _sdpa(rows.transpose(0, 1)[None], k[None], v[None], mask, how, causal=mask is None)
        out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    how: LayerAttention,
    causal: bool = False,
) -> torch.Tensor:
    """[B, heads, n, d] x [B, kv_heads, L, d]: SDPA, or the explicit path for soft-capping/sinks."""
    if how.softcap is None and how.sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=how.scaling, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = how.scaling if how.scaling is not None else q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    if how.softcap is not None:
        scores = torch.tanh(scores / how.softcap) * how.softcap
    if causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if how.sinks is not None:  # the sink takes probability mass and gives no value
        sink = how.sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined.float(), dim=-1).to(q.dtype)[..., :-1]
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out: torch.Tensor = probs @ v
    return out


# ---- transformers' modeling code --------------------------------------------------------------
# The batch of the forward in progress, for layers that do not pass the forward's kwargs on.
_ACTIVE_BATCH: ContextVar[PagedBatch | None] = ContextVar("kvscope_paged_batch", default=None)


def batch_of(kwargs: dict[str, Any] | None) -> PagedBatch:
    batch: PagedBatch | None = (kwargs or {}).get("paged_batch") or _ACTIVE_BATCH.get()
    if batch is None:
        raise RuntimeError("paged attention ran outside a paged forward (no batch given)")
    return batch


class AttentionMismatch(RuntimeError):
    """The model's attention is not what kvscope probed at load: stop rather than be wrong."""


def layer_attention(
    batch: PagedBatch, layer_idx: int, scaling: float | None, kwargs: dict[str, Any]
) -> LayerAttention:
    """How layer `layer_idx` attends: as probed at load (storage.layers), checked against this
    call (the soft cap, the sinks, and the window where the call names one: some families slide
    through their mask alone); as the call says when the storage has no probe (hand-built)."""
    sinks = kwargs.get("s_aux")
    window, softcap = kwargs.get("sliding_window") or None, kwargs.get("softcap") or None
    probed = batch.storage.layers[layer_idx] if batch.storage.layers is not None else None
    if probed is not None:
        if (window is not None and window != probed.window) or (softcap, sinks is not None) != (
            probed.softcap,
            probed.sinks,
        ):
            raise AttentionMismatch(
                f"layer {layer_idx} attends with window {window}, soft cap {softcap}, sinks "
                f"{sinks is not None}, but kvscope probed {probed} at load; it stops rather than give wrong tokens"
            )
        window = probed.window
    return LayerAttention(scaling=scaling, window=window, softcap=softcap, sinks=sinks)


class PagedCache(Cache):
    """A transformers Cache whose `update` writes into the block pool instead of growing tensors."""

    def __init__(self) -> None:
        super().__init__(layers=[])

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        kwargs: dict[str, Any] | None = None,
        *args: Any,
        **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch_of(kwargs or extra)
        batch.written.append(layer_idx)
        # [1, kv_heads, T, head_dim] -> [T, kv_heads, head_dim], scattered into the slots
        batch.storage.write(
            layer_idx, batch.slot_rows(), key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        )
        return key_states, value_states  # unused: attention reads the pool

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [1, heads, T, head_dim] packed over sequences. Returns ([1, T, heads, head_dim], None)."""
    batch = batch_of(kwargs)
    layer = cast(int, module.layer_idx)  # every transformers attention module numbers its layer
    batch.attended.append(layer)
    how = layer_attention(batch, layer, scaling, kwargs)
    out = attend(batch.storage, layer, query[0].transpose(0, 1), batch, how)
    return out[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@contextmanager
def paged_attention(model: PreTrainedModel, batch: PagedBatch | None = None) -> Iterator[None]:
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
